"""`runtime sample` and `runtime eval` under bad files and failing disks, through real processes.

Each case checks the exit code, that stderr is one `error:` line (or one `warning:` line per
damaged chunk) with no traceback, and what is left on disk. A sampling folder resumed after a
fault (a file-size limit, a full disk, a damaged chunk) must equal an uninterrupted run. Faults
that need root to stage for real (a full or read-only file system) are raised at the system call
inside the real process; the file-size limit is real (RLIMIT_FSIZE, as `ulimit -f` sets it).
"""

from __future__ import annotations

import errno
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import hostile_files as hostile

RUNTIME = [sys.executable, "-m", "runtime"]
SAMPLE = ["sample", "--num-images", "4", "--chunk", "2", "--device", "cpu", "--method", "ar", "--seed", "3"]
ENV = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="200")


def cli(*argv: str, file_limit: int | None = None, patch: str = "",
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`runtime ARGV` in a new process; `file_limit` bytes caps every file it writes (ulimit -f);
    `patch` is Python run first inside that process (to raise a fault at a system call)."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_limit, file_limit))

    command = RUNTIME + list(argv)
    if patch:
        command = [sys.executable, "-c", f"{patch}\nfrom runtime.cli.app import main\nmain({list(argv)!r})"]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, env=env or ENV,
                          preexec_fn=limit if file_limit is not None else None)


def refused(proc: subprocess.CompletedProcess[str], *words: str) -> str:
    """Exit 2 and one `error:` line carrying every word; returns the line."""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (proc.returncode, proc.stderr)
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


def same_samples(a: Path, b: Path) -> None:
    with np.load(a / "samples.npz") as x, np.load(b / "samples.npz") as y:
        assert x["arr_0"].shape == (4, 64, 64, 3)
        assert np.array_equal(x["arr_0"], y["arr_0"]) and np.array_equal(x["arr_1"], y["arr_1"])
    assert np.array_equal(np.load(a / "tokens.npy"), np.load(b / "tokens.npy"))


