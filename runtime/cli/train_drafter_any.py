"""`runtime train drafter --gpt-ckpt FILE`: a drafter for any class-conditional LlamaGen checkpoint.

Stages (runtime/training/drafter_training.py): self-distilled data (the target samples images on the given
classes, or a user's token file), then EAGLE training with checkpoints, then held-out top-1 / top-3
and the greedy tau of the new drafter on its target. `--out` becomes a LANTERN-layout drafter folder
(`config.json`, `model.safetensors`) with `manifest.json`, `checkpoint.pt` and, unless `--data`
says otherwise, the shards in `data/`.
"""

from __future__ import annotations

import json
import shlex
import shutil
import sys
import time
from contextlib import nullcontext
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from runtime.utils.errors import UserError

DEFAULTS = {"steps": 2000, "device": "auto", "num_images": 1000, "batch": 16, "lr": 1e-3, "eval_images": 8,
            "data_cfg": 4.0, "data_top_k": 2000, "data_temperature": 1.0}
CHAMELEON_DEFAULTS = {"data_cfg": 3.0}  # Anole's guidance (top-k 2000, temperature 1 as LlamaGen's)
GENERATION_FLAGS = (("--num-images", "num_images"), ("--classes", "classes"), ("--data-cfg", "data_cfg"),
                    ("--data-top-k", "data_top_k"), ("--data-temperature", "data_temperature"))


def _load_labelled_tokens(tokens_file: str, labels_file: str | None, target: Any):
    import numpy as np
    import torch

    from runtime.utils.errors import FILE_FAULTS

    if labels_file is None:
        raise UserError("--tokens needs --labels (the class of each row, a .npy of shape (N,))")
    arrays = []
    for flag, path in (("--tokens", tokens_file), ("--labels", labels_file)):
        try:
            arrays.append(np.load(path, allow_pickle=False))
        except FILE_FAULTS as err:
            raise UserError(f"{flag} {path}: cannot read a .npy array ({type(err).__name__}: {err})") from None
    tokens, labels = arrays
    cfg = target.config
    if tokens.ndim >= 1 and len(tokens) == 0:
        raise UserError(f"--tokens {tokens_file} holds no rows; give at least one image's tokens (N, {cfg.block_size})")
    if tokens.ndim != 2 or tokens.shape[1] != cfg.block_size or not np.issubdtype(tokens.dtype, np.integer):
        raise UserError(f"--tokens {tokens_file}: expected an integer array (N, {cfg.block_size}) for this target, "
                        f"got {tokens.dtype} {tuple(tokens.shape)}")
    if labels.shape != (len(tokens),) or not np.issubdtype(labels.dtype, np.integer):
        raise UserError(f"--labels {labels_file}: expected an integer array ({len(tokens)},), got "
                        f"{labels.dtype} {tuple(labels.shape)}")
    if tokens.min() < 0 or tokens.max() >= cfg.vocab_size:
        raise UserError(f"--tokens {tokens_file}: tokens must lie in [0, {cfg.vocab_size})")
    if labels.min() < 0 or labels.max() >= cfg.num_classes:
        raise UserError(f"--labels {labels_file}: classes must lie in [0, {cfg.num_classes})")
    return torch.from_numpy(tokens.astype(np.int64)), torch.from_numpy(labels.astype(np.int64))


def _check_out(out: Path, force: bool, resume: bool) -> None:
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: exists and is not a folder; choose a folder path")
    if resume:
        if not (out / "checkpoint.pt").is_file():
            raise UserError(f"--resume: {out} holds no checkpoint.pt to continue from; drop --resume to start afresh")
        return
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise UserError(f"--out {out}: is not empty; pass --force to replace it, --resume to continue a run there, "
                            "or choose another folder")
        shutil.rmtree(out)


