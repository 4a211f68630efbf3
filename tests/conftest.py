"""Shared test fixtures: tiny model configs and a CLI runner. Keep this small and generic."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Iterator

import pytest
import torch

from runtime.models.configs import GPTConfig, VQConfig, gpt_config


# Graph mode is the CPU profile's default; a test about graph mode asks for it (--graph,
# graph_mode=True) and every other CLI run here, subprocesses included, is eager: compiling each
# configuration a test touches tripled the suite's time. Set at import, before test modules copy
# the environment for their subprocesses.
os.environ.setdefault("LANTERN_GRAPH", "0")


def tiny_gpt_config(model_type: str = "c2i") -> GPTConfig:
    """GPT-tiny: 2 layers, dim 64, a 4x4 token grid, 32 codes, 5 classes, 6 caption tokens."""
    return gpt_config("GPT-tiny", model_type=model_type, image_size=64, vocab_size=32, num_classes=5,
                      caption_dim=16, cls_token_num=1 if model_type == "c2i" else 6)


TINY_VQ_CONFIG = VQConfig(
    codebook_size=512, codebook_embed_dim=8, encoder_ch_mult=(1, 1, 2, 2, 4),
    decoder_ch_mult=(1, 1, 2, 2, 4), z_channels=32, ch=32, num_res_blocks=1, norm_groups=8)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The fast tier (`python -m pytest -m fast`: core math, trees, RNG, acceptance, exactness,
    refusals, layers) is the files that declare `pytestmark = pytest.mark.fast`; a slow test has
    no place in one (it would run in the edit-test loop)."""
    both = [item.nodeid for item in items
            if item.get_closest_marker("slow") is not None and item.get_closest_marker("fast") is not None]
    if both:
        raise pytest.UsageError(f"marked fast (its file's pytestmark) and slow: {', '.join(both)}; "
                                "move the slow test to a file outside the fast tier")


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """Tiny models gain nothing from threads; one thread keeps timings stable on shared CPUs."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(autouse=True, scope="session")
def _session_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """One runtime cache for the session, every xdist worker and subprocess included, outside the
    user's home: graph mode is the CPU profile's default, so the CLI tests compile steps, and a
    configuration compiled by one test is loaded by the next. A test that sets its own
    LANTERN_RUNTIME_CACHE (monkeypatch) still wins."""
    if os.environ.get("LANTERN_RUNTIME_CACHE"):
        yield
        return
    base = tmp_path_factory.getbasetemp()
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "runtime-cache"
    shared.mkdir(exist_ok=True)
    os.environ["LANTERN_RUNTIME_CACHE"] = str(shared)
    yield
    os.environ.pop("LANTERN_RUNTIME_CACHE", None)


@pytest.fixture
def tiny_vq_config() -> VQConfig:
    """A 16x-downsampling VQ with the official structure at toy width (ch 32, 512 codes)."""
    return TINY_VQ_CONFIG


@pytest.fixture
def make_tiny_gpt() -> Callable[..., torch.nn.Module]:
    """Factory: make_tiny_gpt(model_type="c2i", seed=0) -> an initialised GPT-tiny in eval mode."""

    def make(model_type: str = "c2i", seed: int = 0) -> torch.nn.Module:
        from runtime.models.gpt import Transformer

        torch.manual_seed(seed)
        model = Transformer(tiny_gpt_config(model_type))
        model.init_weights()
        torch.nn.init.normal_(model.output.weight, std=0.02)  # a zero head would hide errors
        return model.eval()

    return make


@dataclass
class CliResult:
    exit_code: int
    stdout: str
    stderr: str


@pytest.fixture
def run_cli(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> Callable[..., CliResult]:
    """run_cli("models", ...) runs `runtime` in-process; returns exit code, stdout, stderr."""
    from runtime.cli.app import main

    monkeypatch.setenv("COLUMNS", "200")  # rich wraps table cells to the terminal width

    def run(*argv: str) -> CliResult:
        capsys.readouterr()
        try:
            main(list(argv))
            code = 0
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        out = capsys.readouterr()
        return CliResult(code, out.out, out.err)

    return run
