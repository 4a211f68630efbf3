"""The demo's speed-quality frontier at sample sizes that separate settings.

    python scripts/frontier.py sample --root SAMPLES [--per-class 50] [--seed-sets 0,1] [--device cpu]
    python scripts/frontier.py score --root SAMPLES --bench results/frontier_*.json --out results/frontier_quality_cpu.json

`sample` runs `runtime sample` for every setting of `scripts/frontier_settings.toml`, one folder per
setting and seed set (SAMPLES/<name>/s<seed>), in the file's order, seed set by seed set, so that an
interrupted run resumes where it stopped (`runtime sample` resumes a folder chunk by chunk) and
the first seed set of every setting is done before the second starts. Speed does not come from
these runs (their batch is as large as helps): it comes from `runtime bench`.

`score` reads every finished folder and writes the quality of each setting against AR on the same
seeds and classes (`runtime.tools.quality_budget`), beside the bench's speedup, tau and step TVD.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SETTINGS = HERE / "frontier_settings.toml"


def settings(path: Path = SETTINGS) -> list[dict]:
    """The `[[setting]]` tables of the settings file, in order."""
    import tomllib

    with path.open("rb") as f:
        return tomllib.load(f)["setting"]


def sample(args: argparse.Namespace) -> int:
    root = Path(args.root)
    seed_sets = [int(s) for s in args.seed_sets.split(",")]
    table = settings()
    if args.only:  # in the order given
        by_name = {s["name"]: s for s in table}
        unknown = [n for n in args.only.split(",") if n not in by_name]
        if unknown:
            print(f"sample: no setting named {', '.join(unknown)} in {SETTINGS.name}", file=sys.stderr)
            return 2
        table = [by_name[n] for n in args.only.split(",")]
    failed = 0
    for seed in seed_sets:
        for s in table:
            run_seed = seed + int(s.get("seed_offset", 0))
            out = root / s["name"] / f"s{run_seed}"
            if (out / "samples.npz").exists():
                continue
            batch = args.batch_size if s["args"][1] == "ar" else args.draft_batch_size
            cmd = ["runtime", "sample", "--device", args.device, "--per-class", str(args.per_class),
                   "--chunk", str(args.chunk), "--batch-size", str(batch), "--seed", str(run_seed),
                   *(["--graph"] if args.graph else []), "--out", str(out), *s["args"]]
            print(time.strftime("%H:%M:%S"), " ".join(cmd), flush=True)
            started = time.time()
            rc = subprocess.call(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
            print(f"{time.strftime('%H:%M:%S')} {s['name']} s{run_seed}: rc {rc}, {time.time() - started:.0f} s",
                  flush=True)
            failed += rc != 0  # the next settings still run: an unattended run loses one point, not the rest
    return 1 if failed else 0


# `runtime sample` flags -> bench file `params` fields, for matching a setting to its bench run
ARG_FIELDS = {"--tree": ("tree", str), "--lantern-lambda": ("lantern_lambda", float),
              "--lantern-delta": ("lantern_delta", float), "--relax-rule": ("relax_rule", str),
              "--depth": ("depth", int), "--top-k-draft": ("top_k_draft", int),
              "--total-tokens": ("total_tokens", int), "--coupling": ("coupling", str),
              "--proactive": ("proactive", lambda v: v.replace(",", "x")), "--accept": ("accept", str),
              "--pjd-rows": ("pjd_rows", int), "--pjd-window": ("pjd_window", int), "--init": ("init", str),
              "--cool-delta": ("cool_delta", float), "--cool-nu": ("cool_nu", float), "--residual": ("residual", str)}


def setting_params(args: list[str]) -> tuple[str, dict]:
    """(method, {params field: value}) of a setting's flags."""
    flags = dict(zip(args[::2], args[1::2]))
    params = {ARG_FIELDS[f][0]: ARG_FIELDS[f][1](v) for f, v in flags.items() if f in ARG_FIELDS}
    return flags["--method"], params


def bench_match(benches: list, method: str, params: dict):
    """(file, bench result, run) whose method and params equal the setting's, the first found; or None."""
    for path, result in benches:
        for run in result.runs:
            if run.method == method and all(getattr(run.params, k, None) == v for k, v in params.items()):
                return path, result, run
    return None