def no_leftovers(folder: Path) -> None:
    """No temporary file or staging folder anywhere under `folder`."""
    hidden = [p for p in folder.rglob(".*")]
    assert hidden == [], hidden


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> Path:
    """One uninterrupted sampling run: 4 demo images in 2 chunks."""
    out = tmp_path_factory.mktemp("whole") / "s"
    proc = cli(*SAMPLE, "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    return out


def partial_copy(whole: Path, dest: Path) -> Path:
    """`whole` as an interrupted run leaves it: manifest and chunks, nothing assembled."""
    shutil.copytree(whole, dest)
    for name in ("samples.npz", "tokens.npy", "result.json"):
        (dest / name).unlink()
    return dest


# --- runtime sample: where --out goes -------------------------------------------------------------

def test_sample_out_naming_a_file_is_one_line_and_the_file_is_kept(tmp_path):
    out = tmp_path / "notes.txt"
    out.write_text("mine")
    refused(cli(*SAMPLE, "--out", str(out)), "exists and is not a folder")
    assert out.read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_sample_out_on_a_read_only_file_system_is_one_line_before_any_work(tmp_path):
    patch = ("import errno, os, tempfile\n"
             "def read_only(*a, dir=None, **k):\n"
             "    raise OSError(errno.EROFS, os.strerror(errno.EROFS), dir)\n"
             "tempfile.mkstemp = read_only\n")
    out = tmp_path / "s"
    line = refused(cli(*SAMPLE, "--out", str(out), patch=patch), f"cannot write --out {out}",
                   os.strerror(errno.EROFS), "choose a writable location")
    assert "Traceback" not in line and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("limit, stage", [(10_000, "first chunk"), (40_000, "assembly")])
def test_a_file_size_limit_is_one_line_and_the_resumed_folder_equals_an_uninterrupted_run(whole, tmp_path, limit,
                                                                                          stage):
    out = tmp_path / "s"
    refused(cli(*SAMPLE, "--out", str(out), file_limit=limit), f"cannot write --out {out}", os.strerror(errno.EFBIG),
            "ulimit -f", "run the same command again")
    chunks = sorted(p.name for p in (out / "chunks").iterdir())
    # a chunk is ~30 kB, the assembled file ~74 kB: the first limit stops the first chunk, the second the assembly
    assert chunks == ([] if stage == "first chunk" else ["chunk_000000.npz", "chunk_000001.npz"])
    assert not (out / "samples.npz").exists()
    no_leftovers(out)
    resumed = cli(*SAMPLE, "--out", str(out))
    assert resumed.returncode == 0 and resumed.stderr.strip() == "", resumed.stderr
    same_samples(whole, out)
    made = json.loads((out / "result.json").read_text())["timing"]["this_invocation"]["images"]
    assert made == (4 if stage == "first chunk" else 0)


def test_graph_mode_that_cannot_write_its_kernels_is_one_line_naming_the_fix(tmp_path):
    """Compiling the steps writes kernels to the compile cache; a file size limit there is one
    line (exit 2) naming the limit and --no-graph, never the compiler's traceback."""
    env = dict(ENV, LANTERN_GRAPH="1", LANTERN_RUNTIME_CACHE=str(tmp_path / "cache"))
    out = tmp_path / "s"
    refused(cli(*SAMPLE, "--out", str(out), file_limit=10_000, env=env), "graph mode: compiling step",
            "could not write its kernels", os.strerror(errno.EFBIG), "ulimit -f", "--no-graph")


def test_a_compile_cache_that_lost_its_kernels_under_a_file_limit_is_still_one_line(tmp_path):
    """A compile cache whose graphs are kept but whose kernels are gone (a cleaner took them)
    rebuilds them while loading a graph, where inductor logs an error of its own before raising:
    still one line. The environment carries inductor's default cache variable, as a process
    started by one that compiled anything inherits it: the runtime's cache is still the one used."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    cache = tmp_path / "cache"
    env = dict(ENV, LANTERN_GRAPH="1", LANTERN_RUNTIME_CACHE=str(cache), TORCHINDUCTOR_CACHE_DIR=default_cache_dir())
    first = cli(*SAMPLE, "--out", str(tmp_path / "first"), env=env)
    assert first.returncode == 0, first.stderr
    kernels = list((cache / "compile").rglob("*.so"))
    assert kernels, "the steps compiled somewhere other than the runtime's cache"
    for kernel in kernels:
        kernel.unlink()
    line = refused(cli(*SAMPLE, "--out", str(tmp_path / "s"), file_limit=10_000, env=env),
                   "could not write its kernels", os.strerror(errno.EFBIG), "--no-graph")
    assert str(cache / "compile") in line


def test_graph_mode_with_a_broken_compiler_is_one_line_naming_the_fix(tmp_path):
    """A C++ compiler that exists but fails (here a silent script that always exits 1; a real one
    prints its own diagnostics first) is one line (exit 2) naming the toolchain and --no-graph,
    never inductor's traceback."""
    broken = tmp_path / "cxx"
    broken.write_text("#!/bin/sh\nexit 1\n")
    broken.chmod(0o755)
    env = dict(ENV, LANTERN_GRAPH="1", LANTERN_RUNTIME_CACHE=str(tmp_path / "cache"), CXX=str(broken))
    refused(cli(*SAMPLE, "--out", str(tmp_path / "s"), env=env), "graph mode: the C++ compiler failed on step",
            "fix the toolchain", "--no-graph")


def test_a_full_disk_is_one_line_and_the_resumed_folder_equals_an_uninterrupted_run(whole, tmp_path):
    patch = ("import errno, os, numpy\n"
             "def full(*a, **k):\n"
             "    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))\n"
             "numpy.savez = full\n")
    out = tmp_path / "s"
    refused(cli(*SAMPLE, "--out", str(out), patch=patch), f"cannot write --out {out}", os.strerror(errno.ENOSPC),
            "free some space", "run the same command again")
    assert list((out / "chunks").iterdir()) == []
    no_leftovers(out)
    assert cli(*SAMPLE, "--out", str(out)).returncode == 0
    same_samples(whole, out)


# --- runtime sample: damaged chunks are named, set aside and made again ------------------------------

def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:5000])


def _object_array(path: Path) -> None:
    np.savez(path, images=np.array([None, None], dtype=object), tokens=np.zeros((2, 16), np.int64),
             stats=np.array(json.dumps({"stats": {}, "seconds": 1.0})))


def _fewer_images(path: Path) -> None:
    with np.load(path) as z:
        np.savez(path, images=z["images"][:1], tokens=z["tokens"][:1], stats=z["stats"])


def _other_size(path: Path) -> None:
    with np.load(path) as z:
        np.savez(path, images=z["images"][:, :32, :32], tokens=z["tokens"], stats=z["stats"])


