"""Image sets that quality metrics read: a `runtime run` folder, a `runtime sample` folder or
ADM-layout `.npz`, or a plain folder of image files.

Every set yields uint8 batches (n, H, W, 3) in a fixed order, so set A's image i and set B's
image i are the same seed and condition when both are runs of one workload (what paired
intervals rely on). `labels` / `prompts` are the conditions where the set records them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import numpy as np

from runtime.utils.errors import FILE_FAULTS, UserError
from runtime.metrics.adm import NpzImages

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
SAMPLES_FILE = "samples.npz"


class ImageSet(Protocol):
    """uint8 RGB images read in order, with their conditions where known."""

    path: Path
    labels: np.ndarray | None
    prompts: list[str] | None
    stats: tuple[np.ndarray, np.ndarray] | None  # precomputed pool_3 (mu, sigma): ADM reference batches

    def __len__(self) -> int: ...

    def batches(self, size: int) -> Iterator[np.ndarray]: ...


class FileImages:
    """Image files read in a given order; every image is brought to `size` x `size` (centre crop
    to a square, then bicubic resize) when `size` is given, else all must share one size."""

    stats = None

    def __init__(self, path: Path, files: list[Path], labels: np.ndarray | None = None,
                 prompts: list[str] | None = None, size: int | None = None) -> None:
        if not files:
            raise UserError(f"{path}: no images ({', '.join(IMAGE_SUFFIXES)}) found")
        self.path, self.files, self.labels, self.prompts, self.size = path, files, labels, prompts, size

    def __len__(self) -> int:
        return len(self.files)

    def batches(self, size: int) -> Iterator[np.ndarray]:
        shape = None
        for start in range(0, len(self.files), size):
            batch = [self._read(f) for f in self.files[start:start + size]]
            for f, image in zip(self.files[start:start + size], batch):
                shape = shape or image.shape
                if image.shape != shape:
                    raise UserError(f"{f} is {image.shape[1]}x{image.shape[0]} but earlier images are "
                                    f"{shape[1]}x{shape[0]}; give images of one size (or let eval resize "
                                    "a reference folder to the generated size)")
            yield np.stack(batch)

    def _read(self, file: Path) -> np.ndarray:
        """One image as uint8 (H, W, 3). A damaged or hostile file (a decompression bomb: more
        pixels than PIL's limit, or a text / profile chunk that inflates past its own) is one line."""
        import warnings

        from PIL import Image

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                return self._decode(file)
        except (Image.DecompressionBombError, Image.DecompressionBombWarning):
            raise UserError(f"{file} has more pixels than PIL's decompression-bomb limit ({Image.MAX_IMAGE_PIXELS} "
                            "pixels), which could exhaust memory; give images of at most that size") from None
        except FILE_FAULTS as err:
            text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise UserError(f"{file} is not a readable image ({text[:160]}); replace or remove it") from None

    def _decode(self, file: Path) -> np.ndarray:
        from PIL import Image

        with Image.open(file) as im:
            im = im.convert("RGB")
            if self.size is not None:
                w, h = im.size
                side = min(w, h)
                left, top = (w - side) // 2, (h - side) // 2
                im = im.crop((left, top, left + side, top + side)).resize((self.size, self.size),
                                                                          Image.Resampling.BICUBIC)
            return np.asarray(im, dtype=np.uint8)


def open_images(path: str | Path, *, size: int | None = None) -> ImageSet:
    """The image set at `path` (see the module docstring); `size` resizes a plain folder's images."""
    path = Path(path)
    if path.is_file():
        if path.suffix != ".npz":
            raise UserError(f"{path}: expected a run folder, a folder of images or an ADM-layout .npz")
        return NpzImages(path)
    if not path.is_dir():
        raise UserError(f"{path} not found; give a run folder, a folder of images or an ADM-layout .npz")
    if (path / SAMPLES_FILE).is_file():
        images = NpzImages(path / SAMPLES_FILE)
        images.prompts = _recorded_prompts(path)
        return images
    if (path / "result.json").is_file():
        return _run_folder(path)
    files = sorted(f for f in path.iterdir() if f.suffix.lower() in IMAGE_SUFFIXES)
    return FileImages(path, files, size=size)


def _recorded_prompts(folder: Path) -> list[str] | None:
    file = folder / "prompts.txt"
    return file.read_text(encoding="utf-8").splitlines() if file.is_file() else None


def _run_folder(folder: Path) -> FileImages:
    """A `runtime run` folder: its images in index order, with their classes or prompts."""
    try:
        result = json.loads((folder / "result.json").read_text(encoding="utf-8"))
        records = sorted(result["images"], key=lambda r: r["index"])
        files = [folder / r["file"] for r in records]
    except (ValueError, KeyError, TypeError, AttributeError):
        raise UserError(f"{folder / 'result.json'} is not a 'runtime run' result (no 'images' records "
                        "with 'index' and 'file')") from None
    if [r["index"] for r in records] != list(range(len(records))):
        raise UserError(f"{folder / 'result.json'}: image indices are not 0..{len(records) - 1}")
    inside = folder.resolve()
    for record, file in zip(records, files):
        if not file.resolve().is_relative_to(inside):  # an absolute path, '..', or a link out of the run
            raise UserError(f"{folder / 'result.json'}: image file {record['file']!r} lies outside the run folder; "
                            "a run's images are files inside its folder (regenerate the run)")
    missing = [f for f in files if not f.is_file()]
    if missing:
        raise UserError(f"{missing[0]} is listed in result.json but missing; regenerate the run")
    labels = np.array([r["class"] for r in records]) if all("class" in r for r in records) else None
    prompts = [r["prompt"] for r in records] if all("prompt" in r for r in records) else None
    return FileImages(folder, files, labels=labels, prompts=prompts)
