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

A chunk on disk is trusted only once checked against the workload (`verify`): readable, no
object arrays, as many images as its indices, the model's image size and token count. A chunk
that fails (truncated by a full disk on another host, edited, written by other code) is moved to
`damaged/` and counts as missing, so the next run makes it again instead of failing on it
forever. Temporary files that a killed process left in the folder are swept when it is opened.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from runtime.utils.atomic import atomic_path, atomic_write_text, sweep_stale
from runtime.utils.errors import FILE_FAULTS, UserError
from runtime.metrics.adm import LABELS, write_npz
from runtime.metrics.images import SAMPLES_FILE

MANIFEST = "manifest.json"
CHUNKS = "chunks"
DAMAGED = "damaged"


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


@dataclass(frozen=True)
class ChunkLayout:
    """What a chunk holds per image: `image_shape` (H, W, 3) uint8 pixels and `tokens` integer ids."""

    image_shape: tuple[int, int, int]
    tokens: int


@dataclass(frozen=True)
class Damaged:
    """A chunk file that failed `verify`: why, and where it was moved."""

    chunk: Chunk
    reason: str
    moved_to: Path


class SampleStore:
    """The chunk folder of one sampling run at `root`."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.chunk_dir = self.root / CHUNKS
        self._verified: dict[int, tuple[int, int]] = {}  # chunk index -> (size, mtime_ns) found sound

    def open(self, workload: dict[str, Any]) -> None:
        """Create the folder for `workload`, or check that an existing one holds the same workload
        (and sweep the temporary files killed processes left in it)."""
        manifest = self.root / MANIFEST
        if manifest.is_file():
            for folder in (self.root, self.chunk_dir):
                sweep_stale(folder)
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
        self._remember(chunk)

    def read(self, chunk: Chunk) -> dict[str, Any]:
        with np.load(self.path(chunk), allow_pickle=False) as z:
            return {"images": z["images"], "tokens": z["tokens"], **json.loads(str(z["stats"]))}

    def missing(self, chunks: list[Chunk]) -> list[Chunk]:
        return [c for c in chunks if not self.done(c)]

    def verify(self, chunks: list[Chunk], layout: ChunkLayout) -> list[Damaged]:
        """Check every present chunk of `chunks` against `layout` (each file read once per
        process, unless it changed); move the damaged ones to `damaged/`, so they count as missing."""
        damaged = []
        for c in chunks:
            if not self.done(c) or self._verified.get(c.index) == self._stamp(c):
                continue
            reason = self.check(c, layout)
            if reason is None:
                self._remember(c)
            else:
                damaged.append(Damaged(c, reason, self._set_aside(c)))
        return damaged

    def check(self, chunk: Chunk, layout: ChunkLayout) -> str | None:
        """Why the file of `chunk` cannot be used (None when it can)."""
        n = len(chunk)
        try:
            part = self.read(chunk)
            stats = part["stats"]
            float(part["seconds"])
        except FILE_FAULTS as err:
            text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            if "allow_pickle" in text:
                return "it holds an object array (pickled Python objects), which is never loaded"
            return f"not a readable .npz: {type(err).__name__}: {text}"
        except TypeError:
            return "its stats record is not a chunk's"
        images, tokens = part["images"], part["tokens"]
        if images.dtype != np.uint8 or images.shape[1:] != layout.image_shape:
            shape = "x".join(str(s) for s in images.shape[1:])
            want = "x".join(str(s) for s in layout.image_shape)
            return f"its images are {images.dtype} {shape}, this run makes uint8 {want}"
        if len(images) != n:
            return f"it holds {len(images)} images, the manifest gives it {n}"
        if not np.issubdtype(tokens.dtype, np.integer) or tokens.shape != (n, layout.tokens):
            return f"its tokens are {tokens.dtype} {tokens.shape}, expected ({n}, {layout.tokens}) integers"
        if not isinstance(stats, dict):
            return "its stats record is not a chunk's"
        return None

    def _stamp(self, chunk: Chunk) -> tuple[int, int]:
        st = self.path(chunk).stat()
        return st.st_size, st.st_mtime_ns

    def _remember(self, chunk: Chunk) -> None:
        self._verified[chunk.index] = self._stamp(chunk)

    def _set_aside(self, chunk: Chunk) -> Path:
        folder = self.root / DAMAGED
        folder.mkdir(exist_ok=True)
        target = folder / self.path(chunk).name
        k = 1
        while target.exists():
            target = folder / f"{self.path(chunk).stem}.{k}.npz"
            k += 1
        try:
            self.path(chunk).replace(target)
        except FileNotFoundError:  # a job sampling into the same folder moved it first
            pass
        self._verified.pop(chunk.index, None)
        return target

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
