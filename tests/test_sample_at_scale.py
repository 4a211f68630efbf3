"""Sampling at scale: ADM's .npz layout written and read in chunks; `runtime sample` sharded,
interrupted and resumed makes the same file as one uninterrupted run."""

from __future__ import annotations

import json
import zipfile

import numpy as np
import pytest

from runtime.utils.errors import UserError
from runtime.metrics.adm import NpzImages, write_npz
from runtime.metrics.images import open_images


def test_streamed_npz_reads_back_as_numpy_writes_it(tmp_path):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (7, 8, 8, 3), dtype=np.uint8)
    labels = np.arange(7) % 3
    write_npz(tmp_path / "s.npz", images.shape, [images[:3], images[3:5], images[5:]], {"arr_1": labels})
    with np.load(tmp_path / "s.npz", allow_pickle=False) as z:
        assert sorted(z.files) == ["arr_0", "arr_1"]
        assert np.array_equal(z["arr_0"], images) and np.array_equal(z["arr_1"], labels)
    read = NpzImages(tmp_path / "s.npz")
    assert len(read) == 7 and np.array_equal(read.labels, labels) and read.stats is None
    batches = list(read.batches(3))
    assert [len(b) for b in batches] == [3, 3, 1] and np.array_equal(np.concatenate(batches), images)


def test_an_adm_reference_batch_written_by_numpy_is_read_with_its_statistics(tmp_path):
    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, (5, 16, 16, 3), dtype=np.uint8)
    mu, sigma = rng.normal(size=4), np.eye(4)
    np.savez(tmp_path / "VIRTUAL_ref.npz", images, mu=mu, sigma=sigma, mu_s=mu, sigma_s=sigma)
    ref = open_images(tmp_path / "VIRTUAL_ref.npz")
    assert len(ref) == 5 and ref.labels is None
    assert np.array_equal(ref.stats[0], mu) and np.array_equal(ref.stats[1], sigma)
    assert np.array_equal(np.concatenate(list(ref.batches(2))), images)


def test_write_npz_refuses_chunks_that_do_not_add_up(tmp_path):
    images = np.zeros((4, 2, 2, 3), dtype=np.uint8)
    with pytest.raises(ValueError, match="chunks held 3 images"):
        write_npz(tmp_path / "s.npz", images.shape, [images[:3]])


@pytest.mark.parametrize("content, message", [
    (b"not a zip", "not a readable .npz"),
    (None, "has no 'arr_0'"),
])
def test_unreadable_npz_files_are_one_line(tmp_path, content, message):
    path = tmp_path / "bad.npz"
    if content is None:
        np.savez(path, other=np.zeros(3))
    else:
        path.write_bytes(content)
    with pytest.raises(UserError, match=message):
        NpzImages(path)


def test_a_truncated_npz_is_named(tmp_path):
    images = np.zeros((4, 8, 8, 3), dtype=np.uint8)
    path = tmp_path / "s.npz"
    write_npz(path, images.shape, [images])
    with zipfile.ZipFile(path) as zf:
        raw = zf.read("arr_0.npy")
    with zipfile.ZipFile(tmp_path / "t.npz", "w") as zf:
        zf.writestr("arr_0.npy", raw[:-100])
    with pytest.raises(UserError, match="truncated"):
        list(NpzImages(tmp_path / "t.npz").batches(2))


SAMPLE = ("sample", "--num-images", "6", "--chunk", "2", "--device", "cpu", "--method", "lantern++",
          "--tree", "chain3", "--seed", "3")


@pytest.mark.slow
def test_a_resumed_two_shard_sampling_run_equals_one_uninterrupted_run(tmp_path, run_cli):
    whole = run_cli(*SAMPLE, "--out", str(tmp_path / "whole"))
    assert whole.exit_code == 0, whole.stderr
    parts = tmp_path / "parts"
    first = run_cli(*SAMPLE, "--out", str(parts), "--shard", "0/2")
    assert first.exit_code == 0 and "2 of 3 chunks done" in first.stdout
    (parts / "chunks" / "chunk_000002.npz").unlink()  # shard 0 was interrupted after its first chunk
    second = run_cli(*SAMPLE, "--out", str(parts), "--shard", "1/2")
    assert second.exit_code == 0 and "2 of 3 chunks done" in second.stdout  # 0 and 1; 2 is lost
    resumed = run_cli(*SAMPLE, "--out", str(parts))
    assert resumed.exit_code == 0, resumed.stderr
    result = json.loads((parts / "result.json").read_text())
    assert result["timing"]["this_invocation"]["images"] == 2  # only the lost chunk was made again
    with np.load(tmp_path / "whole" / "samples.npz") as a, np.load(parts / "samples.npz") as b:
        assert a["arr_0"].shape == (6, 64, 64, 3) and a["arr_0"].dtype == np.uint8
        assert np.array_equal(a["arr_0"], b["arr_0"]) and np.array_equal(a["arr_1"], b["arr_1"])
    assert np.array_equal(np.load(tmp_path / "whole" / "tokens.npy"), np.load(parts / "tokens.npy"))
    # a different workload in the same folder is refused, not mixed in
    other = run_cli(*SAMPLE[:2], "8", *SAMPLE[3:], "--out", str(parts))
    assert other.exit_code == 2 and "other settings" in other.stderr and "num_images" in other.stderr


@pytest.mark.parametrize("argv, message", [
    (("--shard", "2/2"), "need 0 <= I < N"),
    (("--shard", "x"), "expected I/N"),
    (("--chunk", "0"), "--chunk must be >= 1"),
    (("--out", ""), "--out is empty"),
    (("--per-class", "2", "--num-images", "4"), "not both"),
])
def test_sample_refusals(tmp_path, run_cli, argv, message):
    res = run_cli("sample", "--out", str(tmp_path / "s"), "--device", "cpu", *argv)
    assert res.exit_code == 2 and message in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "s").exists()


def test_sample_refuses_a_folder_holding_something_else(tmp_path, run_cli):
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "notes.txt").write_text("mine")
    res = run_cli("sample", "--out", str(tmp_path / "s"), "--device", "cpu", "--num-images", "2")
    assert res.exit_code == 2 and "not empty" in res.stderr