@pytest.mark.parametrize("damage, reason", [
    (_truncate, "not a readable .npz"),
    (_object_array, "object array"),
    (_fewer_images, "holds 1 images, the manifest gives it 2"),
    (_other_size, "uint8 32x32x3, this run makes uint8 64x64x3"),
    (hostile.encrypted, "not a readable .npz: RuntimeError"),
    (hostile.unknown_compression, "not a readable .npz: NotImplementedError"),
    (hostile.huge_shape, "not a readable .npz"),
])
def test_a_damaged_chunk_is_named_set_aside_and_made_again(whole, tmp_path, damage, reason):
    out = partial_copy(whole, tmp_path / "s")
    damage(out / "chunks" / "chunk_000001.npz")
    proc = cli(*SAMPLE, "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("warning: chunks/chunk_000001.npz is damaged"), proc.stderr
    assert reason in lines[0] and "moved to damaged/chunk_000001.npz and made again" in lines[0]
    assert (out / "damaged" / "chunk_000001.npz").is_file()
    assert json.loads((out / "result.json").read_text())["timing"]["this_invocation"]["images"] == 2
    same_samples(whole, out)
    again = cli(*SAMPLE, "--out", str(out))  # and it stays fixed: no warning the second time
    assert again.returncode == 0 and again.stderr.strip() == "", again.stderr


def test_a_killed_runs_temporary_files_are_swept_and_a_live_ones_kept(whole, tmp_path):
    out = partial_copy(whole, tmp_path / "s")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()  # a pid that has exited
    from runtime.utils.atomic import owned_prefix

    mine = owned_prefix("samples.npz")  # this test process's: alive
    host = mine.split("-")[-1].rstrip(".")
    stale = [out / f".samples.npz.{dead}-{host}.abc123.tmp", out / "chunks" / f".chunk_000000.npz.{dead}-{host}.x.tmp"]
    live = out / f"{mine}def456.tmp"
    for path in (*stale, live):
        path.write_bytes(b"half")
    assert cli(*SAMPLE, "--out", str(out)).returncode == 0
    assert not any(p.exists() for p in stale) and live.exists()


@pytest.mark.slow
def test_sigkill_leaves_a_staging_folder_that_the_next_run_into_the_same_out_removes(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.Popen([*RUNTIME, "run", "--device", "cpu", "--num-images", "24", "--out", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV)
    deadline = time.monotonic() + 120
    while not any(p.name.startswith(".out.") for p in tmp_path.iterdir()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    left = [p.name for p in tmp_path.iterdir()]
    assert len(left) == 1 and left[0].startswith(".out."), left  # no finally ran: the staging folder stays
    again = cli("run", "--device", "cpu", "--method", "ar", "--num-images", "1", "--out", str(out))
    assert again.returncode == 0, again.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# --- runtime eval --------------------------------------------------------------------------------

@pytest.fixture
def weights(tmp_path) -> Path:
    """A finite stand-in weights file: eval's checks below all come before the Inception model is built."""
    path = tmp_path / "inception.safetensors"
    save_file({"w": torch.zeros(2)}, str(path))
    return path


def _damaged(path: Path, damage) -> Path:
    damage(path)
    return path


def _png_folder(folder: Path, damage) -> Path:
    """A reference folder of two images, the first one (read first) hostile."""
    folder.mkdir()
    damage(folder / "a.png")
    (folder / "b.png").write_bytes(hostile.png_bytes(64, 64))
    return folder


def _npz(path: Path, n: int = 4, size: int = 64, **extra: np.ndarray) -> Path:
    np.savez(path, np.zeros((n, size, size, 3), np.uint8), **extra)
    return path


@pytest.mark.parametrize("build, words", [
    (lambda d: _npz(d / "g.npz", n=0), ("'arr_0' holds no images",)),
    (lambda d: _npz(d / "g.npz", n=1), ("1 image; a covariance", "needs at least 2")),
    (lambda d: _npz(d / "g.npz", arr_1=np.array([None] * 4, dtype=object)), ("'arr_1' is an object array",
                                                                              "never loaded")),
    (lambda d: _npz(d / "g.npz", arr_1=np.arange(3)), ("'arr_1' is int64 (3,)", "one integer label per image")),
    (lambda d: _damaged(_npz(d / "g.npz"), hostile.encrypted), ("g.npz: 'arr_0' cannot be read (RuntimeError",
                                                                "damaged")),
    (lambda d: _damaged(_npz(d / "g.npz"), hostile.patched_data), ("NotImplementedError", "damaged")),
    (lambda d: _damaged(_npz(d / "g.npz"), hostile.bad_local_signature), ("BadZipFile", "damaged")),
    (lambda d: _damaged(_npz(d / "g.npz"), hostile.npy_header_cut), ("g.npz", "arr_0")),
])
def test_eval_refuses_a_generated_npz_that_cannot_be_measured(tmp_path, weights, build, words):
    generated = build(tmp_path)
    out = tmp_path / "m.json"
    refused(cli("eval", str(generated), "--inception-weights", str(weights), "--out", str(out)), *words)
    assert not out.exists()


@pytest.mark.parametrize("build, words", [
    (lambda d: _npz(d / "r.npz", mu=np.array([None], dtype=object), sigma=np.eye(1)), ("'mu' is an object array",)),
    (lambda d: _npz(d / "r.npz", size=32), ("its images are 32x32", "64x64", "FID compares images of one size")),
    (lambda d: _npz(d / "r.npz", n=1), ("needs at least 2 images",)),
    (lambda d: _npz(d / "r.npz", mu=np.full(3, np.nan), sigma=np.eye(3)), ("'mu' or 'sigma' holds NaN",)),
    (lambda d: _npz(d / "r.npz", mu=np.zeros(3), sigma=np.eye(4)), ("are not a Gaussian",)),
    (lambda d: _damaged(_npz(d / "r.npz", mu=np.zeros(3), sigma=np.eye(3)), hostile.unknown_compression),
     ("r.npz", "NotImplementedError", "damaged")),
    (lambda d: _png_folder(d / "ref", hostile.png_huge_dimensions), ("a.png", "decompression-bomb limit")),
    (lambda d: _png_folder(d / "ref", hostile.png_text_bomb), ("a.png", "not a readable image")),
])
def test_eval_refuses_a_reference_that_cannot_be_right(tmp_path, weights, build, words):
    generated, reference = _npz(tmp_path / "g.npz"), build(tmp_path)
    out = tmp_path / "m.json"
    refused(cli("eval", str(generated), "--reference", str(reference), "--inception-weights", str(weights),
                "--out", str(out)), *words)
    assert not out.exists()


def test_eval_refuses_inception_weights_holding_nan(tmp_path):
    bad = tmp_path / "inception.safetensors"
    save_file({"Conv2d_1a_3x3.conv.weight": torch.tensor([1.0, float("nan")])}, str(bad))
    out = tmp_path / "m.json"
    refused(cli("eval", str(_npz(tmp_path / "g.npz")), "--inception-weights", str(bad), "--out", str(out)),
            "'Conv2d_1a_3x3.conv.weight' holds 1 NaN or infinite values", "download")
    assert not out.exists()


def test_eval_names_the_torch_torchvision_pair_when_torchvision_was_built_for_another_torch(tmp_path, weights):
    """The import fails as a torchvision wheel for another torch fails: at its operator registration."""
    stub = tmp_path / "site" / "torch_fidelity"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise RuntimeError('operator torchvision::nms does not exist')\n")
    env = dict(ENV, PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), ENV.get("PYTHONPATH", "")]))
    release = torch.__version__.split("+")[0]
    minor = int(release.split(".")[1])
    refused(cli("eval", str(_npz(tmp_path / "g.npz")), "--inception-weights", str(weights), env=env),
            "operator torchvision::nms does not exist", f"is not the build for torch {torch.__version__}",
            f"pairs with torchvision 0.{minor + 15}.x", f"'torch=={release}'", "docs/quality.md")


def test_eval_out_naming_a_folder_is_refused_before_anything_is_measured(tmp_path):
    folder = tmp_path / "metrics"
    folder.mkdir()
    started = time.monotonic()
    refused(cli("eval", str(tmp_path / "no-such-run"), "--out", str(folder)), "is a folder",
            "--out names the metrics file")
    assert list(folder.iterdir()) == [] and time.monotonic() - started < 60


def test_eval_out_on_a_read_only_file_system_is_refused_before_anything_is_measured(tmp_path):
    patch = ("import errno, os, tempfile\n"
             "def read_only(*a, dir=None, **k):\n"
             "    raise OSError(errno.EROFS, os.strerror(errno.EROFS), dir)\n"
             "tempfile.mkstemp = read_only\n")
    out = tmp_path / "sub" / "m.json"
    refused(cli("eval", str(tmp_path / "no-such-run"), "--out", str(out), patch=patch), f"cannot write --out {out}",
            os.strerror(errno.EROFS))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("file", ["../outside.png", "/etc/hostname", "link.png"])
def test_eval_does_not_read_an_image_outside_the_run_folder(tmp_path, weights, file):
    from PIL import Image

    run = tmp_path / "run"
    run.mkdir()
    Image.new("RGB", (64, 64)).save(tmp_path / "outside.png")
    Image.new("RGB", (64, 64)).save(run / "image_0000.png")
    (run / "link.png").symlink_to(tmp_path / "outside.png")
    records = [{"index": 0, "file": "image_0000.png", "class": 0}, {"index": 1, "file": file, "class": 1}]
    (run / "result.json").write_text(json.dumps({"images": records}))
    refused(cli("eval", str(run), "--inception-weights", str(weights)), f"image file {file!r} lies outside the run "
            "folder")


def test_non_finite_features_are_refused_before_any_figure(tmp_path):
    from runtime.utils.errors import UserError
    from runtime.metrics.fidelity import InceptionFeatures

    pool = np.ones((3, 4))
    pool[1, 2] = np.inf
    with pytest.raises(UserError, match="pool_3 features of 1 of 3 images are NaN or infinite"):
        InceptionFeatures(pool, np.ones((3, 5))).check("g.npz")
    assert len(InceptionFeatures(np.ones((3, 4)), np.ones((3, 5))).check("g.npz")) == 3
