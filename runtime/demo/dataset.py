"""Procedural, class-conditional 64x64 image dataset for the embedded demo.

Every image is a pure function of `(seed, index)`: sample i draws all of its parameters (class
pattern geometry, colours, pixel noise) from its own `numpy.random.Generator` seeded with
`[seed, i]`, so any slice of the dataset can be re-rendered bit-for-bit without rendering what
comes before it. The label is `index % NUM_CLASSES`, so every run of NUM_CLASSES consecutive
indices holds each class exactly once.

The classes mix shapes (need global coherence), periodic patterns (need long-range
regularity) and textures (need local statistics). Colours come from a jittered palette and
every pixel carries Gaussian noise, so flat regions tokenise to several near-identical codes:
many codebook entries are near-interchangeable, as in natural images, which is what relaxed
speculative acceptance (LANTERN) exploits.

Rendering is vectorised per class over the whole batch; 20k images take a few seconds.
"""

from __future__ import annotations

import hashlib
from typing import Callable, Sequence

import numpy as np

IMAGE_SIZE = 64

CLASS_NAMES: tuple[str, ...] = (
    "circle",
    "square",
    "triangle",
    "cross",
    "horizontal_stripes",
    "vertical_stripes",
    "diagonal_stripes",
    "checkerboard",
    "rings",
    "dots",
    "gradient",
    "blobs",
)
NUM_CLASSES = len(CLASS_NAMES)

# Seeds with fixed roles: training images, held-out validation images, and the real reference
# set that generated images are compared against (`runtime.demo.quality`).
TRAIN_SEED = 0
VAL_SEED = 1
EVAL_SEED = 2

# Well-separated base colours (RGB in [0, 1]); each image jitters the two it draws.
PALETTE = np.array([
    [0.90, 0.15, 0.15],  # red
    [0.95, 0.55, 0.10],  # orange
    [0.95, 0.90, 0.20],  # yellow
    [0.20, 0.75, 0.25],  # green
    [0.15, 0.80, 0.85],  # cyan
    [0.15, 0.30, 0.90],  # blue
    [0.55, 0.20, 0.80],  # purple
    [0.95, 0.45, 0.75],  # pink
    [0.95, 0.95, 0.95],  # white
    [0.10, 0.10, 0.12],  # black
], dtype=np.float32)

COLOUR_JITTER = 0.08
PIXEL_NOISE_STD = (0.005, 0.03)  # per-image std of the additive zero-mean pixel noise
MAX_SHAPE_ROTATION = 20.0  # degrees either side of upright for square, triangle and cross

# Pixel-centre coordinates, y down, x right, in pixels; shared by every renderer.
_YY, _XX = np.meshgrid(np.arange(IMAGE_SIZE, dtype=np.float32) + 0.5,
                       np.arange(IMAGE_SIZE, dtype=np.float32) + 0.5, indexing="ij")

# Number of uniform parameters each sample draws; renderers interpret them per class.
_N_PARAMS = 8
# Low-resolution grid of the value-noise texture ("blobs").
_BLOB_GRID = 6


def _coverage(signed_distance: np.ndarray) -> np.ndarray:
    """Anti-aliased inside-coverage in [0, 1] from a signed distance in pixels (< 0 inside)."""
    return np.clip(0.5 - signed_distance, 0.0, 1.0)


def _square_wave(phase: np.ndarray, period: np.ndarray) -> np.ndarray:
    """A ~1px anti-aliased square wave in [0, 1] of a phase in radians (period in pixels)."""
    return np.clip(0.5 + np.cos(phase) * (period / (2 * np.pi)), 0.0, 1.0)


