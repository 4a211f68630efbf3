"""ADM's sample-batch layout: an `.npz` whose `arr_0` holds uint8 images (N, H, W, 3) and, for
class-conditional samples, `arr_1` the labels (N,) int64.

This is the layout of ADM's `VIRTUAL_imagenet256_labeled.npz` reference batch (which also holds
`mu` / `sigma`, the pool_3 Gaussian of its images, and `mu_s` / `sigma_s`, spatial features) and
of the sample files ADM's and LlamaGen's evaluators read. 50,000 images at 256 px are 9.8 GB, so
both directions stream: `write_npz` writes each array's `.npy` member chunk by chunk, and
`NpzImages` reads `arr_0` batch by batch; neither holds more than one chunk in memory.
"""

from __future__ import annotations

import zipfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from runtime.utils.errors import FILE_FAULTS, UserError

IMAGES, LABELS = "arr_0", "arr_1"


def damaged(path: Path, err: BaseException, member: str | None = None) -> UserError:
    """One line naming a damaged archive (and member) with what the reader met."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    where = f"{path}: '{member}'" if member else str(path)
    return UserError(f"{where} cannot be read ({type(err).__name__}{': ' + text[:120] if text else ''}); the file "
                     "is damaged or not an uncompressed/deflated .npz: write it again (np.savez) or regenerate it")


def write_npz(path: Path, shape: tuple[int, ...], chunks: Iterable[np.ndarray],
              extra: dict[str, np.ndarray] | None = None) -> None:
    """Write an uncompressed `.npz` whose `arr_0` (uint8, `shape`) is the concatenation of
    `chunks` (each (n_i, *shape[1:]) uint8, n_i summing to shape[0]), plus the small `extra`
    arrays. `np.load(path)` reads it as if `np.savez` had written it."""
    expected = int(np.prod(shape[1:], dtype=np.int64))
    written = 0
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        with zf.open(f"{IMAGES}.npy", "w", force_zip64=True) as member:
            header = {"descr": np.lib.format.dtype_to_descr(np.dtype(np.uint8)), "fortran_order": False,
                      "shape": tuple(int(s) for s in shape)}
            np.lib.format.write_array_header_2_0(member, header)
            for chunk in chunks:
                chunk = np.ascontiguousarray(chunk, dtype=np.uint8)
                if chunk.ndim != len(shape) or chunk[0].size != expected:
                    raise ValueError(f"write_npz: chunk of shape {chunk.shape} does not fit {shape}")
                member.write(chunk.tobytes())
                written += len(chunk)
        if written != shape[0]:
            raise ValueError(f"write_npz: chunks held {written} images, the header says {shape[0]}")
        for name, array in (extra or {}).items():
            with zf.open(f"{name}.npy", "w", force_zip64=True) as member:
                np.lib.format.write_array(member, np.asarray(array), allow_pickle=False)


class NpzImages:
    """The uint8 images (N, H, W, 3) in `arr_0` of an ADM-layout `.npz`, read in batches.

    `labels` is `arr_1` when present; `stats` the precomputed Inception pool_3 Gaussian
    (`mu`, `sigma`) of a reference batch when present, else None.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.prompts: list[str] | None = None
        try:
            self._zip = zipfile.ZipFile(self.path)
        except FILE_FAULTS as err:
            raise UserError(f"{self.path} is not a readable .npz file ({err})") from None
        names = set(self._zip.namelist())
        if f"{IMAGES}.npy" not in names:
            raise UserError(f"{self.path} has no '{IMAGES}' array; an ADM-layout .npz holds the images "
                            f"(N, H, W, 3) uint8 in '{IMAGES}'")
        try:
            with self._zip.open(f"{IMAGES}.npy") as member:
                self.shape, dtype = _read_header(member, self.path)
        except FILE_FAULTS as err:
            raise damaged(self.path, err, IMAGES) from None
        if dtype != np.uint8 or len(self.shape) != 4 or self.shape[3] != 3:
            raise UserError(f"{self.path}: '{IMAGES}' is {dtype} {self.shape}; expected uint8 images (N, H, W, 3)")
        if self.shape[0] == 0:
            raise UserError(f"{self.path}: '{IMAGES}' holds no images; give a file with the images to measure")
        small = {name: self._small(name) for name in (LABELS, "mu", "sigma") if f"{name}.npy" in names}
        self.labels = small.get(LABELS)
        if self.labels is not None and (self.labels.shape != (len(self),)
                                        or not np.issubdtype(self.labels.dtype, np.integer)):
            raise UserError(f"{self.path}: '{LABELS}' is {self.labels.dtype} {self.labels.shape}; expected one "
                            f"integer label per image ({len(self)},)")
        self.stats = _gaussian(self.path, small["mu"], small["sigma"]) if "mu" in small and "sigma" in small else None

    def _small(self, name: str) -> np.ndarray:
        """A small member array; object arrays (pickled Python objects) are refused, never loaded."""
        try:
            with self._zip.open(f"{name}.npy") as member:
                return np.lib.format.read_array(member, allow_pickle=False)
        except ValueError as err:
            if "allow_pickle" in str(err):
                raise UserError(f"{self.path}: '{name}' is an object array (pickled Python objects), which is "
                                "never loaded; write it as a numeric array (np.savez does for numbers)") from None
            raise UserError(f"{self.path}: '{name}' is not a .npy array ({err})") from None
        except FILE_FAULTS as err:
            raise damaged(self.path, err, name) from None

    def __len__(self) -> int:
        return int(self.shape[0])

    def batches(self, size: int) -> Iterator[np.ndarray]:
        """Consecutive (<= size, H, W, 3) uint8 batches covering all images in order."""
        per_image = int(np.prod(self.shape[1:]))
        try:
            with self._zip.open(f"{IMAGES}.npy") as member:
                _read_header(member, self.path)
                for start in range(0, len(self), size):
                    n = min(size, len(self) - start)
                    raw = member.read(n * per_image)
                    if len(raw) != n * per_image:
                        raise UserError(f"{self.path}: '{IMAGES}' ends after {start} images; the file is truncated")
                    yield np.frombuffer(bytearray(raw), dtype=np.uint8).reshape((n, *self.shape[1:]))
        except FILE_FAULTS as err:
            raise damaged(self.path, err, IMAGES) from None


