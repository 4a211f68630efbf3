"""`runtime train demo` (rebuild the embedded demo bundle) and `runtime train drafter` (a new drafter for it)."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from runtime.cli.app import app
from runtime.cli.progress import training_progress
from runtime.utils.errors import UserError

train_app = typer.Typer(help="Train models shipped with the runtime.", no_args_is_help=True)
app.add_typer(train_app, name="train")



def _check_out(out: Path, force: bool) -> None:
    """Refuse an output folder that exists (unless --force) or is a file, before any work."""
    if out.exists() and not force:
        raise UserError(f"{out} already exists; choose another --out or pass --force to replace it")
    if out.exists() and not out.is_dir():
        raise UserError(f"{out} exists and is not a folder; choose another --out")


def _check_positive(**values: int | None) -> None:
    for name, value in values.items():
        if value is not None and value < 0:
            raise UserError(f"--{name.replace('_', '-')} must be >= 0, got {value}")


@train_app.command("demo")
def train_demo_command(
    out: Path = typer.Option(..., "--out", help="Folder to write the bundle to (must not exist unless --force)."),
    steps_vq: Optional[int] = typer.Option(None, "--steps-vq", help="VQ tokenizer steps."),
    steps_gpt: Optional[int] = typer.Option(None, "--steps-gpt", help="Target GPT steps."),
    steps_drafter: Optional[int] = typer.Option(None, "--steps-drafter", help="Drafter steps."),
    steps_classifier: Optional[int] = typer.Option(None, "--steps-classifier", help="Classifier steps."),
    seed: int = typer.Option(0, "--seed", help="Seed of the training data and initialisation."),
    threads: int = typer.Option(2, "--threads", help="CPU threads (torch.set_num_threads)."),
    micro: bool = typer.Option(False, "--micro", help="A few steps of each stage on tiny data (smoke test)."),
    force: bool = typer.Option(False, "--force", help="Replace --out if it exists."),
) -> None:
    """Train the demo bundle (tokenizer, target, drafter, classifier) from scratch on the CPU."""
    from runtime.demo.train import DemoTrainConfig, train_demo

    _check_positive(steps_vq=steps_vq, steps_gpt=steps_gpt, steps_drafter=steps_drafter,
                    steps_classifier=steps_classifier)
    if threads < 1:
        raise UserError(f"--threads must be >= 1, got {threads}")
    _check_out(out, force)

    cfg = DemoTrainConfig.micro(seed=seed, threads=threads) if micro else DemoTrainConfig(seed=seed, threads=threads)
    overrides = {"steps_vq": steps_vq, "steps_gpt": steps_gpt, "steps_drafter": steps_drafter,
                 "steps_classifier": steps_classifier}
    for name, value in overrides.items():
        if value is not None:
            setattr(cfg, name, value)
    command = canonical_command(out, cfg, micro)

    with training_progress() as progress:
        manifest = train_demo(str(out), cfg, command=command, overwrite=force, progress=progress)

    Console().print(_summary(manifest, out))


DrafterOut = Annotated[Path, typer.Option("--out", help=(
    "Folder to write to: the bundle with the new drafter (--model), or the drafter folder (--gpt-ckpt: "
    "config.json, model.safetensors, manifest.json)."))]
DrafterModel = Annotated[str, typer.Option("--model", help=(
    "'demo' (the packaged bundle), a bundle folder, or a prompted model (Chameleon, Janus, Emu3) by "
    "folder or Hugging Face Hub id."))]
DrafterModelRevision = Annotated[Optional[str], typer.Option("--model-revision", help=(
    "Branch, tag or commit of a --model given by Hub id."))]
DrafterSteps = Annotated[Optional[int], typer.Option("--steps", help=(
    "Drafter steps (default 700 for a bundle, 2000 for --gpt-ckpt)."))]
DrafterSeed = Annotated[int, typer.Option("--seed", help=(
    "Seed of the drafter's initialisation, data and batches."))]
DrafterThreads = Annotated[int, typer.Option("--threads", help=(
    "CPU threads (torch.set_num_threads)."))]
DrafterForce = Annotated[bool, typer.Option("--force", help=(
    "Replace --out if it exists."))]
DrafterGptModel = Annotated[Optional[str], typer.Option("--gpt-model", rich_help_panel="Any target (--gpt-ckpt)", help=(
    "The target's LlamaGen config (GPT-B, GPT-L, ...)."))]
DrafterGptCkpt = Annotated[Optional[str], typer.Option("--gpt-ckpt", rich_help_panel="Any target (--gpt-ckpt)", help=(
    "Train for this official c2i checkpoint (or fine-tune, or HF folder)."))]
DrafterImageSize = Annotated[Optional[int], typer.Option("--image-size", rich_help_panel="Any target (--gpt-ckpt)", help=(
    "The checkpoint's image size (default: from its file name)."))]
DrafterTrustCheckpoint = Annotated[bool, typer.Option("--trust-checkpoint", rich_help_panel="Any target (--gpt-ckpt)", help=(
    "Allow a checkpoint holding pickled Python objects."))]
DrafterDevice = Annotated[Optional[str], typer.Option("--device", rich_help_panel="Any target (--gpt-ckpt)", help=(
    "auto, cpu, cuda or hpu (default auto; fp32 throughout)."))]
DrafterNumImages = Annotated[Optional[int], typer.Option("--num-images", rich_help_panel="Any target (--gpt-ckpt)", help=(
    "Images the target generates for the self-distilled data (default 1000)."))]
DrafterClasses = Annotated[Optional[str], typer.Option("--classes", rich_help_panel="Any target (--gpt-ckpt)", help=(
    "Comma-separated class ids cycled over the images (default: all)."))]
DrafterTokensFile = Annotated[Optional[str], typer.Option("--tokens", rich_help_panel="Any target (--gpt-ckpt)", help=(
    "Teacher-force on these tokens instead (.npy, (N, tokens per image) int); needs --labels."))]
DrafterLabelsFile = Annotated[Optional[str], typer.Option("--labels", rich_help_panel="Any target (--gpt-ckpt)", help=(
    "Class of each row of --tokens (.npy, (N,) int)."))]
DrafterPrompts = Annotated[Optional[str], typer.Option("--prompts", rich_help_panel="Any target (--gpt-ckpt)", help=(
    "Prompted model (--model: Chameleon, Janus, Emu3): prompts the target draws its data from, one per "
    "line, cycled over --num-images."))]
DrafterDataCfg = Annotated[Optional[float], typer.Option("--data-cfg", rich_help_panel="Any target (--gpt-ckpt)", help=(
    "CFG scale of the generation (default 4.0, LlamaGen's c2i)."))]
DrafterDataTopK = Annotated[Optional[int], typer.Option("--data-top-k", rich_help_panel="Any target (--gpt-ckpt)", help=(
    "Top-k of the generation (default 2000; 0 = off)."))]
DrafterDataTemperature = Annotated[Optional[float], typer.Option("--data-temperature", rich_help_panel="Any target (--gpt-ckpt)", help=(
    "Temperature of the generation (default 1.0)."))]
DrafterData = Annotated[Optional[Path], typer.Option("--data", rich_help_panel="Any target (--gpt-ckpt)", help=(
    "Folder of the self-distilled shards (default OUT/data); reused when it holds an index.json."))]
DrafterBatch = Annotated[Optional[int], typer.Option("--batch", rich_help_panel="Any target (--gpt-ckpt)", help=(
    "Images per step (default 16)."))]
DrafterLr = Annotated[Optional[float], typer.Option("--lr", rich_help_panel="Any target (--gpt-ckpt)", help=(
    "Peak learning rate (default 1e-3)."))]
DrafterResume = Annotated[bool, typer.Option("--resume", rich_help_panel="Any target (--gpt-ckpt)", help=(
    "Continue an interrupted run in --out from its checkpoint.pt."))]
DrafterEvalImages = Annotated[Optional[int], typer.Option("--eval-images", rich_help_panel="Any target (--gpt-ckpt)", help=(
    "Images for the final greedy tau of the drafter on its target (default 8; 0 = skip)."))]


@train_app.command("drafter")
def train_drafter_command(
    out: DrafterOut,
    model: DrafterModel = "demo",
    model_revision: DrafterModelRevision = None,
    steps: DrafterSteps = None,
    seed: DrafterSeed = 0,
    threads: DrafterThreads = 2,
    force: DrafterForce = False,
    gpt_model: DrafterGptModel = None,
    gpt_ckpt: DrafterGptCkpt = None,
    image_size: DrafterImageSize = None,
    trust_checkpoint: DrafterTrustCheckpoint = False,
    device: DrafterDevice = None,
    num_images: DrafterNumImages = None,
    classes: DrafterClasses = None,
    tokens_file: DrafterTokensFile = None,
    labels_file: DrafterLabelsFile = None,
    prompts: DrafterPrompts = None,
    data_cfg: DrafterDataCfg = None,
    data_top_k: DrafterDataTopK = None,
    data_temperature: DrafterDataTemperature = None,
    data: DrafterData = None,
    batch: DrafterBatch = None,
    lr: DrafterLr = None,
    resume: DrafterResume = False,
    eval_images: DrafterEvalImages = None,
) -> None:
    """Train a fresh drafter: for a demo bundle's frozen target (--model), or for any c2i LlamaGen
    checkpoint (--gpt-ckpt) on data the target generates itself."""
    if steps is not None and steps < 1:
        raise UserError(f"--steps must be >= 1, got {steps}")
    if threads < 1:
        raise UserError(f"--threads must be >= 1, got {threads}")
    from runtime.models.hf_folders import read_family
    from runtime.models.hub import resolve_model

    if gpt_ckpt is not None and model != "demo":
        raise UserError("give either --model (a bundle or Chameleon folder) or --gpt-ckpt (a checkpoint), not both")
    if model != "demo":
        model = resolve_model(model, model_revision)
    elif model_revision is not None:
        raise UserError("--model-revision applies to a --model given by Hub id (OWNER/NAME); drop it")
    family = read_family(Path(model)) if model != "demo" and Path(model).is_dir() else None
    chameleon = family is not None  # a prompted target: Chameleon, Janus or Emu3
    if gpt_ckpt is not None or chameleon:
        from runtime.cli.train_drafter_any import train_drafter_for_checkpoint

        train_drafter_for_checkpoint({**locals(), "chameleon": chameleon, "family": family})
        return
    given = [f for f, v in (("--gpt-model", gpt_model), ("--image-size", image_size), ("--tokens", tokens_file),
                            ("--labels", labels_file), ("--data", data), ("--classes", classes),
                            ("--trust-checkpoint", trust_checkpoint or None), ("--resume", resume or None),
                            ("--device", device), ("--num-images", num_images), ("--batch", batch), ("--lr", lr),
                            ("--eval-images", eval_images), ("--data-cfg", data_cfg), ("--data-top-k", data_top_k),
                            ("--data-temperature", data_temperature), ("--prompts", prompts))
             if v is not None]
    if given:
        raise UserError(f"{given[0]} applies to --gpt-ckpt (or Chameleon folder) training only; add --gpt-ckpt FILE "
                        f"or drop {given[0]}")
    _retrain_bundle_drafter(model, out, 700 if steps is None else steps, seed, threads, force)


def _retrain_bundle_drafter(model: str, out: Path, steps: int, seed: int, threads: int, force: bool) -> None:
    """A demo bundle's drafter trained afresh for its frozen target, the bundle written to `out`."""
    from runtime.demo.train import retrain_drafter

    _check_out(out, force)
    command = " ".join(shlex.quote(p) for p in ["runtime", "train", "drafter", "--model", model, "--out", str(out),
                                                 "--steps", str(steps), "--seed", str(seed),
                                                 "--threads", str(threads)])
    # The source bundle is loaded whole (a missing one is refused) before anything is written.
    with training_progress() as progress:
        manifest = retrain_drafter(None if model == "demo" else model, str(out), steps=steps, seed=seed,
                                   threads=threads, command=command, overwrite=force, progress=progress)
    record = manifest["training"]["drafter_retrain"]
    Console().print(f"drafter top-1 vs target {record['metrics_before']['top1_vs_target']:.1%} -> "
                    f"{manifest['metrics']['drafter']['top1_vs_target']:.1%} in {record['wall_time_s']:.0f} s; "
                    f"bundle written to {out}", highlight=False)


