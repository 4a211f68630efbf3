"""`runtime eval DIR`: class accuracy and Frechet distance of a `runtime run` output folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import numpy as np
import typer
from rich.console import Console
from rich.table import Table

from runtime.cli import options as opt
from runtime.cli.app import app
from runtime.utils.errors import FILE_FAULTS, UserError
from runtime.metrics import INCEPTION_ENV


def read_run(run_dir: Path) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """tokens (N, T) int64 and class labels (N,) of a run folder, plus its result.json.

    Row i of tokens.npy is image i; its class is the `class` of the record with `index` i
    in result.json's `images` list.
    """
    from runtime.models.loading import read_json

    if not run_dir.is_dir():
        raise UserError(f"{run_dir} is not a folder; give the --out folder of 'runtime run'")
    tokens_path = run_dir / "tokens.npy"
    if not tokens_path.is_file():
        raise UserError(f"{tokens_path} not found; give the --out folder of 'runtime run'")
    result = read_json(run_dir / "result.json")
    try:
        tokens = np.load(tokens_path, allow_pickle=False)
    except FILE_FAULTS as err:
        raise UserError(f"{tokens_path} is not a readable .npy array ({type(err).__name__}: {err}); regenerate "
                        "the run") from None
    if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
        raise UserError(f"{tokens_path}: expected an integer array (images, tokens), found {tokens.dtype} {tokens.shape}")
    records = result.get("images")
    if not isinstance(records, list):
        raise UserError(f"{run_dir / 'result.json'}: no 'images' list")
    labels = np.full(len(tokens), -1, dtype=np.int64)
    for rec in records:
        if not isinstance(rec, dict) or "class" not in rec:
            raise UserError(f"{run_dir / 'result.json'}: image records need a 'class' "
                            "(runtime eval measures class-conditional runs only)")
        i, label = rec.get("index"), rec["class"]
        for key, value in (("index", i), ("class", label)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise UserError(f"{run_dir / 'result.json'}: image record {rec.get('file', rec)!r} has {key} "
                                f"{value!r}, expected an integer >= 0; give a folder written by 'runtime run'")
        if i >= len(tokens):
            raise UserError(f"{run_dir / 'result.json'}: image index {i} outside tokens.npy's {len(tokens)} rows")
        labels[i] = label
    if (labels < 0).any():
        missing = int(np.nonzero(labels < 0)[0][0])
        raise UserError(f"{run_dir / 'result.json'}: no image record for tokens.npy row {missing}")
    return tokens.astype(np.int64), labels, result


def evaluate_run(run_dir: Path, model: str = "demo", n_real: int | None = None, reps: int = 20) -> dict[str, Any]:
    """Decode a run's tokens with the bundle's VQ and measure them with the demo classifier:
    {"metrics": {"class_accuracy", "fd": {value, lo, hi}}, "n", "n_real", "model", "bootstrap"}."""
    import torch

    from runtime.demo.bundle import load_demo_bundle
    from runtime.demo.dataset import from_tensor_range
    from runtime.demo.quality import DEFAULT_N_REAL, demo_quality, demo_scores

    tokens, labels, _ = read_run(run_dir)
    bundle = load_demo_bundle(None if model == "demo" else model)
    grid = (bundle.image_size // int(bundle.manifest["downsample"])) ** 2
    if tokens.shape[1] != grid:
        raise UserError(f"{run_dir / 'tokens.npy'} has {tokens.shape[1]} tokens per image but the {model} "
                        f"model makes {grid}; evaluate with the model that generated the run (--model)")
    vocab = bundle.vq.config.codebook_size
    if tokens.min() < 0 or tokens.max() >= vocab:
        raise UserError(f"{run_dir / 'tokens.npy'}: token ids outside the codebook [0, {vocab})")
    if labels.max() >= bundle.num_classes:
        raise UserError(f"{run_dir / 'result.json'}: class {int(labels.max())} is outside the model's "
                        f"{bundle.num_classes} classes")
    if len(labels) < 2:
        raise UserError("runtime eval needs at least 2 images for a Frechet distance; run with --num-images 2 or more")
    images = []
    with torch.no_grad():
        for start in range(0, len(tokens), 64):
            idx = torch.from_numpy(tokens[start:start + 64])
            images.append(from_tensor_range(bundle.vq.decode_code(idx).float().numpy()))
    n_real = n_real or DEFAULT_N_REAL
    scores = demo_scores(bundle, np.concatenate(images), labels, n_real=n_real)
    metrics = demo_quality(scores, reps=reps)
    return {"kind": "demo", "metrics": {k: v.to_dict() for k, v in metrics.items()}, "n": int(len(labels)),
            "n_real": int(n_real), "model": model, "bootstrap": reps}


@app.command("eval")
def eval_command(
    run_dir: Path = typer.Argument(..., help="What to measure: a 'runtime run' folder, a 'runtime sample' folder, "
                                   "or an ADM-layout .npz (arr_0: uint8 images N x H x W x 3)."),
    reference: Optional[str] = typer.Option(None, "--reference", help="FID / KID / precision-recall reference: an "
                                            "ADM reference batch .npz (e.g. VIRTUAL_imagenet256_labeled.npz), a "
                                            "folder of images, or another run of the same workload (paired)."),
    inception_weights: Optional[str] = typer.Option(None, "--inception-weights", help="torch-fidelity's "
                                                    f"InceptionV3 weights file (default: ${INCEPTION_ENV})."),
    clip_model: Optional[str] = typer.Option(None, "--clip-model", help="CLIP score: an open_clip model name "
                                             "(ViT-L-14, ...) or a model-config .json; needs --clip-weights."),
    clip_weights: Optional[str] = typer.Option(None, "--clip-weights", help="CLIP score: the model's local weights."),
    trust_checkpoint: opt.Trust = False,
    bootstrap: int = typer.Option(20, "--bootstrap", help="Resamples of the images behind each 95% interval "
                                  "(0: no intervals)."),
    device: opt.Device = "auto",
    batch_size: int = typer.Option(64, "--batch-size", help="Images per feature-extractor batch."),
    model: Optional[str] = typer.Option(None, "--model", help="Demo metrics: 'demo' (default) or the bundle folder "
                                        "that generated the run."),
    n_real: int = typer.Option(0, "--n-real", help="Demo metrics: real images for the FD (0: the default 1200)."),
    out: Optional[str] = typer.Option(None, "--out", help="Also write the metrics as JSON to this file."),
    as_json: bool = typer.Option(False, "--json", help="Print the metrics as JSON."),
) -> None:
    """Image quality of a run: FID / IS / KID / precision-recall (torch-fidelity) against a reference,
    CLIP score for prompts, or the demo classifier's accuracy and FD; each with a 95% interval."""
    fidelity = reference is not None or inception_weights is not None
    if out is not None:
        _check_out(Path(out))
    if bootstrap < 0:
        raise UserError(f"--bootstrap must be >= 0, got {bootstrap}")
    if batch_size < 1:
        raise UserError(f"--batch-size must be >= 1, got {batch_size}")
    if (clip_model is None) != (clip_weights is None):
        raise UserError("CLIP score needs both --clip-model NAME and --clip-weights PATH")
    if fidelity or clip_model is not None:
        for flag, value, default in (("--model", model, None), ("--n-real", n_real, 0)):
            if value != default:
                raise UserError(f"{flag} is for the demo metrics; it does nothing with --reference, "
                                "--inception-weights or --clip-model: drop it")
        metrics = _measure(run_dir, reference, inception_weights, clip_model, clip_weights,
                           trust=trust_checkpoint, reps=bootstrap, device=device, batch_size=batch_size)
    else:
        if trust_checkpoint:
            raise UserError("--trust-checkpoint does nothing without --inception-weights or --clip-weights: drop it")
        if n_real < 0 or n_real == 1:
            raise UserError(f"--n-real must be 0 (default) or >= 2, got {n_real}")
        metrics = evaluate_run(run_dir, model=model or "demo", n_real=n_real or None, reps=bootstrap)
    _refuse_non_finite(metrics)
    if out is not None:
        from runtime.utils.atomic import atomic_write_text, writing

        with writing(f"--out {out}"):
            atomic_write_text(out, json.dumps(metrics, indent=2))
    if as_json:
        print(json.dumps(metrics, indent=2))
        return
    _print_table(run_dir, metrics)


