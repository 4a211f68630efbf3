"""Drafter training for any class-conditional LlamaGen-family target (official checkpoints, fine-tunes).

Two stages, the way LANTERN builds its drafters:

1. **Self-distilled data** (`distill`): the frozen target generates images with sampling on the
   given conditions - class ids (LlamaGen c2i) or prompts (Chameleon: token ids with masks) - or a
   user's token file is used instead, and is then teacher-forced on those tokens to read its
   last-layer hidden states (post final norm) at the positions that predicted image tokens 0..S-1.
   Stored as sharded safetensors, `data/shard_NNNNN.safetensors` with `tokens` (n, S) int32,
   `hidden` (n, S, D) float16 and the condition the hidden states were computed under (`labels`
   (n,), or `prompts` / `prompt_mask` (n, L)); a share of rows carries the null condition so the
   drafter also serves CFG's unconditional rows. `data/index.json` lists the shards with their
   sha256 and how they were made. S = block_size (image tokens), D = target dim.
2. **Training** (`train`): EAGLE's loss (SmoothL1 on hidden states + 0.1 x soft cross-entropy through
   the target's frozen head), drafter position p reads (z_p, h_p) and regresses h_{p+1}; AdamW with
   warm-up and cosine decay. A checkpoint (`checkpoint.pt`: step, drafter, optimiser) is written every
   `checkpoint_every` steps; a resumed run continues at its step with the same batches, because
   step s's batch is a function of (seed, s) only. The last `val_fraction` of the images is held out:
   top-1 / top-3 = how often the target's next token (its argmax) is the drafter's first / among its
   first three.

The result is a LANTERN-layout drafter folder (`config.json` + `model.safetensors`, what `--drafter`
loads) with `manifest.json` recording the data, the command and the metrics.

Under `torchrun` (`ctx`, a `runtime.utils.distributed.DistContext`) both stages are data-parallel: each
rank generates a contiguous block of the images (image i's seed depends on i only, so the data is
the single process's) and writes its own shards, rank 0 writes the index; in training each rank
takes every world_size-th image of the step's batch and the gradients are averaged across ranks,
so a step sees the same batch as in one process.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from runtime.utils.errors import UserError

Progress = Callable[[str, int, int, dict[str, float]], None]
NULL_CLASS_SHARE = 0.1  # rows teacher-forced under the null class (CFG's unconditional rows)
NOISE_STD = 0.2  # EAGLE's input noise: hidden += (U[0,1) - 0.5) * std * 512 / S
SHARD_FILE = "shard_{:07d}.safetensors"  # numbered by the shard's first image


def _quiet(stage: str, done: int, total: int, info: dict[str, float]) -> None:
    return None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _check_target(target: Any) -> None:
    if target.config.model_type not in ("c2i", "chameleon"):
        raise UserError("runtime train drafter supports class-conditional LlamaGen and Chameleon targets; a t2i "
                        "LlamaGen target needs caption features for its data, which this command does not build yet")


@dataclass
class DistillSettings:
    """How the self-distilled data is made: sampling settings of the generation (LlamaGen's c2i
    defaults: cfg 4, top-k 2000) and the share of rows teacher-forced under the null class."""

    seed: int = 0
    temperature: float = 1.0
    top_k: int = 2000
    top_p: float = 1.0
    cfg: float = 4.0
    null_share: float = NULL_CLASS_SHARE
    shard_images: int = 256
    batch: int = 8


@torch.no_grad()
def teacher_hidden(target: Any, cond: torch.Tensor, tokens: torch.Tensor,
                   cond_mask: torch.Tensor | None = None) -> torch.Tensor:
    """(n, S, D) post-norm hidden states: row p is the state that predicted image token p (the
    condition's last position for p = 0)."""
    _, hidden = target.forward_train(cond, tokens, cond_mask)
    return hidden[:, target.config.cls_token_num - 1:]


def _null_rows(target: Any, cond: torch.Tensor, mask: torch.Tensor | None, null: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`cond` (and `mask`) with the rows where `null` is True replaced by the null condition."""
    if mask is None:
        return torch.where(null, torch.full_like(cond, target.config.num_classes), cond), None
    sel = null[:, None]
    return (torch.where(sel, target.null_condition(cond), cond),
            torch.where(sel, target.null_condition_mask(mask), mask))


@torch.no_grad()
def distill(target: Any, data_dir: Path, classes: Sequence[int] | torch.Tensor | None, settings: DistillSettings, *,
            tokens: torch.Tensor | None = None, labels: torch.Tensor | None = None,
            cond_masks: torch.Tensor | None = None, progress: Progress = _quiet, ctx: Any = None) -> dict[str, Any]:
    """Write the self-distilled shards into `data_dir` (created; must not hold shards) and return its index.

    Conditions: `classes` (class ids, or prompt ids (n, L) with `cond_masks`), one image generated
    per entry by the target; or `tokens` (n, S) with `labels` (n,) to teacher-force on. Generation
    runs through the runtime's own AR decoder. With `ctx` (torchrun) each rank makes a contiguous
    block of the images; every rank returns the index (rank 0 writes it).
    """
    from runtime.utils.distributed import DistContext, barrier, gather_objects, shard_bounds

    ctx = ctx or DistContext()
    from safetensors.torch import save_file

    from runtime.core import MethodSpec, SamplingParams, generate

    _check_target(target)
    cfg = target.config
    device = target.tok_embeddings.weight.device
    if tokens is None:
        if classes is None or len(classes) == 0:
            raise UserError("no conditions to generate from: give --num-images / --classes, or --tokens FILE.npy")
        spec = MethodSpec(method="ar", sampling=SamplingParams(
            greedy=False, temperature=settings.temperature, top_k=settings.top_k, top_p=settings.top_p,
            cfg=settings.cfg))
        labels = (classes.to(torch.long) if isinstance(classes, torch.Tensor)
                  else torch.tensor([int(c) for c in classes], dtype=torch.long))
        made = []
        mine = range(*shard_bounds(len(labels), ctx.rank, ctx.world_size))
        for start in range(mine.start, mine.stop, settings.batch):
            chunk = labels[start:min(start + settings.batch, mine.stop)]
            masks = None if cond_masks is None else cond_masks[start:start + len(chunk)]
            out = generate(target, None, spec, chunk.tolist() if chunk.dim() == 1 else chunk.to(device),
                           cond_masks=None if masks is None else masks.to(device), seed=settings.seed,
                           indices=range(start, start + len(chunk)))
            made.append(out.tokens.cpu())
            progress("generate", start + len(chunk) - mine.start, len(mine), {})
        tokens = torch.cat(made) if made else torch.zeros(0, cfg.block_size, dtype=torch.long)
        source = "sampled"
    else:
        source = "tokens"
        mine = range(*shard_bounds(len(tokens), ctx.rank, ctx.world_size))
        tokens = tokens[mine.start:mine.stop]
    tokens = tokens.to(torch.long)
    n = len(labels)
    gen = torch.Generator().manual_seed(settings.seed + 1)
    null = torch.rand(n, generator=gen) < settings.null_share
    used, used_mask = _null_rows(target, labels.to(torch.long), cond_masks, null)
    if ctx.is_main:
        data_dir.mkdir(parents=True, exist_ok=True)
        if any(data_dir.glob("shard_*.safetensors")):
            raise UserError(f"{data_dir}: already holds shards; give an empty folder or reuse it with --data")
    barrier(ctx)
    shards = []
    for start in range(mine.start, mine.stop, settings.shard_images):
        stop = min(mine.stop, start + settings.shard_images)
        local = slice(start - mine.start, stop - mine.start)
        hidden = []
        for s in range(start, stop, settings.batch):
            e = min(stop, s + settings.batch)
            mask = None if used_mask is None else used_mask[s:e].to(device)
            hidden.append(teacher_hidden(target, used[s:e].to(device), tokens[s - mine.start:e - mine.start].to(device),
                                         mask).to("cpu", torch.float16))
        path = data_dir / SHARD_FILE.format(start)
        condition = ({"labels": used[start:stop].contiguous()} if used_mask is None else
                     {"prompts": used[start:stop].to(torch.int32).contiguous(),
                      "prompt_mask": used_mask[start:stop].contiguous()})
        save_file({"tokens": tokens[local].to(torch.int32).contiguous(), "hidden": torch.cat(hidden).contiguous(),
                   **condition}, str(path))
        shards.append({"file": path.name, "images": stop - start, "sha256": _sha256(path)})
        progress("hidden states", stop - mine.start, len(mine), {})
    parts = gather_objects(shards, ctx)
    index = {"source": source, "images": n, "block_size": cfg.block_size, "dim": cfg.dim,
             "vocab_size": cfg.vocab_size, "num_classes": cfg.num_classes, "settings": asdict(settings),
             "shards": [s for part in parts for s in part] if parts is not None else []}
    if ctx.is_main:
        (data_dir / "index.json").write_text(json.dumps(index, indent=1) + "\n")
    barrier(ctx)
    return json.loads((data_dir / "index.json").read_text())


def read_index(data_dir: Path, target: Any) -> dict[str, Any]:
    """The data index, checked against `target` (block size, width, vocabulary) and the shards on disk."""
    path = data_dir / "index.json"
    if not path.is_file():
        raise UserError(f"{data_dir}: no index.json; give a folder written by 'runtime train drafter' (its data/)")
    index = json.loads(path.read_text())
    cfg = target.config
    for key, want in (("block_size", cfg.block_size), ("dim", cfg.dim), ("vocab_size", cfg.vocab_size)):
        if index.get(key) != want:
            raise UserError(f"{path}: the data was made for {key} {index.get(key)} but the target has {want}; "
                            "distil new data for this target")
    for shard in index["shards"]:
        if not (data_dir / shard["file"]).is_file():
            raise UserError(f"{path}: shard {shard['file']} is missing")
    return index


class ShardData:
    """The shards' images as one index space; the last three shards read are kept in memory."""

    def __init__(self, data_dir: Path, index: dict[str, Any]) -> None:
        self.dir = data_dir
        self.sizes = [s["images"] for s in index["shards"]]
        self.files = [s["file"] for s in index["shards"]]
        self.starts = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        self.total = sum(self.sizes)
        self._cache: dict[int, dict[str, torch.Tensor]] = {}

    def _shard(self, i: int) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        if i not in self._cache:
            if len(self._cache) >= 3:
                self._cache.pop(next(iter(self._cache)))
            self._cache[i] = load_file(str(self.dir / self.files[i]))
        return self._cache[i]

    def take(self, images: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens (b, S) long, hidden (b, S, D) float32) of global image indices."""
        rows = []
        for g in images:
            i = max(k for k, s in enumerate(self.starts) if s <= g)
            shard = self._shard(i)
            j = g - self.starts[i]
            rows.append((shard["tokens"][j].long(), shard["hidden"][j].float()))
        return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])


ORDER_BLOCK = 256  # images shuffled together: batches read few shards, whatever the files' layout


def batch_order(train_images: int, seed: int, epoch: int) -> list[int]:
    """Epoch `epoch`'s order of the training images: blocks of ORDER_BLOCK consecutive images
    shuffled, images shuffled within each block (a batch reads one or two shards); a function of
    (seed, epoch) only, so runs sharded differently (torchrun) or resumed see the same batches."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order: list[int] = []
    blocks = (train_images + ORDER_BLOCK - 1) // ORDER_BLOCK
    for b in torch.randperm(blocks, generator=gen).tolist():
        lo, hi = b * ORDER_BLOCK, min((b + 1) * ORDER_BLOCK, train_images)
        order.extend((lo + torch.randperm(hi - lo, generator=gen)).tolist())
    return order


def lr_at(step: int, total: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    """Linear warm-up to `peak`, then cosine decay to `floor * peak` at `total`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for group in opt.param_groups:
        group["lr"] = lr


def freeze_for_training(drafter: Any, target: Any) -> list[torch.nn.Parameter]:
    """EAGLE's setup: the drafter's embedding is a frozen copy of the target's, the target is
    frozen; returns the parameters to optimise."""
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(target.tok_embeddings.weight)
    drafter.embed_tokens.weight.requires_grad_(False)
    for p in target.parameters():
        p.requires_grad_(False)
    return [p for p in drafter.parameters() if p.requires_grad]


def eagle_loss(drafter: Any, target: Any, tokens: torch.Tensor, hidden: torch.Tensor,
               noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, vloss, ploss) of one batch: position p reads (z_p, h_p + noise) and regresses
    h_{p+1} (the last position has no target). tokens (B, S), hidden and noise (B, S, D)."""
    from runtime.models.drafter import drafter_loss

    goal = torch.cat([hidden[:, 1:], torch.zeros_like(hidden[:, :1])], dim=1)
    mask = torch.ones(hidden.shape[:2], device=hidden.device)
    mask[:, -1] = 0
    out = drafter.forward_train((hidden + noise).to(drafter.embed_tokens.weight.dtype), tokens)
    return drafter_loss(out, goal.to(out.dtype), target.output, mask)


@dataclass
class TrainSettings:
    steps: int = 2000
    batch: int = 16
    lr: float = 1e-3
    seed: int = 0
    val_fraction: float = 0.1
    checkpoint_every: int = 200


def train(drafter: Any, target: Any, data_dir: Path, out_dir: Path, settings: TrainSettings, *,
          resume: bool = False, progress: Progress = _quiet, ctx: Any = None) -> dict[str, Any]:
    """Train `drafter` on the shards in `data_dir`; checkpoints go to `out_dir/checkpoint.pt`.

    Returns {"steps", "resumed_from", "seconds", "train_loss", "val": {top1, top3, vloss, ploss,
    positions}} ("val" None on ranks other than 0 under torchrun).
    """
    import torch.distributed as dist

    from runtime.utils.distributed import DistContext, barrier

    ctx = ctx or DistContext()
    if settings.batch % ctx.world_size:
        raise UserError(f"--batch {settings.batch} must be a multiple of the {ctx.world_size} ranks (each takes "
                        "an equal share of a step's batch)")

    index = read_index(data_dir, target)
    data = ShardData(data_dir, index)
    val = max(1, round(data.total * settings.val_fraction)) if data.total > 1 else 0
    train_images = data.total - val
    if train_images < 1:
        raise UserError(f"{data_dir}: {data.total} image(s) leave none to train on after holding out {val}; "
                        "distil more images")
    device = target.tok_embeddings.weight.device
    params = freeze_for_training(drafter, target)
    opt = torch.optim.AdamW(params, lr=settings.lr, betas=(0.9, 0.95), weight_decay=0.0)
    checkpoint = out_dir / "checkpoint.pt"
    start = 0
    if resume and checkpoint.is_file():
        saved = torch.load(checkpoint, map_location=device, weights_only=True)
        drafter.load_state_dict(saved["drafter"])
        opt.load_state_dict(saved["optimizer"])
        start = int(saved["step"])
    seq = target.config.block_size
    t0 = time.perf_counter()
    losses: list[float] = []
    drafter.train()
    for step in range(start, settings.steps):
        set_lr(opt, lr_at(step, settings.steps, settings.lr, warmup=max(1, settings.steps // 25)))
        first = step * settings.batch
        epoch, offset = divmod(first, train_images)
        order = batch_order(train_images, settings.seed, epoch)
        picks = [order[(offset + k) % train_images] for k in range(settings.batch)]
        tokens, hidden = (t.to(device) for t in data.take(picks[ctx.rank::ctx.world_size]))
        gen = torch.Generator().manual_seed(settings.seed * 7919 + step)
        noise = ((torch.rand(settings.batch, *hidden.shape[1:], generator=gen) - 0.5) * (NOISE_STD * 512 / seq))
        noise = noise[ctx.rank::ctx.world_size].to(device)  # the rows of the whole batch this rank takes
        loss, vloss, ploss = eagle_loss(drafter, target, tokens, hidden, noise)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if ctx.is_distributed:  # mean of the ranks' gradients: the gradient of the whole batch's mean loss
            for p in params:
                dist.all_reduce(p.grad)
                p.grad /= ctx.world_size
        torch.nn.utils.clip_grad_value_(params, 0.5)
        opt.step()
        losses.append(loss.item())
        progress("drafter", step + 1, settings.steps, {"vloss": vloss.item(), "ploss": ploss.item()})
        if (step + 1) % settings.checkpoint_every == 0 or step + 1 == settings.steps:
            if ctx.is_main:
                _save_checkpoint(checkpoint, step + 1, drafter, opt)
            barrier(ctx)
    drafter.eval()
    val = held_out_metrics(drafter, target, data, range(train_images, data.total)) if ctx.is_main else None
    return {"steps": settings.steps, "resumed_from": start, "seconds": time.perf_counter() - t0,
            "train_loss": sum(losses[-20:]) / max(1, len(losses[-20:])) if losses else None, "val": val}


def _save_checkpoint(path: Path, step: int, drafter: Any, opt: torch.optim.Optimizer) -> None:
    from runtime.utils.atomic import atomic_path

    with atomic_path(path) as tmp:
        torch.save({"step": step, "drafter": drafter.state_dict(), "optimizer": opt.state_dict()}, tmp)


@torch.no_grad()
def held_out_metrics(drafter: Any, target: Any, data: ShardData, images: Sequence[int],
                     batch: int = 16) -> dict[str, float]:
    """Teacher-forced on held-out images: top-1 / top-3 (the target's argmax next token is the
    drafter's first / among its first three), and the two loss terms."""
    from runtime.models.drafter import drafter_loss

    images = list(images)
    device = target.tok_embeddings.weight.device
    top1 = top3 = positions = 0
    vloss = ploss = 0.0
    for start in range(0, len(images), batch):
        tokens, hidden = (t.to(device) for t in data.take(images[start:start + batch]))
        hidden = hidden.to(drafter.embed_tokens.weight.dtype)
        out = drafter.forward_train(hidden, tokens)[:, :-1]
        goal = hidden[:, 1:]
        want = target.logits(goal).argmax(-1, keepdim=True)
        ranked = target.logits(out).topk(3, dim=-1).indices
        top1 += int((ranked[..., :1] == want).sum())
        top3 += int((ranked == want).any(-1).sum())
        positions += want.numel()
        _, v, p = drafter_loss(out, goal, target.output, torch.ones(goal.shape[:2], device=device))
        vloss += float(v) * len(tokens)
        ploss += float(p) * len(tokens)
    n = max(1, len(images))
    return {"top1": top1 / max(1, positions), "top3": top3 / max(1, positions), "vloss": vloss / n,
            "ploss": ploss / n, "positions": positions}


@torch.no_grad()
def greedy_tau(target: Any, drafter: Any, conditions: Sequence[int] | torch.Tensor, seed: int = 0, depth: int = 4,
               cond_masks: torch.Tensor | None = None) -> float:
    """Mean accepted length (tokens per target forward, bonus included) of greedy `sd` with a chain of
    `depth` drafts: how well the drafter serves this target."""
    from runtime.core import MethodSpec, SamplingParams, generate

    spec = MethodSpec(method="sd", depth=depth, sampling=SamplingParams(greedy=True))
    conditions = conditions if isinstance(conditions, torch.Tensor) else list(conditions)
    return float(generate(target, drafter, spec, conditions, cond_masks=cond_masks, seed=seed)
                 .stats["mean_accepted_length"])