@train_app.command("target")
def train_target_command(
    out: Path = typer.Option(..., "--out", help="Folder to write the bundle with the new target to."),
    model: str = typer.Option("demo", "--model", help="'demo' (the packaged bundle), a bundle folder, or a prompted "
                              "model (Chameleon, Janus, Emu3) by folder or Hugging Face Hub id."),
    model_revision: Optional[str] = typer.Option(None, "--model-revision", help="Branch, tag or commit of a --model "
                                                 "given by Hub id."),
    layers: int = typer.Option(..., "--gpt-layers", help="Target GPT layers."),
    dim: int = typer.Option(..., "--gpt-dim", help="Target GPT width."),
    heads: int = typer.Option(..., "--gpt-heads", help="Target GPT attention heads."),
    steps: int = typer.Option(1300, "--steps", help="Target GPT steps."),
    steps_drafter: int = typer.Option(700, "--steps-drafter", help="Drafter steps."),
    seed: int = typer.Option(0, "--seed", help="Seed of the initialisation and batches."),
    threads: int = typer.Option(2, "--threads", help="CPU threads (torch.set_num_threads)."),
    force: bool = typer.Option(False, "--force", help="Replace --out if it exists."),
) -> None:
    """Train a target of another shape (and its drafter) on a demo bundle's tokens; VQ and classifier are copied."""
    from runtime.demo.train import retrain_target

    for flag, value in (("gpt-layers", layers), ("gpt-dim", dim), ("gpt-heads", heads), ("steps", steps),
                        ("steps-drafter", steps_drafter), ("threads", threads)):
        if value < 1:
            raise UserError(f"--{flag} must be >= 1, got {value}")
    if dim % heads or (dim // heads) % 2:
        raise UserError(f"--gpt-dim {dim} must split into {heads} heads of even width; change --gpt-heads")
    _check_out(out, force)
    command = " ".join(shlex.quote(p) for p in [
        "runtime", "train", "target", "--model", model, "--out", str(out), "--gpt-layers", str(layers),
        "--gpt-dim", str(dim), "--gpt-heads", str(heads), "--steps", str(steps), "--steps-drafter",
        str(steps_drafter), "--seed", str(seed), "--threads", str(threads)])
    # The source bundle is loaded whole (a missing one is refused) before anything is written.
    with training_progress() as progress:
        manifest = retrain_target(None if model == "demo" else model, str(out), layers=layers, dim=dim, heads=heads,
                                  steps=steps, steps_drafter=steps_drafter, seed=seed, threads=threads,
                                  command=command, overwrite=force, progress=progress)
    Console().print(_summary(manifest, out, wall=manifest["training"]["target_retrain"]["wall_time_s"]))


def canonical_command(out: Path, cfg: "DemoTrainConfig", micro: bool) -> str:  # noqa: F821
    """The command line that reproduces `cfg`, every knob explicit (recorded in the manifest)."""
    parts = ["runtime", "train", "demo", "--out", str(out), "--seed", str(cfg.seed), "--threads", str(cfg.threads),
             "--steps-vq", str(cfg.steps_vq), "--steps-gpt", str(cfg.steps_gpt),
             "--steps-drafter", str(cfg.steps_drafter), "--steps-classifier", str(cfg.steps_classifier)]
    if micro:
        parts.append("--micro")
    return " ".join(shlex.quote(p) for p in parts)


def _summary(manifest: dict, out: Path, wall: dict | None = None) -> Table:
    """One row per part; `wall` (seconds per stage) defaults to the manifest's; a stage missing
    from it (a part copied from the source bundle) reads "copied"."""
    m = manifest["metrics"]
    q = m["quality"]
    table = Table(title=f"demo bundle written to {out}", title_justify="left")
    table.add_column("part")
    table.add_column("params", justify="right")
    table.add_column("metric")
    table.add_column("seconds", justify="right")
    wall = manifest["training"]["wall_time_s"] if wall is None else wall
    params = manifest["params"]

    def seconds(stage: str) -> str:
        return f"{wall[stage]:.0f}" if stage in wall else "copied"

    table.add_row("vq", f"{params['vq'] / 1e6:.2f}M",
                  f"recon L1 {m['vq']['recon_l1']:.3f}, codebook usage {m['vq']['codebook_usage']:.0%}",
                  seconds("vq"))
    table.add_row("gpt", f"{params['gpt'] / 1e6:.2f}M", f"val loss {m['gpt']['val_loss']:.3f} nats/token",
                  seconds("gpt"))
    table.add_row("drafter", f"{params['drafter'] / 1e6:.2f}M",
                  f"top-1 vs target {m['drafter']['top1_vs_target']:.1%}", seconds("drafter"))
    table.add_row("classifier", f"{params['classifier'] / 1e6:.2f}M",
                  f"val accuracy {m['classifier']['val_accuracy']:.1%}", seconds("classifier"))
    sample = f"recon acc {q['recon_class_accuracy']:.1%} FD {q['recon_fd']:.2f}"
    if "ar_class_accuracy" in q:
        sample += f"; AR samples acc {q['ar_class_accuracy']:.1%} FD {q['ar_fd']:.2f}"
    table.add_row("quality", "", sample, seconds("evaluate"))
    table.caption = f"total {wall['total']:.0f} s"
    return table
