"""`runtime eval DIR`: class accuracy and Frechet distance of a `runtime run` output folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import typer
from rich.console import Console
from rich.table import Table

from runtime.cli.app import app
from runtime.errors import UserError


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
    except (ValueError, OSError) as err:
        raise UserError(f"{tokens_path} is not a readable .npy array ({err})") from None
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


def evaluate_run(run_dir: Path, model: str = "demo", n_real: int | None = None) -> dict[str, Any]:
    """Decode a run's tokens with the bundle's VQ and measure them: {"class_accuracy", "fd", "n",
    "n_real", "model"}."""
    import torch

    from runtime.demo.bundle import load_demo_bundle
    from runtime.demo.dataset import from_tensor_range
    from runtime.metrics.quality import DEFAULT_N_REAL, evaluate_images

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
    metrics = evaluate_images(bundle, np.concatenate(images), labels, n_real=n_real or DEFAULT_N_REAL)
    metrics["model"] = model
    return metrics


@app.command("eval")
def eval_command(
    run_dir: Path = typer.Argument(..., help="Output folder of 'runtime run' (tokens.npy + result.json)."),
    model: str = typer.Option("demo", "--model", help="'demo' or the bundle folder that generated the run."),
    n_real: int = typer.Option(0, "--n-real", help="Real reference images for the FD (0: the default 1200)."),
    as_json: bool = typer.Option(False, "--json", help="Print the metrics as JSON."),
) -> None:
    """Class accuracy and Frechet distance (demo classifier features) of generated images."""
    if n_real < 0 or n_real == 1:
        raise UserError(f"--n-real must be 0 (default) or >= 2, got {n_real}")
    metrics = evaluate_run(run_dir, model=model, n_real=n_real or None)
    if as_json:
        print(json.dumps(metrics, indent=2))
        return
    table = Table(title=f"quality of {run_dir}", title_justify="left")
    for col in ("images", "class accuracy", "FD", "real images"):
        table.add_column(col, justify="right")
    table.add_row(str(metrics["n"]), f"{metrics['class_accuracy']:.1%}", f"{metrics['fd']:.3f}",
                  str(metrics["n_real"]))
    Console().print(table)
