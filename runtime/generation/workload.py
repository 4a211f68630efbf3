"""A workload: what to condition each image on (class ids, caption features or prompt token ids),
built once from what a user gives (class ids, prompts), with the image-count and batch checks every
command and the `ImageGenerator` share; and the statistics of several parts merged as one run's."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from runtime.utils.errors import UserError

if TYPE_CHECKING:
    from backends import Backend
    from runtime.generation.loading import LoadedModel

IN_MEMORY_IMAGES = 100_000  # run / bench / the ImageGenerator keep every image in memory; beyond this, runtime sample
SAMPLE_IMAGES = 10_000_000  # runtime sample keeps one condition per image


@dataclass(frozen=True)
class Workload:
    """One condition per image. `conditions`: class ids (c2i), caption features (n, cls,
    caption_dim) (t2i) or prompt token ids (n, cls) (Chameleon family); `masks` (n, cls) bool
    for the last two, else None; `labels`: each image's class id or prompt text."""

    conditions: Any
    masks: Any
    labels: list[Any]

    def __len__(self) -> int:
        return len(self.labels)

    def select(self, idx: Sequence[int]) -> "Workload":
        """The images at `idx` (one rank's or one chunk's share), in that order."""
        import torch

        idx = list(idx)
        if isinstance(self.conditions, torch.Tensor):
            conditions: Any = self.conditions[idx]
        else:
            conditions = [self.conditions[i] for i in idx]
        masks = self.masks[idx] if self.masks is not None else None
        return Workload(conditions, masks, [self.labels[i] for i in idx])


def check_num_images(count: int | None, limit: int = IN_MEMORY_IMAGES) -> None:
    """Refuse --num-images below 1 or above what the command can hold (`limit`)."""
    if count is None:
        return
    if isinstance(count, bool) or not isinstance(count, int):
        raise UserError(f"--num-images must be an integer, got {count!r}")
    if count < 1:
        raise UserError(f"--num-images must be >= 1, got {count}")
    if count > limit:
        hint = ("use runtime sample (chunked, resumable, flat memory)" if limit == IN_MEMORY_IMAGES
                else "split the work into several sampling runs")
        raise UserError(f"--num-images {count:,} is more than this command holds ({limit:,}); {hint}")


def batch_size(given: int | None, profile: Any) -> int:
    """--batch-size if given, else the profile's `[device] batch_size`; refuses values below 1."""
    if given is not None and (isinstance(given, bool) or not isinstance(given, int) or given < 1):
        raise UserError(f"--batch-size must be >= 1, got {given}")
    return given if given is not None else profile.device.batch_size


def resolve_prompt_length(given: int | None, model_type: str, default: int | None = None) -> int | None:
    """--prompt-length for a model of `model_type`: refused where it does nothing (not Chameleon)
    or below 2 (bos and the image start); `default` where not given."""
    if given is not None and model_type != "chameleon":
        raise UserError("--prompt-length is for prompted models (Chameleon, Janus, Emu3: their prompts are token "
                        "prefixes); drop it")
    length = default if given is None else given
    if length is not None and length < 2:
        raise UserError(f"--prompt-length must be >= 2 (bos and the image start), got {length}")
    return length


def read_prompt_file(path_text: str) -> list[str]:
    """The non-empty lines of a --prompts file."""
    path = Path(path_text)
    if not path.is_file():
        raise UserError(f"--prompts {path_text}: file not found")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UserError(f"--prompts {path_text}: not UTF-8 text; give a text file with one prompt per line") from None
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        raise UserError(f"--prompts {path_text}: no prompts in the file")
    return lines


def cycle(items: Sequence[Any], count: int | None) -> list[Any]:
    """`items` cycled to `count` (None: each once)."""
    n = len(items) if count is None else count
    return [items[i % len(items)] for i in range(n)]


def class_text(classes: str | Sequence[int] | None) -> str | None:
    """Class ids as `--classes` spells them ("0,3,7"); a string is taken as given."""
    if classes is None or isinstance(classes, str):
        return classes
    if isinstance(classes, int):
        classes = [classes]
    if any(isinstance(c, bool) or not isinstance(c, int) for c in classes):
        raise UserError(f"--classes: expected class ids (integers), got {list(classes)!r}")
    return ",".join(str(c) for c in classes)


