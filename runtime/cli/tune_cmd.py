"""`runtime tune`: measure acceptance and step costs on a device, write a profile with the
static tree (and DDD threshold) that maximise expected tokens per second (runtime/tools/tune.py)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console

from runtime.cli import options as opt
from runtime.cli.app import app
from runtime.utils.errors import UserError
from runtime.config.method_options import METHOD_TABLE, Drafting, RelaxKind


Out = Annotated[Path, typer.Option("--out", help=(
    "Profile to write, e.g. profiles/my-cpu.toml (a NAME.tree.toml and NAME.tune.json go beside it)."))]
Method = Annotated[Optional[str], typer.Option("--method", help=(
    "Method whose tree is tuned: lantern++ or sd."))]
NumImages = Annotated[Optional[int], typer.Option("--num-images", help=(
    "Calibration images (classes cycled)."))]
MaxNodes = Annotated[int, typer.Option("--max-nodes", help=(
    "Largest tree considered (draft nodes, root excluded)."))]
MaxDepth = Annotated[int, typer.Option("--max-depth", help=(
    "Deepest tree considered."))]
Ranks = Annotated[int, typer.Option("--ranks", help=(
    "Most children of a node (ranks measured per depth)."))]
DddThresholds = Annotated[str, typer.Option("--ddd-thresholds", help=(
    "DDD thresholds to time, or 'none'."))]
Occupancies = Annotated[str, typer.Option("--occupancies", help=(
    "Batch occupancies at which AR and the tuned tree (exact) are timed; the faster at each is written "
    "as the profile's [auto] table (--method auto). 'none' skips it."))]
Force = Annotated[bool, typer.Option("--force", help=(
    "Overwrite an existing profile."))]
QualityBudget = Annotated[Optional[float], typer.Option("--quality-budget", help=(
    "Also choose the relaxation: the fastest (rule, lambda) whose quality stays within this many "
    "AR-vs-AR bands of AR on every figure (1: indistinguishable from AR at --quality-images)."))]
QualityImages = Annotated[Optional[int], typer.Option("--quality-images", help=(
    "Images per set the quality is judged on (default 240; AR is decoded twice more)."))]
Lambdas = Annotated[Optional[str], typer.Option("--lambdas", help=(
    "Lambdas tried by --quality-budget (default 1.5,2,3,5,8; the exact tree always competes)."))]
RelaxRules = Annotated[Optional[str], typer.Option("--relax-rules", help=(
    "Rules tried by --quality-budget (default paper,bounded)."))]
InceptionWeights = Annotated[Optional[str], typer.Option("--inception-weights", help=(
    "--quality-budget on a model other than the demo: torch-fidelity's InceptionV3 weights (default: "
    "$LANTERN_INCEPTION_WEIGHTS)."))]


@app.command("tune")
@opt.with_method_options(only=("greedy", "temperature", "top_k", "top_p", "cfg", "lantern_k", "lantern_lambda",
                                 "relax_rule"))
@opt.with_model_options
def tune_cmd(
    out: Out,
    device: opt.Device = "auto",
    source: opt.ModelSource = None,  # every model option (opt.MODEL_OPTIONS)
    profile_name: opt.ProfileName = None,
    graph: opt.Graph = None,
    dtype: opt.Dtype = None,
    method: Method = "lantern++",
    flags: opt.MethodFlags = None,  # every method option (runtime.config.method_options)
    batch_size: opt.BatchSize = None,
    classes: opt.Classes = None,
    num_images: NumImages = 8,
    max_nodes: MaxNodes = 32,
    max_depth: MaxDepth = 6,
    ranks: Ranks = 4,
    ddd_thresholds: DddThresholds = "-0.1,-0.3,-0.6,-1.0",
    occupancies: Occupancies = "1,2,4,8",
    seed: opt.Seed = 0,
    force: Force = False,
    quality_budget: QualityBudget = None,
    quality_images: QualityImages = None,
    lambdas: Lambdas = None,
    relax_rules: RelaxRules = None,
    inception_weights: InceptionWeights = None,
) -> None:
    """Choose this device's static tree by measurement and write it as a profile."""
    from runtime.tools.tune import tune

    _check_tune_out(out, force)
    _check_search_space(max_nodes, max_depth, ranks, num_images, method)
    thresholds = _thresholds(ddd_thresholds)
    occupancy_list = _occupancies(occupancies)
    search = _quality_options(quality_budget, quality_images, lambdas, relax_rules, inception_weights, method)
    run = _open_tuning(source, flags.as_dict(), method, device, profile_name, graph, dtype, classes, num_images,
                       batch_size, search) | {"seed": seed}
    result = _run_with_bar("tune: acceptance", None, lambda progress: tune(
        run["loaded"], run["spec"], run["backend"], run["conditions"], batch_size=run["batch"],
        max_nodes=max_nodes, max_depth=max_depth, ranks=ranks, ddd_thresholds=thresholds, progress=progress,
        seed=seed))
    out.parent.mkdir(parents=True, exist_ok=True)
    quality = _write_profile(run, result, out, search, occupancy_list)
    _print_choice(result, quality)
    print(out)


