"""Sampling at scale: a folder of fixed-size chunks, each written once, assembled into ADM's layout.

Image i's tokens depend only on the run seed and i (per-image seeds, batch-invariant decoding),
so the N images are cut into chunks of `chunk` consecutive indices and any process may make any
chunk: ranks of one `torchrun` take chunk c when c % world == rank, separate jobs take a
`--shard I/N`, and a run that is interrupted and started again makes only the chunks it lacks.
A chunk is one atomically renamed `.npz` (images, tokens, conditions, stats), so a crash leaves a
chunk whole or absent. `manifest.json` pins the workload (model, method, seed, N, chunk size,
conditions); a restart with other settings is refused rather than mixed in. When every chunk
exists, `assemble` streams them into `samples.npz` (arr_0 uint8 (N, H, W, 3), arr_1 labels for
class-conditional runs), `tokens.npy` and `prompts.txt`, one chunk in memory at a time.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from runtime.atomic import atomic_path, atomic_write_text
from runtime.errors import UserError
from runtime.metrics.adm import LABELS, write_npz
from runtime.metrics.images import SAMPLES_FILE

MANIFEST = "manifest.json"
CHUNKS = "chunks"


@dataclass(frozen=True)
class Chunk:
    index: int
    start: int
    stop: int

    def __len__(self) -> int:
        return self.stop - self.start


def plan(n: int, size: int) -> list[Chunk]:
    """Chunks of `size` consecutive image indices covering range(n)."""
    return [Chunk(c, s, min(s + size, n)) for c, s in enumerate(range(0, n, size))]


def mine(chunks: list[Chunk], rank: int, world: int) -> list[Chunk]:
    """The chunks process `rank` of `world` makes (round robin: every rank gets every class mix)."""
    return [c for c in chunks if c.index % world == rank]


def conditions_digest(conditions: list[Any]) -> str:
    return hashlib.sha256(json.dumps(conditions).encode()).hexdigest()[:16]


class SampleStore:
    """The chunk folder of one sampling run at `root`."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.chunk_dir = self.root / CHUNKS

    def open(self, workload: dict[str, Any]) -> None:
        """Create the folder for `workload`, or check that an existing one holds the same workload."""
        manifest = self.root / MANIFEST
        if manifest.is_file():
            try:
                before = json.loads(manifest.read_text(encoding="utf-8"))
            except ValueError:
                raise UserError(f"{manifest} is damaged; remove {self.root} and sample again") from None
            changed = sorted(k for k in set(before) | set(workload) if before.get(k) != workload.get(k))
            if changed:
                raise UserError(f"{self.root} holds a sampling run with other settings ({', '.join(changed)} "
                                "differ); resume it with the same settings or give a new --out")
            return
        if self.root.exists() and any(self.root.iterdir()):
            raise UserError(f"--out {self.root} is not empty and holds no sampling run; give a new or empty folder")
        self.chunk_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(manifest, json.dumps(workload, indent=2))

    def path(self, chunk: Chunk) -> Path:
        return self.chunk_dir / f"chunk_{chunk.index:06d}.npz"

    def done(self, chunk: Chunk) -> bool:
        return self.path(chunk).is_file()

    def write(self, chunk: Chunk, images: np.ndarray, tokens: np.ndarray, stats: dict[str, Any],
              seconds: float) -> None:
        """Store a finished chunk: images (n, H, W, 3) uint8, tokens (n, T) int64."""
        if len(images) != len(chunk) or len(tokens) != len(chunk):
            raise ValueError(f"chunk {chunk.index}: {len(images)} images / {len(tokens)} token rows for "
                             f"{len(chunk)} indices")
        with atomic_path(self.path(chunk)) as tmp:
            with open(tmp, "wb") as handle:
                np.savez(handle, images=images.astype(np.uint8), tokens=tokens.astype(np.int64),
                         stats=np.array(json.dumps({"stats": stats, "seconds": seconds})))

    def read(self, chunk: Chunk) -> dict[str, Any]:
        with np.load(self.path(chunk), allow_pickle=False) as z:
            return {"images": z["images"], "tokens": z["tokens"], **json.loads(str(z["stats"]))}

    def missing(self, chunks: list[Chunk]) -> list[Chunk]:
        return [c for c in chunks if not self.done(c)]

    def assemble(self, chunks: list[Chunk], labels: list[Any]) -> dict[str, Any]:
        """Write samples.npz / tokens.npy / prompts.txt from the chunks; returns the chunks' stats
        and seconds. Class-conditional runs (int labels) get arr_1."""
        first = self.read(chunks[0])
        n = chunks[-1].stop
        shape = (n, *first["images"].shape[1:])
        per_chunk: list[dict[str, Any]] = []
        tokens: list[np.ndarray] = []

        def images() -> Iterator[np.ndarray]:  # each chunk read once: its images streamed, its tokens kept
            for c in chunks:
                part = self.read(c)
                per_chunk.append({"stats": part["stats"], "seconds": part["seconds"], "images": len(c)})
                tokens.append(part["tokens"])
                yield part["images"]

        class_conditional = all(isinstance(x, int) for x in labels)
        extra = {LABELS: np.asarray(labels, dtype=np.int64)} if class_conditional else {}
        with atomic_path(self.root / SAMPLES_FILE) as tmp:
            write_npz(tmp, shape, images(), extra)
        with atomic_path(self.root / "tokens.npy") as tmp:
            with open(tmp, "wb") as handle:
                np.save(handle, np.concatenate(tokens))
        if not class_conditional:
            atomic_write_text(self.root / "prompts.txt", "\n".join(str(x) for x in labels) + "\n")
        return {"chunks": per_chunk}