def _command(args: dict[str, Any]) -> str:
    flags = {"gpt_model": "--gpt-model", "gpt_ckpt": "--gpt-ckpt", "image_size": "--image-size", "out": "--out",
             "device": "--device", "num_images": "--num-images", "classes": "--classes", "tokens_file": "--tokens",
             "labels_file": "--labels", "data": "--data", "steps": "--steps", "batch": "--batch", "lr": "--lr",
             "seed": "--seed", "eval_images": "--eval-images", "data_cfg": "--data-cfg", "data_top_k": "--data-top-k",
             "data_temperature": "--data-temperature"}
    words = ["runtime", "train", "drafter"]
    for key, flag in flags.items():
        if args.get(key) is not None:
            words += [flag, str(args[key])]
    words += [flag for key, flag in (("trust_checkpoint", "--trust-checkpoint"), ("resume", "--resume"))
              if args.get(key)]
    return " ".join(shlex.quote(w) for w in words)


def train_drafter_for_checkpoint(args: dict[str, Any]) -> dict[str, Any]:
    """Run the three stages for the command's arguments (`locals()` of the command); returns the manifest."""
    import torch

    from backends import get_backend
    from runtime.cli.workload import process_group_backend
    from runtime.utils.distributed import barrier, destroy, init_distributed

    values, generation = _values(args)
    out = Path(args["out"])
    torch.set_num_threads(args["threads"])
    target, classes, tokens, labels, cond_masks = _target_and_data(args, values)
    ctx = init_distributed(process_group_backend(values["device"]))  # torchrun: data-parallel, else one process
    backend = get_backend(values["device"], dtype="fp32", graph_mode=False, index=ctx.device_index)
    target = target.to(backend.device, torch.float32).eval()
    data_dir = Path(args["data"]) if args["data"] is not None else out / "data"
    if ctx.is_main:
        _check_out(out, args["force"], args["resume"])
    barrier(ctx)
    if data_dir.exists() and not data_dir.is_dir():
        raise UserError(f"--data {data_dir}: exists and is not a folder")
    reuse = (data_dir / "index.json").is_file()
    if reuse and (tokens is not None or generation):
        raise UserError(f"--data {data_dir}: already holds distilled data, which is reused; drop "
                        f"{'--tokens' if tokens is not None else generation[0]}, or give another --data folder")
    command = _command({**args, **{k: v for k, v in values.items() if args.get(k) is not None}})
    started = time.perf_counter()
    drafter, index, result, settings = _distill_and_train(args, values, target, backend, data_dir, reuse,
                                                          (classes, tokens, labels, cond_masks), ctx)
    if not ctx.is_main:  # rank 0 evaluates and writes the folder
        destroy(ctx)
        return {}
    tau = _greedy_tau(args, values, target, drafter, classes, cond_masks, backend)
    _save(out, drafter)
    manifest = _manifest(args, values, target, command, data_dir, reuse, index, settings, result, tau, started)
    manifest["training"]["ranks"] = ctx.world_size
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    destroy(ctx)
    _print_done(args, result, tau, out)
    return manifest