def load_sets(root: Path, name: str, seeds: list[int]):
    """{seed: (images uint8 (N, H, W, 3), labels (N,), result.json)} of a setting's finished seed sets."""
    import json

    import numpy as np

    out = {}
    for seed in seeds:
        folder = root / name / f"s{seed}"
        if (folder / "samples.npz").exists() and (folder / "result.json").exists():
            with np.load(folder / "samples.npz") as npz:
                out[seed] = (npz["arr_0"], npz["arr_1"], json.loads((folder / "result.json").read_text()))
    return out


def score(args: argparse.Namespace) -> int:
    import json

    import numpy as np

    from runtime.bench.report.numbers import speedup_ci, tau_ci
    from runtime.bench.schema import ar_baseline, load_bench
    from runtime.cli.workload import software_record
    from runtime.generation.workload import merge_law
    from runtime.demo.bundle import load_demo_bundle
    from runtime.demo.quality import demo_scores
    from runtime.tools.quality_budget import RESAMPLES, band, judge, own, paired

    root = Path(args.root)
    bundle = load_demo_bundle()
    benches = [(b, load_bench(Path(b))) for b in args.bench]
    table = settings()
    ar_setting = next(s for s in table if s["name"] == "ar")
    ar_b_setting = next(s for s in table if s["name"] == "ar_b")
    offset = int(ar_b_setting.get("seed_offset", 0))
    ar_sets = load_sets(root, "ar", list(range(0, 100)))
    ar_b_sets = load_sets(root, "ar_b", [s + offset for s in ar_sets])
    seeds = sorted(s for s in ar_sets if s + offset in ar_b_sets)
    if not seeds:
        print("score: no seed set with both ar and ar_b finished", file=sys.stderr)
        return 2

    def joined(sets: dict, keys: list[int]):
        images = np.concatenate([sets[k][0] for k in keys])
        labels = np.concatenate([sets[k][1] for k in keys])
        return images, labels

    ar_images, ar_labels = joined(ar_sets, seeds)
    b_images, b_labels = joined(ar_b_sets, [s + offset for s in seeds])
    if not np.array_equal(ar_labels, b_labels):
        raise SystemExit("score: ar and ar_b differ in their classes")
    ar_scores, b_scores = demo_scores(bundle, ar_images, ar_labels), demo_scores(bundle, b_images, b_labels)
    ar_vs_ar = paired(b_scores, ar_scores, args.resamples)
    bands = band(ar_vs_ar)
    print(f"AR vs AR at {len(ar_labels)} images: " + ", ".join(f"{m} {e.text()}" for m, e in ar_vs_ar.items()),
          flush=True)
    rows = []
    for s in table:
        if s["name"] in ("ar", "ar_b"):
            continue
        sets = load_sets(root, s["name"], seeds)
        if set(sets) != set(seeds):  # judged only on every seed set AR has, so the band applies
            print(f"score: {s['name']}: seed sets {sorted(sets)} of {seeds} finished; skipped", flush=True)
            continue
        images, labels = joined(sets, seeds)
        verdict = judge(demo_scores(bundle, images, labels), ar_scores, bands, reps=args.resamples)
        stats = [sets[k][2]["stats"] for k in seeds]
        forwards = sum(st["target_forwards"] for st in stats)
        method, params = setting_params(s["args"])
        row = {"name": s["name"], "args": s["args"], "method": method, "params": params,
               **verdict.to_dict(),
               "tau": sum(st["mean_accepted_length"] * st["target_forwards"] for st in stats) / forwards,
               **merge_law(stats)}
        match = bench_match(benches, method, params)
        if match is not None:
            path, result, run = match
            ci, tau = speedup_ci(run, ar_baseline(result.runs, run.params.batch_size)), tau_ci(run)
            row["bench"] = {"file": path,
                            "device": result.device.name, "num_images": result.workload.num_images,
                            "repeats": result.env.repeats, "speedup": run.speedup_vs_ar,
                            "speedup_lo": ci.low if ci else None, "speedup_hi": ci.high if ci else None,
                            "tau": run.stats.mean_accepted_length, "tau_lo": tau.low if tau else None,
                            "tau_hi": tau.high if tau else None, "step_tvd": run.stats.step_tvd,
                            "step_tvd_bound": run.stats.step_tvd_bound}
        rows.append(row)
        print(f"{s['name']}: {'indistinguishable' if verdict.indistinguishable else 'distinguishable'}; "
              + ", ".join(f"{m} {e.text()}" for m, e in verdict.vs_ar.items()), flush=True)
    if args.keep:
        rows = kept_rows(Path(args.keep), rows, seeds, len(ar_labels),
                         {m: e.to_dict() for m, e in own(ar_scores, args.resamples).items()}, bands)
    fastest = max((r for r in rows if r["indistinguishable"] and r.get("bench")),
                  key=lambda r: r["bench"]["speedup"], default=None)
    out = {"kind": "frontier", "software": software_record(), "model": "demo",
           "seed_sets": seeds, "per_setting": len(ar_labels), "resamples": args.resamples,
           "ar": {"figures": {m: e.to_dict() for m, e in own(ar_scores, args.resamples).items()},
                  "tau": 1.0},
           "ar_vs_ar": {m: e.to_dict() for m, e in ar_vs_ar.items()}, "band": bands,
           "rule": "indistinguishable from AR: |paired difference| <= band for every figure",
           "settings": rows, "fastest_indistinguishable": fastest["name"] if fastest else None}
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"score: {len(rows)} settings at {len(ar_labels)} images each -> {args.out}; fastest indistinguishable: "
          f"{out['fastest_indistinguishable']}")
    if args.figure:
        figure(out, Path(args.figure))
    return 0