def _check_out(out: Path) -> None:
    """Before any figure is computed: --out names a file that can be written."""
    from runtime.utils.atomic import probe_writable

    if not str(out).strip():
        raise UserError("--out is empty; give the metrics file's path, e.g. metrics.json")
    if out.is_dir():
        raise UserError(f"--out {out}: is a folder; --out names the metrics file, e.g. {out / 'metrics.json'}")
    probe_writable(out)


def _refuse_non_finite(metrics: dict[str, Any]) -> None:
    """No NaN or infinite figure is printed or written: it can only come from broken inputs."""
    for name, figure in metrics["metrics"].items():
        values = [figure.get(k) for k in ("value", "lo", "hi") if figure.get(k) is not None]
        if not all(np.isfinite(v) for v in values):
            raise UserError(f"{NAMES.get(name, name)} came out {figure.get('value')}: the inputs are broken (weights, "
                            "images or reference); nothing was printed or written")


def _measure(run_dir: Path, reference: str | None, inception_path: str | None, clip_model: str | None,
             clip_weights: str | None, *, trust: bool, reps: int, device: str, batch_size: int) -> dict[str, Any]:
    """torch-fidelity figures (and CLIP score) of the images at `run_dir`; see `eval_command`."""
    import time

    from backends import resolve_backend_name
    from runtime.metrics.images import open_images

    dev = resolve_backend_name(device)
    images = open_images(run_dir)
    result: dict[str, Any] = {"kind": "fidelity", "run": str(run_dir), "n": len(images), "bootstrap": reps,
                              "device": dev, "metrics": {}}
    started = time.perf_counter()
    if reference is not None or inception_path is not None:
        if len(images) < 2:
            raise UserError(f"{run_dir}: {len(images)} image; a covariance (FID, KID, precision-recall) needs at "
                            "least 2")
        from runtime.metrics.fidelity import extract, fidelity_metrics, inception_weights, load_inception

        weights = inception_weights(inception_path)
        ref = None
        if reference is not None:
            size = _image_size(images)
            ref = open_images(reference, size=size[0] if size[0] == size[1] else None)
            if len(ref) < 2:
                raise UserError(f"--reference {reference}: needs at least 2 images")
            if _image_size(ref) != size:
                h, w = _image_size(ref)
                raise UserError(f"--reference {reference}: its images are {w}x{h} but {run_dir}'s are "
                                f"{size[1]}x{size[0]}; FID compares images of one size: give a reference at that "
                                "size (a folder of images is resized to it)")
        inception = load_inception(weights, trust=trust, device=dev)
        gen_features = extract(inception, images, batch_size=batch_size).check(str(run_dir))
        paired = ref is not None and _same_workload(images, ref)
        ref_features = None
        if ref is not None:
            ref_features = extract(inception, ref, batch_size=batch_size).check(f"--reference {reference}")
        figures = fidelity_metrics(gen_features, ref_features, ref.stats if ref is not None else None,
                                   paired=paired, reps=reps)
        result["metrics"].update({k: v.to_dict() for k, v in figures.items()})
        result.update(reference=reference, n_reference=len(ref) if ref is not None else 0, paired=paired,
                      inception_weights=str(weights),
                      fid_reference=("precomputed mu/sigma" if ref is not None and ref.stats is not None
                                     else "reference images" if ref is not None else None))
    if clip_model is not None:
        from runtime.metrics.clip_score import clip_score, clip_scores, load_clip

        prompts = images.prompts
        if prompts is None:
            raise UserError(f"{run_dir}: no prompts recorded (CLIP score is for text-to-image runs)")
        clip = load_clip(clip_model, clip_weights, trust=trust, device=dev)
        scores = clip_scores(clip, images, prompts, batch_size=batch_size)
        result["metrics"]["clip_score"] = clip_score(scores, reps=reps).to_dict()
        result["clip_model"] = clip.name
    seconds = time.perf_counter() - started
    result["seconds"] = seconds
    result["images_per_s"] = (len(images) + result.get("n_reference", 0)) / seconds if seconds > 0 else None
    return result


