"""The short summary of a `scripts/device_check.sh` run: `python3 scripts/device_summary.py OUT`.

Reads what the steps wrote under OUT (steps.tsv, selfcheck.json, shape_*.json, bench_demo_*.json,
serve_load_demo.json, frontier_demo_*.json) and writes OUT/summary.md, also printed. Every figure is
read from a result file; a step that failed or was skipped says so instead of a number.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any


def _load(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def steps(out: Path) -> list[str]:
    lines = ["| step | exit | seconds |", "|---|---|---|"]
    for row in (out / "steps.tsv").read_text().splitlines() if (out / "steps.tsv").is_file() else []:
        name, rc, seconds, *_ = row.split("\t") + ["", ""]
        lines.append(f"| {name} | {rc} | {seconds} |")
    return lines


def selfcheck(out: Path) -> list[str]:
    data = _load(out / "selfcheck.json")
    if data is None:
        return ["selfcheck: no report"]
    lines = [f"selfcheck: {'passed' if data.get('passed') else 'FAILED ' + ', '.join(data.get('failed', []))}"]
    for mode, x in (data.get("xl_shape") or {}).items():
        if mode in ("model", "roof"):
            continue
        ar = x["ar_step"]
        floor = ar.get("floor", {}).get("iteration", {})
        over = f", {floor['over_floor']:.2f}x its floor" if floor else ""
        lines.append(f"- GPT-XL {mode} {x['dtype']}: AR step {(ar['verify_s'] + ar['accept_s']) * 1e3:.2f} ms{over}; "
                     f"verify(naive_extend_57) / AR {x['verify_over_ar_step']:.2f}; draft / AR "
                     f"{x['draft_over_ar_step']:.2f}")
    return lines


def shapes(out: Path) -> list[str]:
    lines = ["| shape | batch | method | iteration / AR step (= tau to break even) | iteration / floor | "
             "projected speedup [95% CI] (tau) |", "|---|---|---|---|---|---|"]
    by_label: dict[tuple[str, str], dict[int, float]] = {}
    for path in sorted(out.glob("shape_*.json")):
        data = _load(path)
        if data is None or "runs" not in data:
            continue
        name, batch = data["shape"]["name"], data["batch_size"]
        ar_floor = data["ar_step"].get("floor", {}).get("iteration", {})
        lines.append(f"| {name} | {batch} | ar ({data['ar_step']['median_s'] * 1e3:.2f} ms) | 1 | "
                     f"{ar_floor.get('over_floor', float('nan')):.2f}x | - |")
        for run in data["runs"]:
            s = run["projected_speedup"]
            floor = run.get("floor", {}).get("iteration", {})
            projected = (f"{s['point']:.2f}x [{s['low']:.2f}, {s['high']:.2f}] ({run['tau']:g})" if run["tau"] > 1
                         else "cost only")
            lines.append(f"| {name} | {batch} | {run['label']} | {run['iteration_over_ar_step']:.2f} | "
                         f"{floor.get('over_floor', float('nan')):.2f}x | {projected} |")
            if run["tau"] > 1:
                by_label.setdefault((name, run["label"]), {})[batch] = s["point"]
    for (name, label), points in by_label.items():
        lines.append(f"- {name} {label}: {break_even(points)}")
    return lines


def break_even(points: dict[int, float]) -> str:
    """Where the projected speedup crosses 1 between measured batch sizes (log-linear in batch)."""
    batches = sorted(points)
    for lo, hi in zip(batches, batches[1:]):
        a, b = points[lo], points[hi]
        if a >= 1 > b:
            t = (a - 1) / (a - b)
            return f"speculation stops paying near batch {math.exp(math.log(lo) + t * math.log(hi / lo)):.1f}"
    if all(v >= 1 for v in points.values()):
        return f"pays at every measured batch ({', '.join(map(str, batches))})"
    return f"does not pay at batch {batches[0]}" if points[batches[0]] < 1 else "no crossing measured"


def bench(path: Path, title: str) -> list[str]:
    data = _load(path)
    if data is None:
        return [f"{title}: no result"]
    lines = [f"{title} ({data['device'].get('name', '?')}):", "| method | tau | speedup vs AR | images/s | quality |",
             "|---|---|---|---|---|"]
    for run in data["runs"]:
        q = run.get("quality") or {}
        quality = f"acc {q['class_accuracy']:.3f}, FD {q['fd']:.1f}" if q.get("measured") else "-"
        lines.append(f"| {run['method']} {_params(run['params'])} | {run['stats']['mean_accepted_length']:.2f} | "
                     f"{run.get('speedup_vs_ar') or float('nan'):.2f}x | {run['images_per_s']:.2f} | {quality} |")
    return lines


def _params(params: dict[str, Any]) -> str:
    keys = ("tree", "lantern_lambda", "relax_rule", "lantern_delta")
    return " ".join(f"{k}={params[k]}" for k in keys if params.get(k) is not None)


def serve(out: Path) -> list[str]:
    data = _load(out / "serve_load_demo.json")
    if data is None:
        return ["serve load test: no result"]
    lat = data.get("latency_s", {})
    return [f"serve load test: {data['images']} images, {data['images_per_s']:.2f} images/s served "
            f"({data['served_over_offline']:.2f}x offline), p50 {lat.get('p50', float('nan')):.2f} s, "
            f"{data['failed_requests']} failed, {data['token_mismatches']} token mismatches, "
            f"server exit {data['server_exit_code']}"]


def main(out: Path) -> int:
    sections = [["# Device check summary", ""], steps(out), [""], selfcheck(out), [""], shapes(out), [""],
                bench(out / "bench_demo_sampling.json", "demo bench"), [""], serve(out)]
    if (out / "frontier_demo_sampling.json").is_file():
        sections += [[""], bench(out / "frontier_demo_sampling.json", "demo frontier (chain3)")]
    text = "\n".join(line for section in sections for line in section) + "\n"
    (out / "summary.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "out")))