CONSOLE = Console(stderr=True)


def _write_profile(run: dict[str, Any], result: Any, out: Path, search: dict[str, Any] | None,
                   occupancies: list[int]) -> Any:
    """The quality search and occupancy table over the tuned tree, then the profile with its tree
    file and record (`NAME.tree.toml`, `NAME.tune.json`). The tree lives in a staging folder
    until all three are written, so an interrupted search leaves nothing beside --out."""
    import shutil
    import tempfile

    from runtime.tools.tuned_profile import profile_toml
    from runtime.utils.atomic import atomic_path

    tree_path = out.with_name(out.stem + ".tree.toml")
    record_path = out.with_name(out.stem + ".tune.json")
    staging = Path(tempfile.mkdtemp(prefix=f".{out.stem}.tune-", dir=out.parent))
    try:
        staged_tree = staging / tree_path.name
        _write_tree(staged_tree, result.choice)
        quality = _search_quality(run, staged_tree, search) if search is not None else None
        if quality is not None:
            run["spec"] = replace(run["spec"], lantern_lambda=quality.chosen.lantern_lambda,
                                  relax_rule=quality.chosen.rule)
        occupancy = _occupancy(run, staged_tree, quality, occupancies)
        with atomic_path(record_path) as tmp:
            Path(tmp).write_text(json.dumps({**result.to_dict(), "occupancy": occupancy,
                                             "quality": quality.to_dict() if quality else None}, indent=2) + "\n")
        with atomic_path(tree_path) as tmp:
            shutil.copyfile(staged_tree, tmp)
        with atomic_path(out) as tmp:
            Path(tmp).write_text(profile_toml(result, run["profile"], run["spec"], tree_path.name, record_path.name,
                                              occupancy, run["roof"], quality))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return quality


def _write_tree(path: Path, c: dict[str, Any]) -> None:
    """The chosen tree as a TOML tree file (`paths = [[0], [1], [0, 0]]`)."""
    from runtime.tools.tune import tree_toml
    from runtime.utils.atomic import atomic_path

    with atomic_path(path) as tmp:
        Path(tmp).write_text(tree_toml([tuple(p) for p in c["paths"]],
                                       f"runtime tune: {c['nodes']} nodes, depth {c['depth']}, "
                                       f"expected {c['expected_tokens']:.2f} tokens per iteration"))


def _check_tune_out(out: Path, force: bool) -> None:
    """--out must name a new (or, with --force, an old) profile file this process can write."""
    from runtime.utils.atomic import probe_writable

    if out.suffix != ".toml":
        raise UserError(f"--out {out}: a profile is a .toml file, e.g. profiles/my-device.toml")
    if out.is_dir():
        raise UserError(f"--out {out} is a folder; --out names the profile file, e.g. {out / 'my-device.toml'}")
    if out.exists() and not force:
        raise UserError(f"--out {out} exists; pass --force to overwrite it or choose another name")
    probe_writable(out)  # before the calibration, not after it