def _image_size(images: Any) -> tuple[int, int]:
    """(H, W) of the set's images (an .npz's from its header; files from the first one)."""
    shape = getattr(images, "shape", None)
    if shape is not None:
        return int(shape[1]), int(shape[2])
    first = next(iter(images.batches(1)))
    return int(first.shape[1]), int(first.shape[2])


def _same_workload(a: Any, b: Any) -> bool:
    """Image i of a and of b share seed and condition: both runs of one workload (paired)."""
    from runtime.metrics.images import FileImages

    if isinstance(b, FileImages) and b.labels is None and b.prompts is None:
        return False  # a plain folder of images
    if len(a) != len(b):
        return False
    if a.labels is not None or b.labels is not None:
        return a.labels is not None and b.labels is not None and bool(np.array_equal(a.labels, b.labels))
    return a.prompts is not None and a.prompts == b.prompts


NAMES = {"fid": "FID", "inception_score": "IS", "kid": "KID", "precision": "precision", "recall": "recall",
         "clip_score": "CLIP score", "class_accuracy": "class accuracy (demo classifier)",
         "fd": "FD (demo classifier features)"}


def _print_table(run_dir: Path, result: dict[str, Any]) -> None:
    from runtime.metrics.intervals import Estimate

    table = Table(title=f"quality of {run_dir} ({result['n']} images, 95% intervals over "
                  f"{result['bootstrap']} resamples)", title_justify="left")
    for col in ("metric", "value", "95% interval"):
        table.add_column(col, justify="left" if col == "metric" else "right")
    for name, v in result["metrics"].items():
        e = Estimate(**v)
        interval = f"[{e.lo:.4g}, {e.hi:.4g}]" if e.lo is not None else "-"
        table.add_row(NAMES.get(name, name), f"{e.value:.4g}", interval)
    Console().print(table)
    if result.get("reference"):
        how = "paired: same seeds and conditions" if result["paired"] else "unpaired"
        Console().print(f"reference: {result['reference']} ({result['n_reference']} images, {how}; "
                        f"FID against its {result['fid_reference']})")
