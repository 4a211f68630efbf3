"""What `runtime run` and `runtime sample` (and the drafter trainer) share: the process group's
backend, the workload's conditions (class ids, caption features or prompt ids) and their
selection per rank, and the merged statistics and software record of a result."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from runtime.cli import options as opt
from runtime.utils.errors import UserError


def process_group_backend(device: str) -> str:
    """The torch.distributed backend for `device` under torchrun ("cpu" when single-process)."""
    from backends import resolve_backend_name

    if os.environ.get("WORLD_SIZE", "1") == "1":
        return "cpu"  # single process: no process group; the name is unused
    return resolve_backend_name(device)


def select(conditions: Any, idx: list[int]) -> Any:
    """The conditions (a tensor's rows, or a list's items) at indices `idx` (one rank's share)."""
    import torch

    if isinstance(conditions, torch.Tensor):
        return conditions[idx]
    return [conditions[i] for i in idx]


def workload_conditions(loaded, classes, prompts, t5_path, num_images, backend, prompt_length=None):
    """(conditions, cond_masks, labels): class ids, caption features for t2i prompts, or prompt
    token ids (padded to `prompt_length` where given) for Chameleon."""
    from runtime.generation.loading import parse_classes

    prompt_length = opt.prompt_length(prompt_length, loaded.config.model_type)
    if loaded.config.model_type == "c2i":
        if prompts is not None:
            raise UserError("--prompts is for text-to-image models; this model is class-conditional (use --classes)")
        labels = parse_classes(classes, num_images, loaded)
        return labels, None, labels
    if loaded.config.model_type == "chameleon":
        for flag, value in (("--classes", classes), ("--t5-path", t5_path)):
            if value is not None:
                raise UserError(f"{flag} does nothing for a Chameleon model (it reads --prompts with its own "
                                f"tokenizer); drop {flag}")
        if prompts is None:
            raise UserError("this is a Chameleon model: give --prompts FILE (one prompt per line)")
        texts = read_prompts(prompts, num_images)
        ids, mask = loaded.prompt_encoder(texts, prompt_length)
        loaded.target.for_prompts(ids.size(1))
        return ids.to(backend.device), mask.to(backend.device), texts
    if prompts is None:
        raise UserError("this is a text-to-image model: give --prompts FILE (one prompt per line) and --t5-path DIR")
    if t5_path is None:
        raise UserError("--prompts needs --t5-path DIR, a local T5 encoder (flan-t5-xl for LlamaGen)")
    texts = read_prompts(prompts, num_images)
    from runtime.models.t5 import T5Encoder

    encoder = T5Encoder(t5_path, device=backend.device, dtype=backend.dtype,
                        max_length=loaded.config.cls_token_num)
    emb, mask = encoder.encode(texts)
    return emb.to(backend.dtype), mask, texts


def read_prompts(prompts: str, num_images: int | None) -> list[str]:
    """The --prompts file's non-empty lines, cycled to --num-images (default: each once)."""
    path = Path(prompts)
    if not path.is_file():
        raise UserError(f"--prompts {prompts}: file not found")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UserError(f"--prompts {prompts}: not UTF-8 text; give a text file with one prompt per line") from None
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        raise UserError(f"--prompts {prompts}: no prompts in the file")
    n = num_images or len(lines)
    return [lines[i % len(lines)] for i in range(n)]


def software_record() -> dict[str, Any]:
    """What reproducing a result needs: package version, git commit (None where unknown) and the
    command line of this invocation."""
    from runtime import __version__
    from runtime.bench.environment import git_commit
    from runtime.cli.app import INVOCATION

    return {"version": __version__, "git_commit": git_commit(), "command_line": list(INVOCATION)}


def merge_stats(all_stats: list[dict]) -> dict:
    """The statistics of several parts (ranks, chunks) as one run's: forward-weighted means."""
    fw = sum(s["target_forwards"] for s in all_stats)
    tokens = sum(s["tokens"] for s in all_stats)
    accepted = sum(s["mean_accepted_length"] * s["target_forwards"] for s in all_stats)
    depth = max((len(s["per_depth_acceptance"]) for s in all_stats), default=0)
    weights = [s["target_forwards"] for s in all_stats]
    per_depth = [sum(w * (s["per_depth_acceptance"][d] if d < len(s["per_depth_acceptance"]) else 0)
                     for w, s in zip(weights, all_stats)) / max(fw, 1) for d in range(depth)]
    return {"mean_accepted_length": accepted / max(fw, 1), "target_forwards": fw, "tokens": tokens,
            "step_compression": tokens / max(fw, 1), "per_depth_acceptance": per_depth,
            "mean_relaxation_mass": (sum(s["mean_relaxation_mass"] * w for s, w in zip(all_stats, weights))
                                     / max(fw, 1)),
            "mean_drafted_depth": (sum(s.get("mean_drafted_depth", 0.0) * w for s, w in zip(all_stats, weights))
                                   / max(fw, 1)),
            **merge_law(all_stats)}


def merge_law(all_stats: list[dict]) -> dict:
    """step_tvd / step_tvd_bound / law_steps of several parts' stats: step-weighted means (None
    where no part measured the law)."""
    steps = sum(int(s.get("law_steps") or 0) for s in all_stats)
    if not steps:
        return {"step_tvd": None, "step_tvd_bound": None, "law_steps": 0}
    mean = {key: sum((s.get(key) or 0.0) * int(s.get("law_steps") or 0) for s in all_stats) / steps
            for key in ("step_tvd", "step_tvd_bound")}
    return {**mean, "law_steps": steps}