def build_workload(loaded: LoadedModel, backend: Backend, *, classes: str | Sequence[int] | None,
                   prompts: Sequence[str] | None, num_images: int | None, captions: Callable[[], Any] | None = None,
                   prompt_length: int | None = None) -> Workload:
    """The conditions of `num_images` images (default: one per class or prompt): class ids for a
    class-conditional model, caption features (`captions()`: the `T5Encoder`, opened once the
    prompts are read) for LlamaGen t2i, prompt token ids padded to `prompt_length` (default: the longest) for the Chameleon
    family, which also sets the target's prompt length for the decoders built next."""
    from runtime.generation.loading import parse_classes

    kind = loaded.config.model_type
    length = resolve_prompt_length(prompt_length, kind)
    if kind == "c2i":
        if prompts is not None:
            raise UserError("--prompts is for text-to-image models; this model is class-conditional (use --classes)")
        labels = parse_classes(class_text(classes), num_images, loaded)
        return Workload(labels, None, list(labels))
    if kind == "chameleon":
        if classes is not None:
            raise UserError("--classes does nothing for a Chameleon model (it reads --prompts with its own "
                            "tokenizer); drop --classes")
        if prompts is None:
            raise UserError("this is a Chameleon model: give --prompts FILE (one prompt per line)")
    else:
        if classes is not None:
            raise UserError("--classes does nothing for a text-to-image model (it reads --prompts); drop --classes")
        if prompts is None:
            raise UserError("this is a text-to-image model: give --prompts FILE (one prompt per line) and "
                            "--t5-path DIR")
    texts = _prompt_list(prompts, num_images)
    if kind == "chameleon":
        ids, mask = loaded.prompt_encoder(texts, length)
        loaded.target.for_prompts(ids.size(1))
        return Workload(ids.to(backend.device), mask.to(backend.device), texts)
    encoder = captions() if captions is not None else None
    if encoder is None:
        raise UserError("--prompts needs --t5-path DIR, a local T5 encoder (flan-t5-xl for LlamaGen)")
    emb, mask = encoder.encode(texts)
    return Workload(emb.to(backend.dtype), mask, texts)


def _prompt_list(prompts: Sequence[str], num_images: int | None) -> list[str]:
    if isinstance(prompts, str):
        prompts = [prompts]
    if any(not isinstance(p, str) for p in prompts):
        raise UserError(f"--prompts: expected text prompts, got {list(prompts)!r}")
    texts = [p.strip() for p in prompts if p.strip()]
    if not texts:
        raise UserError("--prompts: no prompts given (every one is empty)")
    return cycle(texts, num_images)


def check_t5_path(loaded: LoadedModel, t5_path: str | None) -> None:
    """--t5-path is for LlamaGen t2i: refused for the other kinds, which read class ids or their
    own tokenizer's prompts."""
    kind = loaded.config.model_type
    if t5_path is None or kind == "t2i":
        return
    if kind == "c2i":
        raise UserError("--t5-path does nothing for a class-conditional model (its prompts are class ids or "
                        "names); drop it")
    raise UserError("--t5-path does nothing for a Chameleon model (it reads --prompts with its own tokenizer); "
                    "drop --t5-path")


def caption_encoder(loaded: LoadedModel, backend: Backend, t5_path: str | None) -> Any:
    """The T5 encoder of a LlamaGen t2i model from --t5-path (None where not given)."""
    check_t5_path(loaded, t5_path)
    if t5_path is None:
        return None
    from runtime.models.t5 import T5Encoder

    return T5Encoder(t5_path, device=backend.device, dtype=backend.dtype, max_length=loaded.config.cls_token_num)


def merge_stats(all_stats: list[dict[str, Any]]) -> dict[str, Any]:
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


def merge_law(all_stats: list[dict[str, Any]]) -> dict[str, Any]:
    """step_tvd / step_tvd_bound / law_steps of several parts' stats: step-weighted means (None
    where no part measured the law)."""
    steps = sum(int(s.get("law_steps") or 0) for s in all_stats)
    if not steps:
        return {"step_tvd": None, "step_tvd_bound": None, "law_steps": 0}
    mean = {key: sum((s.get(key) or 0.0) * int(s.get("law_steps") or 0) for s in all_stats) / steps
            for key in ("step_tvd", "step_tvd_bound")}
    return {**mean, "law_steps": steps}