def _rotated(angle: np.ndarray, cx: np.ndarray, cy: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pixel coordinates (N, H, W) in a frame centred at (cx, cy) and rotated by `angle`."""
    dx = _XX[None] - cx[:, None, None]
    dy = _YY[None] - cy[:, None, None]
    c = np.cos(angle)[:, None, None]
    s = np.sin(angle)[:, None, None]
    return c * dx + s * dy, -s * dx + c * dy


def _pick(u: np.ndarray, values: Sequence[float]) -> np.ndarray:
    """One of `values` per sample from uniforms u (N,): (N,) float32."""
    table = np.asarray(values, dtype=np.float32)
    return table[np.minimum((u * len(table)).astype(np.int64), len(table) - 1)]


def _shape_frame(u: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Centre, size and rotation (within +-MAX_SHAPE_ROTATION of upright) of a shape from
    uniforms u (N, _N_PARAMS)."""
    size = 12.0 + 10.0 * u[:, 0]
    margin = size + 2.0
    cx = margin + (IMAGE_SIZE - 2 * margin) * u[:, 1]
    cy = margin + (IMAGE_SIZE - 2 * margin) * u[:, 2]
    angle = np.float32(np.deg2rad(MAX_SHAPE_ROTATION)) * (2 * u[:, 3] - 1)
    return cx, cy, size, angle


def _circle(u: np.ndarray, noise: np.ndarray) -> np.ndarray:
    cx, cy, size, _ = _shape_frame(u)
    r = np.hypot(_XX[None] - cx[:, None, None], _YY[None] - cy[:, None, None])
    return _coverage(r - size[:, None, None])


def _square(u: np.ndarray, noise: np.ndarray) -> np.ndarray:
    cx, cy, size, angle = _shape_frame(u)
    x, y = _rotated(angle, cx, cy)
    half = 0.8 * size[:, None, None]
    return _coverage(np.maximum(np.abs(x), np.abs(y)) - half)


def _triangle(u: np.ndarray, noise: np.ndarray) -> np.ndarray:
    cx, cy, size, angle = _shape_frame(u)
    x, y = _rotated(angle, cx, cy)
    # Equilateral triangle with circumradius `size`: inside when every edge-normal
    # projection is below the inradius size / 2.
    d = None
    for k in range(3):
        a = np.pi / 2 + k * 2 * np.pi / 3
        proj = float(np.cos(a)) * x + float(np.sin(a)) * y
        d = proj if d is None else np.maximum(d, proj)
    return _coverage(d - 0.5 * size[:, None, None])


def _cross(u: np.ndarray, noise: np.ndarray) -> np.ndarray:
    cx, cy, size, angle = _shape_frame(u)
    x, y = _rotated(angle, cx, cy)
    arm = size[:, None, None]
    width = (0.25 + 0.1 * u[:, 4])[:, None, None] * arm
    bar_h = np.maximum(np.abs(x) - arm, np.abs(y) - width)
    bar_v = np.maximum(np.abs(x) - width, np.abs(y) - arm)
    return _coverage(np.minimum(bar_h, bar_v))


def _stripes(base_angle: Callable[[np.ndarray], np.ndarray],
             periods: Sequence[float]) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    def render(u: np.ndarray, noise: np.ndarray) -> np.ndarray:
        angle = base_angle(u)
        period = _pick(u[:, 1], periods)
        phase0 = 2 * np.pi * u[:, 2]
        x, y = _rotated(angle, np.zeros_like(angle), np.zeros_like(angle))
        p = period[:, None, None]
        return _square_wave(2 * np.pi * y / p + phase0[:, None, None], p)
    return render


def _checkerboard(u: np.ndarray, noise: np.ndarray) -> np.ndarray:
    angle = np.zeros(len(u), dtype=np.float32)
    period = 2 * _pick(u[:, 1], (8.0, 12.0, 16.0))[:, None, None]  # cells of 2, 3 or 4 tokens
    x, y = _rotated(angle, IMAGE_SIZE * u[:, 2], IMAGE_SIZE * u[:, 3])
    wave = np.cos(2 * np.pi * x / period) * np.cos(2 * np.pi * y / period)
    # The product of two cosines crosses zero with slope ~ 2*pi/period (times the other factor);
    # the gain keeps edges about a pixel wide away from the cell corners.
    return np.clip(0.5 + wave * (period / (2 * np.pi)), 0.0, 1.0)


def _rings(u: np.ndarray, noise: np.ndarray) -> np.ndarray:
    cx = IMAGE_SIZE * (0.25 + 0.5 * u[:, 0])
    cy = IMAGE_SIZE * (0.25 + 0.5 * u[:, 1])
    period = _pick(u[:, 2], (8.0, 12.0))[:, None, None]
    r = np.hypot(_XX[None] - cx[:, None, None], _YY[None] - cy[:, None, None])
    return _square_wave(2 * np.pi * r / period + 2 * np.pi * u[:, 3][:, None, None], period)


def _dots(u: np.ndarray, noise: np.ndarray) -> np.ndarray:
    angle = np.zeros(len(u), dtype=np.float32)
    period = _pick(u[:, 1], (12.0, 16.0))[:, None, None]
    radius = (0.22 + 0.12 * u[:, 4])[:, None, None] * period
    x, y = _rotated(angle, IMAGE_SIZE * u[:, 2], IMAGE_SIZE * u[:, 3])
    dx = np.mod(x, period) - period / 2
    dy = np.mod(y, period) - period / 2
    return _coverage(np.hypot(dx, dy) - radius)


def _gradient(u: np.ndarray, noise: np.ndarray) -> np.ndarray:
    angle = 2 * np.pi * u[:, 0]
    x, _ = _rotated(angle, np.full_like(angle, IMAGE_SIZE / 2), np.full_like(angle, IMAGE_SIZE / 2))
    width = (IMAGE_SIZE * (0.8 + 0.6 * u[:, 1]))[:, None, None]
    return np.clip(0.5 + x / width, 0.0, 1.0)


def _blobs(u: np.ndarray, noise: np.ndarray) -> np.ndarray:
    """Smooth value noise: a random coarse grid, bilinearly upsampled, softly thresholded."""
    coarse = noise  # (N, _BLOB_GRID, _BLOB_GRID) uniforms
    pos = (np.arange(IMAGE_SIZE, dtype=np.float32) + 0.5) / IMAGE_SIZE * (_BLOB_GRID - 1)
    i0 = np.floor(pos).astype(np.int64).clip(0, _BLOB_GRID - 2)
    t = (pos - i0).astype(np.float32)
    t = t * t * (3 - 2 * t)  # smoothstep, so the grid does not show as creases
    rows = coarse[:, i0, :] * (1 - t)[None, :, None] + coarse[:, i0 + 1, :] * t[None, :, None]
    field = rows[:, :, i0] * (1 - t)[None, None, :] + rows[:, :, i0 + 1] * t[None, None, :]
    sharp = (4.0 + 6.0 * u[:, 0])[:, None, None]
    return np.clip(0.5 + (field - 0.5) * sharp, 0.0, 1.0)


_RENDERERS: tuple[Callable[[np.ndarray, np.ndarray], np.ndarray], ...] = (
    _circle,
    _square,
    _triangle,
    _cross,
    # Periods are whole numbers of 4-pixel tokens along the grid (the diagonal ones along x),
    # so a stripe pattern repeats exactly in token space.
    _stripes(lambda u: np.zeros(len(u), dtype=np.float32), (8.0, 12.0, 16.0)),  # phase varies along y
    _stripes(lambda u: np.full(len(u), np.pi / 2, dtype=np.float32), (8.0, 12.0, 16.0)),
    _stripes(lambda u: np.where(u[:, 3] < 0.5, np.float32(np.pi / 4), np.float32(3 * np.pi / 4)),
             (12.0 / np.sqrt(2.0), 16.0 / np.sqrt(2.0))),
    _checkerboard,
    _rings,
    _dots,
    _gradient,
    _blobs,
)
assert len(_RENDERERS) == NUM_CLASSES


def labels_for(indices: Sequence[int] | np.ndarray) -> np.ndarray:
    """Class label of each sample index: index % NUM_CLASSES, (N,) int64."""
    return np.asarray(indices, dtype=np.int64) % NUM_CLASSES


def make_images(seed: int, indices: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Render samples `indices` of the dataset with `seed`.

    Returns (images uint8 (N, 64, 64, 3) HWC RGB, labels int64 (N,)). Sample i depends only
    on (seed, i): it is identical whichever other indices are rendered with it.
    """
    idx = np.asarray(indices, dtype=np.int64).reshape(-1)
    if idx.size and idx.min() < 0:
        raise ValueError("make_images: sample indices must be >= 0")
    images = np.empty((idx.size, IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8)
    for start in range(0, idx.size, _CHUNK):
        images[start:start + _CHUNK] = _render_chunk(int(seed), idx[start:start + _CHUNK])
    return images, labels_for(idx)


# Images rendered together; bounds the float32 working set (~50 MB per 1024 images).
_CHUNK = 1024


def _render_chunk(seed: int, idx: np.ndarray) -> np.ndarray:
    n = idx.size
    labels = labels_for(idx)
    params = np.empty((n, _N_PARAMS), dtype=np.float32)
    coarse = np.empty((n, _BLOB_GRID, _BLOB_GRID), dtype=np.float32)
    colours = np.empty((n, 2, 3), dtype=np.float32)
    noise = np.empty((n, IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.float32)
    for j, i in enumerate(idx.tolist()):
        rng = np.random.default_rng([seed, i])
        params[j] = rng.random(_N_PARAMS, dtype=np.float32)
        coarse[j] = rng.random((_BLOB_GRID, _BLOB_GRID), dtype=np.float32)
        fg, bg = rng.choice(len(PALETTE), size=2, replace=False)
        jitter = rng.uniform(-COLOUR_JITTER, COLOUR_JITTER, size=(2, 3)).astype(np.float32)
        colours[j] = np.stack([PALETTE[fg], PALETTE[bg]]) + jitter
        std = np.float32(rng.uniform(*PIXEL_NOISE_STD))
        # Zero-mean uniform pixel noise with standard deviation `std` (uniform: 4x cheaper
        # to draw than Gaussian, and just as good at making codes near-interchangeable).
        rng.random(dtype=np.float32, out=noise[j])
        noise[j] -= 0.5
        noise[j] *= std * np.float32(2 * np.sqrt(3.0))

    for c in range(NUM_CLASSES):
        sel = np.nonzero(labels == c)[0]
        if sel.size == 0:
            continue
        mask = _RENDERERS[c](params[sel], coarse[sel]).astype(np.float32, copy=False)[..., None]
        fg = colours[sel, 0][:, None, None, :]
        bg = colours[sel, 1][:, None, None, :]
        noise[sel] += bg + mask * (fg - bg)
    noise *= 255.0
    np.rint(noise, out=noise)
    np.clip(noise, 0, 255, out=noise)
    return noise.astype(np.uint8)


def to_tensor_range(images: np.ndarray) -> np.ndarray:
    """uint8 (N, H, W, 3) -> float32 (N, 3, H, W) in [-1, 1], the VQ's input convention."""
    return (images.astype(np.float32).transpose(0, 3, 1, 2) / 127.5) - 1.0


def from_tensor_range(x: np.ndarray) -> np.ndarray:
    """float (N, 3, H, W) in [-1, 1] -> uint8 (N, H, W, 3), as LlamaGen post-processes."""
    return np.clip(np.rint(x.transpose(0, 2, 3, 1) * 127.5 + 127.5), 0, 255).astype(np.uint8)


def dataset_hash(seed: int, n: int) -> str:
    """sha256 (hex) over the canonical render of samples 0..n-1: labels then image bytes."""
    h = hashlib.sha256()
    h.update(f"demo-dataset:v1:{IMAGE_SIZE}:{NUM_CLASSES}:{seed}:{n}".encode())
    chunk = 4096
    for start in range(0, n, chunk):
        images, labels = make_images(seed, np.arange(start, min(n, start + chunk)))
        h.update(labels.astype("<i8").tobytes())
        h.update(np.ascontiguousarray(images).tobytes())
    return h.hexdigest()