def kept_rows(path: Path, rows: list[dict], seeds: list[int], n: int, ar_figures: dict, bands: dict) -> list[dict]:
    """`rows` plus the rows of an earlier frontier file for the settings not scored now (their
    sample folders are gone), in the settings file's order. Taken only when that file was
    scored on the same seed sets and sample size against the same AR images (its AR figures
    and band equal these, FD to 1e-4, which the deterministic sampler and scorer give for the
    same seeds):
    then its paired differences and verdicts hold against the same AR and band."""
    import json

    old = json.loads(path.read_text())
    if old["seed_sets"] != seeds or old["per_setting"] != n:
        raise SystemExit(f"score --keep: {path} holds seed sets {old['seed_sets']} x {old['per_setting']} images, "
                         f"this run {seeds} x {n}")
    if not (_close(old["ar"]["figures"], ar_figures) and _close(old["band"], bands)):
        raise SystemExit(f"score --keep: {path}'s AR figures or band differ from this run's (other AR images): "
                         "not comparable")
    have = {r["name"] for r in rows}
    merged = {r["name"]: r for r in old["settings"] if r["name"] not in have} | {r["name"]: r for r in rows}
    order = [s["name"] for s in settings()]
    return sorted(merged.values(), key=lambda r: order.index(r["name"]) if r["name"] in order else len(order))