def _check_search_space(max_nodes: int, max_depth: int, ranks: int, num_images: int, method: str) -> None:
    for name, value, low, high in (("--max-nodes", max_nodes, 1, 128), ("--max-depth", max_depth, 1, 16),
                                   ("--ranks", ranks, 1, 8), ("--num-images", num_images, 1, 1024)):
        if not low <= value <= high:
            raise UserError(f"{name} must be in [{low}, {high}], got {value}")
    if method not in METHOD_TABLE or METHOD_TABLE[method].drafting != Drafting.STATIC:
        raise UserError(f"--method {method}: runtime tune chooses a static tree, for lantern++ or sd")


def _open_tuning(source: Any, flags: dict[str, Any], method: str, device: str, profile_name: str | None,
                 graph: bool | None, dtype: str | None, classes: str | None, num_images: int,
                 batch_size: int | None, search: dict[str, Any] | None) -> dict[str, Any]:
    """The model opened through the generation layer with the method resolved and the
    calibration classes: backend, profile, roof (a CPU's measured peaks), loaded, spec,
    conditions, batch."""
    from runtime.generation.device_setup import open_backend
    from runtime.generation.loading import parse_classes
    from runtime.generation.settings import resolve_spec
    from runtime.generation.workload import batch_size as batch_of

    backend, prof = open_backend(device, profile_name, graph, dtype)
    roof = None
    if backend.name == "cpu":  # no vendor figures: measure the peaks once, on an idle machine, for the profile
        from runtime.tools.roofline import measure_cpu_roof

        roof = measure_cpu_roof(backend.dtype)
    loaded = source.load(backend)
    if loaded.config.model_type != "c2i":
        raise UserError("runtime tune calibrates on class conditions; text-to-image models are not supported yet")
    if search is not None and search["inception"] is not None and loaded.bundle is not None:
        raise UserError(f"--inception-weights does nothing for the {loaded.name} bundle: --quality-budget judges it "
                        "with the bundle's own classifier; drop the flag")
    return {"backend": backend, "profile": prof, "roof": roof, "loaded": loaded,
            "spec": resolve_spec(method, flags, prof, loaded.recommended),
            "conditions": parse_classes(classes, num_images, loaded), "batch": batch_of(batch_size, prof)}


