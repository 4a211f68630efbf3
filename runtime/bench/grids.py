"""The images a bench made, kept beside its result file so a report can show them.

`runtime bench --out results/x.json` writes `results/x.grids/NN.png`: run NN's images of its
last timed repeat (the first 16, as one grid), NN being the run's index in the file's `runs`.
Every method decodes the same seeds, so the grids of AR and a method compare image by image
(identical with relaxation off and greedy decoding).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Sequence

import numpy as np

GRID_IMAGES = 16  # at most this many images per grid: enough to judge, small enough to embed


def grids_dir(result_path: str | os.PathLike[str]) -> Path:
    return Path(result_path).with_suffix(".grids")


def write_grids(grids: Sequence[tuple[int, np.ndarray]], folder: Path) -> None:
    """Write each (run index, images (n, H, W, 3) uint8) as `NN.png`, replacing `folder` whole."""
    from PIL import Image

    from runtime.utils.atomic import publish_folder, staging_folder
    from runtime.generation.pipeline import image_grid

    if not grids:
        return
    staging = staging_folder(folder)
    try:
        for i, images in grids:
            Image.fromarray(image_grid(images[:GRID_IMAGES])).save(staging / f"{i:02d}.png", optimize=True)
        publish_folder(staging, folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def read_grid(result_path: str | os.PathLike[str], index: int) -> np.ndarray | None:
    """Run `index`'s grid (H, W, 3) uint8, or None where the bench kept none."""
    path = grids_dir(result_path) / f"{index:02d}.png"
    if not path.is_file():
        return None
    from PIL import Image

    return np.asarray(Image.open(path).convert("RGB"))