def _gaussian(path: Path, mu: np.ndarray, sigma: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A reference batch's precomputed (mu (F,), sigma (F, F)), checked: float, matching, finite."""
    floats = np.issubdtype(mu.dtype, np.floating) and np.issubdtype(sigma.dtype, np.floating)
    if not floats or mu.ndim != 1 or sigma.shape != (len(mu), len(mu)):
        raise UserError(f"{path}: 'mu' {mu.dtype} {mu.shape} and 'sigma' {sigma.dtype} {sigma.shape} are not a "
                        "Gaussian (mu (F,), sigma (F, F), floats); rebuild the reference batch")
    if not (np.isfinite(mu).all() and np.isfinite(sigma).all()):
        raise UserError(f"{path}: 'mu' or 'sigma' holds NaN or infinite values; the reference batch is broken "
                        "(re-download or recompute it)")
    return mu.astype(np.float64), sigma.astype(np.float64)


def _read_header(member, path: Path) -> tuple[tuple[int, ...], np.dtype]:
    try:
        major, _ = np.lib.format.read_magic(member)
        read = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = read(member)
    except ValueError as err:
        raise UserError(f"{path}: '{IMAGES}' is not a .npy array ({err})") from None
    if fortran:
        raise UserError(f"{path}: '{IMAGES}' is Fortran-ordered; write it C-ordered (np.savez does)")
    return tuple(int(s) for s in shape), np.dtype(dtype)