def _run_with_bar(label: str, total: int | None, work: Any) -> Any:
    """`work(progress)` under a progress bar on stderr, first labelled `label`; progress(what, done,
    total) relabels it "tune: what"."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=CONSOLE) as bar:
        task = bar.add_task(label, total=total)

        def progress(what: str, done: int, total: int | None) -> None:
            bar.update(task, completed=done, total=total, description=f"tune: {what}")

        return work(progress)


def _occupancy(run: dict[str, Any], tree_path: Path, quality: Any, occupancies: list[int]) -> list[dict[str, Any]]:
    """AR against the tuned tree at each occupancy (the profile's [auto] table): what --method
    auto runs, the tree exact or at the relaxation chosen within the quality budget."""
    if not occupancies:
        return []
    from runtime.core.methods import MethodSpec
    from runtime.tools.tune import occupancy_table, on_tree

    spec = run["spec"]
    exact = on_tree(replace(spec, method="lantern++", lantern_lambda=1.0 if quality is None
                            else quality.chosen.lantern_lambda), str(tree_path))
    specs = {"ar": MethodSpec(method="ar", sampling=spec.sampling), "lantern++": exact}
    total = len(occupancies) * len(specs)
    return _run_with_bar("tune: occupancy", total, lambda progress: occupancy_table(
        run["loaded"], specs, run["backend"], run["conditions"], occupancies, seed=run["seed"],
        progress=lambda what, done, _total: progress("occupancy", done, total)))


def _print_choice(result: Any, quality: Any) -> None:
    c = result.choice
    CONSOLE.print(f"tree: {c['nodes']} nodes, depth {c['depth']}, expected {c['expected_tokens']:.2f} tokens per "
                  f"iteration, {c['iteration_s'] * 1e3:.1f} ms per iteration, expected {c['expected_speedup']:.2f}x "
                  f"over AR" + (f"; ddd threshold {result.ddd['threshold']}" if result.ddd else ""))
    if quality is not None:
        c = quality.chosen
        CONSOLE.print(f"relaxation: {c.rule} lambda {c.lantern_lambda:g}, "
                      f"{c.images_per_s / quality.ar_images_per_s:.2f}x AR in this pass, within {quality.budget:g} "
                      f"AR-vs-AR band(s) at {quality.images} images "
                      f"({sum(x.verdict.indistinguishable for x in quality.candidates)} of "
                      f"{len(quality.candidates)} settings were)")


# --quality-budget's defaults
QUALITY_IMAGES = 240
QUALITY_LAMBDAS = (1.5, 2.0, 3.0, 5.0, 8.0)
QUALITY_RULES = ("paper", "bounded")


def _quality_options(budget: float | None, images: int | None, lambdas: str | None, rules: str | None,
                     inception: str | None, method: str | None) -> dict[str, Any] | None:
    """The quality search's settings, or None without --quality-budget (its other flags refused then)."""
    if budget is None:
        given = [n for n, v in (("--quality-images", images), ("--lambdas", lambdas), ("--relax-rules", rules),
                                ("--inception-weights", inception)) if v is not None]
        if given:
            raise UserError(f"{', '.join(given)} only set(s) up --quality-budget; add --quality-budget 1 or drop it")
        return None
    if METHOD_TABLE[method].relaxation != RelaxKind.LAMBDA:
        raise UserError("--quality-budget chooses lantern++'s relaxation; --method sd is exact (drop one)")
    if not budget > 0:
        raise UserError(f"--quality-budget must be > 0 (multiples of the AR-vs-AR band), got {budget:g}")
    n = QUALITY_IMAGES if images is None else images
    if not 8 <= n <= 100_000:
        raise UserError(f"--quality-images must be in [8, 100000], got {n}")
    try:
        lams = QUALITY_LAMBDAS if lambdas is None else tuple(float(t) for t in lambdas.split(",") if t.strip())
    except ValueError:
        raise UserError(f"--lambdas {lambdas!r}: expected comma-separated numbers >= 1 like 2,3,5") from None
    if not lams or any(not 1 <= v < 1e6 for v in lams):
        raise UserError(f"--lambdas {lambdas!r}: expected comma-separated numbers >= 1 like 2,3,5")
    names = QUALITY_RULES if rules is None else tuple(r.strip() for r in rules.split(",") if r.strip())
    if not names or any(r not in QUALITY_RULES for r in names):
        raise UserError(f"--relax-rules {rules!r}: expected paper, bounded or both (paper,bounded)")
    return {"budget": budget, "images": n, "lambdas": lams, "rules": names, "inception": inception}


def _search_quality(run: dict[str, Any], tree_path: Path, search: dict[str, Any]) -> Any:
    """--quality-budget: the fastest relaxation of the tuned tree within the budget."""
    from runtime.tools.quality_tune import quality_search
    from runtime.tools.tune import on_tree

    loaded, backend = run["loaded"], run["backend"]
    inception = None
    if loaded.bundle is None:
        from runtime.metrics.fidelity import inception_weights, load_inception

        inception = load_inception(inception_weights(search["inception"]), device=backend.device)
    return _run_with_bar("tune: quality", None, lambda progress: quality_search(
        loaded, on_tree(run["spec"], str(tree_path)), backend, run["conditions"], images=search["images"],
        budget=search["budget"], lambdas=search["lambdas"], rules=search["rules"], batch_size=run["batch"],
        seed=run["seed"], inception=inception, progress=progress))


def _thresholds(text: str) -> tuple[float, ...]:
    if text.strip().lower() in ("none", "off", ""):
        return ()
    try:
        values = tuple(float(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise UserError(f"--ddd-thresholds {text!r}: expected comma-separated log probabilities like -0.3,-0.6") from None
    if not values or any(not v <= 0 for v in values):
        raise UserError(f"--ddd-thresholds {text!r}: thresholds are log probabilities, <= 0")
    return values


def _occupancies(text: str) -> tuple[int, ...]:
    if text.strip().lower() in ("none", "off", ""):
        return ()
    try:
        values = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise UserError(f"--occupancies {text!r}: expected comma-separated batch sizes like 1,2,4,8") from None
    if not values or any(not 1 <= v <= 256 for v in values):
        raise UserError(f"--occupancies {text!r}: batch sizes in [1, 256]")
    return tuple(sorted(set(values)))
