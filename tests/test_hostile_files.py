"""Damaged and hostile files meet one line, never a traceback: every reader of a user's `.npz`,
`.npy` or image folder (eval's image sets and reference, a run's tokens, `runtime sample`'s
chunks on resume) turns each class of damage in tests/hostile_files.py into a `UserError`
naming the file, or, for a chunk, into the reason it is set aside and made again. The same
files through the real commands are in tests/test_sample_eval_faults.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import hostile_files as hostile
from runtime.cli.eval_cmd import read_run
from runtime.utils.errors import UserError
from runtime.metrics.images import open_images
from runtime.generation.sample_store import Chunk, ChunkLayout, SampleStore

pytestmark = pytest.mark.fast

SAVERS = {"stored": np.savez, "deflated": np.savez_compressed}


def _adm(path: Path, save) -> Path:
    images = np.random.default_rng(0).integers(0, 255, (4, 16, 16, 3), dtype=np.uint8)
    save(path, images, np.arange(4), mu=np.zeros(3), sigma=np.eye(3))
    return path


def _read_all(path: Path) -> None:
    images = open_images(path)
    for _ in images.batches(3):
        pass


@pytest.mark.parametrize("saver", SAVERS)
@pytest.mark.parametrize("damage", [*hostile.ZIP_DAMAGES, hostile.broken_deflate], ids=lambda f: f.__name__)
def test_a_damaged_npz_is_one_line_naming_the_file(tmp_path, saver, damage):
    if damage is hostile.broken_deflate and saver == "stored":
        pytest.skip("a stored member has no deflate stream")
    path = _adm(tmp_path / "samples.npz", SAVERS[saver])
    damage(path)
    with pytest.raises(UserError) as refused:
        _read_all(path)
    message = str(refused.value)
    assert str(path) in message and "\n" not in message, message


@pytest.mark.parametrize("saver", SAVERS)
@pytest.mark.parametrize("damage", [*hostile.ZIP_DAMAGES, hostile.broken_deflate], ids=lambda f: f.__name__)
def test_a_damaged_chunk_is_a_reason_to_make_it_again(tmp_path, saver, damage):
    if damage is hostile.broken_deflate and saver == "stored":
        pytest.skip("a stored member has no deflate stream")
    store = SampleStore(tmp_path)
    chunk = Chunk(0, 0, 2)
    path = store.path(chunk)
    path.parent.mkdir(parents=True, exist_ok=True)
    SAVERS[saver](path, images=np.zeros((2, 16, 16, 3), np.uint8), tokens=np.zeros((2, 4), np.int64),
                  stats=np.array(json.dumps({"stats": {}, "seconds": 1.0})))
    layout = ChunkLayout(image_shape=(16, 16, 3), tokens=4)
    assert store.check(chunk, layout) is None
    damage(path)
    reason = store.check(chunk, layout)
    assert reason is not None and "\n" not in reason, reason


@pytest.mark.parametrize("damage", [hostile.npy_header_cut, hostile.huge_shape], ids=lambda f: f.__name__)
def test_a_runs_damaged_tokens_are_one_line(tmp_path, damage):
    np.save(tmp_path / "tokens.npy", np.zeros((2, 16), np.int64))
    (tmp_path / "result.json").write_text(json.dumps({"images": [{"index": 0, "class": 1}, {"index": 1, "class": 2}]}))
    damage(tmp_path / "tokens.npy")
    with pytest.raises(UserError, match="tokens.npy is not a readable .npy array"):
        read_run(tmp_path)


@pytest.mark.parametrize("damage, says", [
    (hostile.png_huge_dimensions, "decompression-bomb limit"),
    (hostile.png_text_bomb, "not a readable image"),
    (hostile.png_profile_bomb, None),  # PIL skips an oversized profile: the image reads, or is refused in one line
    (hostile.png_truncated, "not a readable image"),
], ids=lambda x: getattr(x, "__name__", "")[:20])
def test_a_hostile_image_in_a_folder_is_one_line_naming_it(tmp_path, damage, says):
    (tmp_path / "a.png").write_bytes(hostile.png_bytes())
    damage(tmp_path / "b.png")
    if says is None:
        try:
            _read_all(tmp_path)
        except UserError as err:
            assert "b.png" in str(err)
        return
    with pytest.raises(UserError, match=says) as refused:
        for _ in open_images(tmp_path, size=16).batches(2):
            pass
    assert "b.png" in str(refused.value) and "\n" not in str(refused.value)


def test_a_picture_past_pils_warning_limit_is_refused_not_decoded(tmp_path, monkeypatch):
    """Between PIL's limit and twice it PIL only warns and decodes; here it is a bomb."""
    from PIL import Image

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
    (tmp_path / "a.png").write_bytes(hostile.png_bytes(12, 12))  # 144 pixels: over the limit, under twice it
    (tmp_path / "b.png").write_bytes(hostile.png_bytes(12, 12))
    with pytest.raises(UserError, match="decompression-bomb limit"):
        _read_all(tmp_path)