def _close(a, b, rel: float = 1e-4) -> bool:
    """Equal numbers (nested dicts), up to the last digits FD's matrix square root may move
    between runs on the same images."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_close(a[k], b[k], rel) for k in a)
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-12)


def figure(frontier: dict, path: Path) -> None:
    """Speed against quality: one panel per figure, x the bench's speedup, y the paired difference
    from AR, error bars both ways, one line per method and rule, the AR-vs-AR band shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = list(frontier["band"])
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.2 * len(metrics), 3.8), squeeze=False)
    lines: dict[str, list[dict]] = {}
    for row in frontier["settings"]:
        if not row.get("bench"):
            continue
        rule = row["params"].get("relax_rule", row["params"].get("accept", "exact"))
        lines.setdefault(f"{row['method']} {rule}", []).append(row)
    for ax, m in zip(axes[0], metrics):
        ax.axhspan(-frontier["band"][m], frontier["band"][m], color="0.88", label="AR-vs-AR band")
        ax.axvline(1.0, color="0.6", lw=0.8)
        for label, rows in sorted(lines.items()):
            rows = sorted(rows, key=lambda r: r["bench"]["speedup"])
            x = [r["bench"]["speedup"] for r in rows]
            y = [r["vs_ar"][m]["value"] for r in rows]
            xerr = [[r["bench"]["speedup"] - (r["bench"]["speedup_lo"] or r["bench"]["speedup"]) for r in rows],
                    [(r["bench"]["speedup_hi"] or r["bench"]["speedup"]) - r["bench"]["speedup"] for r in rows]]
            yerr = [[r["vs_ar"][m]["value"] - r["vs_ar"][m]["lo"] for r in rows],
                    [r["vs_ar"][m]["hi"] - r["vs_ar"][m]["value"] for r in rows]]
            ax.errorbar(x, y, xerr=xerr, yerr=yerr, marker="o", ms=4, capsize=2, lw=1, label=label)
        ax.set_xlabel("speedup over AR (bench)")
        ax.set_ylabel(f"{m}: setting - AR (paired)")
        ax.set_title(m.replace("_", " "))
    axes[0][0].legend(fontsize=7, loc="best")
    fig.suptitle(f"demo, {frontier['per_setting']} images per setting: speed against quality", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(args: argparse.Namespace) -> int:
    """The frontier file as the markdown table docs/results.md carries."""
    import json

    f = json.loads(Path(args.file).read_text())

    def est(e: dict, fmt: str = "+.3f") -> str:
        return f"{e['value']:{fmt}} [{e['lo']:{fmt}}, {e['hi']:{fmt}}]"

    metrics = list(f["band"])
    head = ["setting", "speedup (bench)", "tau", "step TVD / bound", *[f"{m} vs AR" for m in metrics], "verdict"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    ar = f["ar"]["figures"]
    print("| ar (own figures) | 1.00x | 1.00 | - | " + " | ".join(est(ar[m], ".3f") for m in metrics) + " | - |")
    print("| ar_b - ar (the band: max abs end) | - | 1.00 | - | "
          + " | ".join(f"{est(f['ar_vs_ar'][m])} (±{f['band'][m]:.3f})" for m in metrics) + " | - |")
    for r in f["settings"]:
        b = r.get("bench")
        speed = "-" if not b else (f"{b['speedup']:.2f}x [{b['speedup_lo']:.2f}, {b['speedup_hi']:.2f}]"
                                   if b.get("speedup_lo") is not None else f"{b['speedup']:.2f}x")
        tvd = "-" if r.get("step_tvd") is None else f"{r['step_tvd']:.3f} / {r['step_tvd_bound']:.3f}"
        if tvd == "-" and b and b.get("step_tvd") is not None:
            tvd = f"{b['step_tvd']:.3f} / {b['step_tvd_bound']:.3f} (bench)"
        worse = ", ".join(f"{m} {v:+.3f}" for m, v in r["worse"].items())
        verdict = "indistinguishable" if r["indistinguishable"] else ("worse: " + worse if worse else "outside the band")
        print(f"| {r['name']} | {speed} | {r['tau']:.2f} | {tvd} | "
              + " | ".join(est(r["vs_ar"][m]) for m in metrics) + f" | {verdict} |")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("sample", help="generate every setting's images (resumable)")
    p.add_argument("--root", required=True, help="folder of the sample folders (outside the repository)")
    p.add_argument("--per-class", type=int, default=50)
    p.add_argument("--seed-sets", default="0,1", help="run seeds; each is per-class x 12 more images per setting")
    p.add_argument("--chunk", type=int, default=120)
    p.add_argument("--batch-size", type=int, default=60, help="AR's batch (the tokens do not depend on it)")
    p.add_argument("--draft-batch-size", type=int, default=16,
                   help="the drafted methods' batch: on a CPU a wide verify is compute-bound, so speculation "
                        "pays at small batches only")
    p.add_argument("--graph", action="store_true", help="capture the steps (compiles once per setting)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--only", default="", help="comma-separated setting names, sampled in that order (default: all, "
                        "in the file's order)")
    p.set_defaults(run=sample)
    p = sub.add_parser("score", help="quality of every finished setting against AR, beside the bench's speed")
    p.add_argument("--root", required=True)
    p.add_argument("--bench", nargs="*", default=[], help="bench result files with the settings' speedups")
    p.add_argument("--resamples", type=int, default=200)
    p.add_argument("--out", required=True, help="the frontier result file (JSON)")
    p.add_argument("--figure", default="", help="also draw speed against quality to this PNG")
    p.add_argument("--keep", default="", help="an earlier frontier file whose rows stand for settings not sampled "
                   "under --root now (same seeds and AR images, checked)")
    p.set_defaults(run=score)
    p = sub.add_parser("table", help="the frontier file as a markdown table")
    p.add_argument("file")
    p.set_defaults(run=table)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