def _values(args: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(each training setting, given or its default; the generation flags given), checked."""
    defaults = {**DEFAULTS, **(CHAMELEON_DEFAULTS if args.get("chameleon") else {})}
    values = {k: (defaults[k] if args.get(k) is None else args[k]) for k in defaults}
    for flag, key, low in (("--num-images", "num_images", 1), ("--batch", "batch", 1), ("--eval-images", "eval_images", 0)):
        if values[key] < low:
            raise UserError(f"{flag} must be >= {low}, got {values[key]}")
    for flag, key in (("--lr", "lr"), ("--data-temperature", "data_temperature")):
        if not 0 < values[key] < float("inf"):
            raise UserError(f"{flag} must be a positive finite number, got {values[key]}")
    if not 0 <= values["data_cfg"] < float("inf") or values["data_top_k"] < 0:
        raise UserError("--data-cfg must be a finite number >= 0 and --data-top-k an integer >= 0")
    if args["tokens_file"] is None and args["labels_file"] is not None:
        raise UserError("--labels goes with --tokens; add --tokens FILE.npy or drop --labels")
    generation = [flag for flag, key in GENERATION_FLAGS if args.get(key) is not None]
    if args["tokens_file"] is not None and generation:
        raise UserError(f"--tokens replaces generation: drop {generation[0]}")
    return values, generation


def _target_and_data(args: dict[str, Any], values: dict[str, Any]) -> tuple[Any, Any, Any, Any, Any]:
    """(target, conditions to distil on: class ids or prompt ids, teacher tokens, their labels,
    prompt masks) of a prompted folder or a LlamaGen c2i checkpoint."""
    from runtime.generation.loading import load_target, parse_classes

    if args["chameleon"]:
        target, prompts, cond_masks = _chameleon_target(args, values)
        return target, prompts, None, None, cond_masks
    if args["prompts"] is not None:
        raise UserError("--prompts is for Chameleon folders (--model DIR); a LlamaGen c2i target takes --classes")
    target, _ = load_target(family=None, model=None, gpt_model=args["gpt_model"], gpt_ckpt=args["gpt_ckpt"],
                            image_size=args["image_size"], trust=args["trust_checkpoint"])
    if target.config.model_type != "c2i":
        raise UserError(f"{args['gpt_ckpt']}: a t2i target; runtime train drafter supports c2i targets for now")
    if args["tokens_file"] is not None:
        tokens, labels = _load_labelled_tokens(args["tokens_file"], args["labels_file"], target)
        return target, None, tokens, labels, None
    if args["classes"] is None:
        return target, [i % target.config.num_classes for i in range(values["num_images"])], None, None, None
    return target, parse_classes(args["classes"], values["num_images"], _ClassRange(target.config.num_classes)), \
        None, None, None


def _distill_and_train(args: dict[str, Any], values: dict[str, Any], target: Any, backend: Any, data_dir: Path,
                       reuse: bool, data: tuple[Any, Any, Any, Any], ctx: Any) -> tuple[Any, Any, Any, Any]:
    """Stages 1 and 2: the self-distilled data (or the reused shards), then the drafter trained on
    them; (drafter, data index, training result, settings)."""
    import torch

    from runtime.cli.progress import training_progress
    from runtime.models.configs import DrafterConfig
    from runtime.models.drafter import Drafter
    from runtime.training import drafter_training as dt

    classes, tokens, labels, cond_masks = data
    out = Path(args["out"])
    settings = dt.TrainSettings(steps=values["steps"], batch=values["batch"], lr=values["lr"], seed=args["seed"])
    with (training_progress() if ctx.is_main else nullcontext(dt._quiet)) as progress:
        out.mkdir(parents=True, exist_ok=True)
        index = (dt.read_index(data_dir, target) if reuse else
                 dt.distill(target, data_dir, classes, dt.DistillSettings(
                     seed=args["seed"], cfg=values["data_cfg"], top_k=values["data_top_k"],
                     temperature=values["data_temperature"]), tokens=tokens, labels=labels, cond_masks=cond_masks,
                     progress=progress, ctx=ctx))
        torch.manual_seed(args["seed"])  # the same initial drafter on every rank
        drafter = Drafter(DrafterConfig.for_target(target.config)).to(backend.device)
        result = dt.train(drafter, target, data_dir, out, settings, resume=args["resume"], progress=progress, ctx=ctx)
    return drafter, index, result, settings


def _greedy_tau(args: dict[str, Any], values: dict[str, Any], target: Any, drafter: Any, classes: Any,
                cond_masks: Any, backend: Any) -> float | None:
    """Stage 3: the new drafter's greedy tau on its target (None with --eval-images 0)."""
    from runtime.training import drafter_training as dt

    if not values["eval_images"]:
        return None
    if args["chameleon"]:
        rows = [i % len(classes) for i in range(values["eval_images"])]
        return dt.greedy_tau(target, drafter, classes[rows].to(backend.device), seed=args["seed"] + 1,
                             cond_masks=cond_masks[rows].to(backend.device))
    eval_classes = [i % target.config.num_classes for i in range(values["eval_images"])]
    return dt.greedy_tau(target, drafter, eval_classes, seed=args["seed"] + 1)


def _save(out: Path, drafter: Any) -> None:
    from runtime.models.loading import save_drafter_folder

    save_drafter_folder(out, drafter.config, drafter)


def _manifest(args: dict[str, Any], values: dict[str, Any], target: Any, command: str, data_dir: Path, reuse: bool,
              index: Any, settings: Any, result: Any, tau: float | None, started: float) -> dict[str, Any]:
    """The drafter folder's manifest.json: the command, the target, the data, training and metrics."""
    from runtime.bench.environment import file_sha256

    return {
        "kind": "lantern-runtime drafter",
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "argv": ["runtime", *sys.argv[1:]],
        "target": {"gpt_model": args["gpt_model"], "gpt_ckpt": str(args["gpt_ckpt"] or args["model"]),
                   "kind": target.config.model_type,
                   "sha256": file_sha256(args["gpt_ckpt"]) if args["gpt_ckpt"] and Path(args["gpt_ckpt"]).is_file()
                   else None,
                   "block_size": target.config.block_size, "dim": target.config.dim,
                   "vocab_size": target.config.vocab_size},
        "data": {"dir": str(data_dir), "reused": reuse, **{k: index[k] for k in ("source", "images", "settings")},
                 "shards": index["shards"]},
        "training": {**vars(settings), **{k: result[k] for k in ("resumed_from", "seconds", "train_loss")}},
        "metrics": {"held_out_top1": result["val"]["top1"], "held_out_top3": result["val"]["top3"],
                    "held_out_vloss": result["val"]["vloss"], "held_out_ploss": result["val"]["ploss"],
                    "greedy_tau_sd_depth4": tau, "greedy_tau_images": values["eval_images"] or None},
        "wall_time_s": time.perf_counter() - started,
    }


def _print_done(args: dict[str, Any], result: Any, tau: float | None, out: Path) -> None:
    from rich.console import Console

    tau_text = "-" if tau is None else f"{tau:.2f}"
    Console().print(f"drafter for {Path(args['gpt_ckpt'] or args['model']).name}: held-out top-1 "
                    f"{result['val']['top1']:.1%}, top-3 {result['val']['top3']:.1%}, greedy tau (sd, depth 4) "
                    f"{tau_text}; written to {out} (use it with --drafter {out})", highlight=False)


class _ClassRange:
    """What `parse_classes` reads of a loaded model: its class count (and no class names)."""

    class_names = None

    def __init__(self, num_classes: int) -> None:
        self.num_classes = num_classes


def _chameleon_target(args: dict[str, Any], values: dict[str, Any]):
    """(target, prompt ids (n, L), masks (n, L)) of a Chameleon folder and the --prompts file."""
    from runtime.generation.workload import cycle, read_prompt_file
    from runtime.generation.loading import load_target

    family = args.get("family") or "chameleon"
    sized = family == "emu3"  # Emu3's grid follows --image-size; the others' is fixed by their config
    for flag, key in (("--tokens", "tokens_file"), ("--labels", "labels_file"), ("--classes", "classes"),
                      ("--gpt-model", "gpt_model"), *(() if sized else (("--image-size", "image_size"),))):
        if args.get(key) is not None:
            raise UserError(f"{flag} does not apply to a Chameleon folder (it draws its data from --prompts); "
                            f"drop {flag}")
    if args["prompts"] is None and not (Path(args["data"] or "") / "index.json").is_file():
        raise UserError("a Chameleon folder needs --prompts FILE (one prompt per line) for its data")
    target, encoder = load_target(family=family, model=args["model"], gpt_model=None, gpt_ckpt=None,
                                  image_size=args.get("image_size"), trust=args["trust_checkpoint"])
    texts = cycle(read_prompt_file(args["prompts"]), values["num_images"]) if args["prompts"] else [""]  # data reused
    ids, masks = encoder(texts)
    target.for_prompts(ids.size(1))
    return target, ids, masks
