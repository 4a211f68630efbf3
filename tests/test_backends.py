"""Backends: placement, timing, memory, profiler and graph capture behave the same on every device.

CPU tests always run. Tests marked `cuda` / `hpu` need the hardware and are skipped with a reason
where it is absent.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from backends import (
    Backend,
    CpuBackend,
    CudaBackend,
    HpuBackend,
    PhaseTimer,
    get_backend,
    parse_dtype,
    resolve_backend_name,
)
from backends.hpu import LAZY_MODE_ENV
from runtime.utils.errors import UserError

CUDA_PRESENT, CUDA_REASON = CudaBackend.availability()
HPU_PRESENT, HPU_REASON = HpuBackend.availability()
needs_cuda = [pytest.mark.cuda, pytest.mark.skipif(not CUDA_PRESENT, reason=f"no CUDA: {CUDA_REASON}")]
needs_hpu = [pytest.mark.hpu, pytest.mark.skipif(not HPU_PRESENT, reason=f"no Gaudi: {HPU_REASON}")]


def with_marks(marks: list[pytest.MarkDecorator]) -> Callable[[Callable[..., None]], Callable[..., None]]:
    def apply(test: Callable[..., None]) -> Callable[..., None]:
        for mark in marks:
            test = mark(test)
        return test

    return apply


# -- a fixed-shape in-place step, the kind the decoding core captures --------------------------


def make_buffers(device: torch.device, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """state (4, 8), inputs (4, 8), and a closed-over step counter (1,) — all fixed-shape."""
    generator = torch.Generator().manual_seed(0)
    state = torch.randn(4, 8, generator=generator).to(device=device, dtype=dtype)
    inputs = torch.randn(4, 8, generator=generator).to(device=device, dtype=dtype)
    counter = torch.zeros(1, dtype=torch.int64, device=device)
    return state, inputs, counter


def make_step(counter: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """Reads and writes its arguments and a closed-over buffer in place; returns nothing."""

    def step(state: torch.Tensor, inputs: torch.Tensor) -> None:
        state.mul_(0.5).add_(torch.tanh(inputs))
        inputs.add_(state.sum(dim=-1, keepdim=True) * 0.01)
        counter.add_(1)

    return step


def run_eager(device: torch.device, iterations: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    state, inputs, counter = make_buffers(device)
    step = make_step(counter)
    for _ in range(iterations):
        step(state, inputs)
    return state, inputs, counter


def assert_capture_replays_like_eager(backend: Backend, iterations: int = 20) -> None:
    """Capture once, reset the buffers, replay N times: equals N eager calls; captured exactly once."""
    state, inputs, counter = make_buffers(backend.device)
    initial = (state.clone(), inputs.clone())
    replay = backend.capture(make_step(counter), state, inputs, name="toy_step")
    # Capture may warm up on the buffers; the contract says to re-initialise them before replaying.
    state.copy_(initial[0])
    inputs.copy_(initial[1])
    counter.zero_()
    for _ in range(iterations):
        replay()
    backend.synchronize()

    expected_state, expected_inputs, expected_counter = run_eager(backend.device, iterations)
    torch.testing.assert_close(state, expected_state, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(inputs, expected_inputs, rtol=1e-5, atol=1e-5)
    assert counter.item() == expected_counter.item() == iterations
    assert backend.capture_count["toy_step"] == 1


# -- CPU --------------------------------------------------------------------------------------


def test_cpu_backend_policy() -> None:
    backend = get_backend("cpu")
    assert isinstance(backend, CpuBackend)
    assert backend.device == torch.device("cpu")
    assert backend.dtype == torch.float32
    assert backend.dist_backend == "gloo"
    assert get_backend("cpu", dtype="bf16").dtype == torch.bfloat16


def test_to_device_casts_floating_point_state_and_keeps_integer_tensors() -> None:
    backend = get_backend("cpu", dtype="bf16")
    module = backend.to_device(torch.nn.Linear(3, 2))
    assert module.weight.dtype == torch.bfloat16
    assert backend.to_device(torch.ones(2)).dtype == torch.bfloat16
    assert backend.to_device(torch.arange(3)).dtype == torch.int64
    assert backend.to_device(torch.ones(2), cast=False).dtype == torch.float32


def test_parse_dtype_accepts_short_and_long_names_and_refuses_others() -> None:
    assert parse_dtype("bf16") == parse_dtype("bfloat16") == torch.bfloat16
    assert parse_dtype("fp32") == torch.float32
    with pytest.raises(UserError, match="unknown dtype 'int8'"):
        parse_dtype("int8")


def test_info_names_backend_device_count_and_versions() -> None:
    info = get_backend("cpu").info()
    assert info["backend"] == "cpu"
    assert info["count"] == 1
    assert info["torch"] == torch.__version__
    assert info["dtype"] == "fp32"
    assert isinstance(info["name"], str) and info["name"]


def test_phase_timer_accumulates_seconds_and_counts_per_phase() -> None:
    timer = get_backend("cpu").timer()
    began = time.perf_counter()
    for _ in range(3):
        with timer.phase("draft"):
            time.sleep(0.01)
        with timer.phase("verify"):
            time.sleep(0.02)
    elapsed = time.perf_counter() - began
    summary = timer.summary()
    assert {name: entry["count"] for name, entry in summary.items()} == {"draft": 3, "verify": 3}
    assert summary["draft"]["seconds"] >= 0.03
    assert summary["verify"]["seconds"] >= 0.06
    # Phases tile the loop, so their sum matches the wall time of the whole loop.
    assert timer.total_seconds() == pytest.approx(elapsed, rel=0.05)


def test_phase_timer_refuses_a_phase_nested_in_itself() -> None:
    timer = PhaseTimer()
    with timer.phase("verify"), pytest.raises(RuntimeError, match="already open"):
        with timer.phase("verify"):
            pass


class FakeEvent:
    """A host-clock stand-in for a device event: records perf_counter, reports ms like CUDA/HPU."""

    def __init__(self) -> None:
        self.stamp = 0.0

    def record(self) -> None:
        self.stamp = time.perf_counter()

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: FakeEvent) -> float:
        return (end.stamp - self.stamp) * 1000.0


def test_event_timer_syncs_once_at_summary_and_converts_milliseconds() -> None:
    syncs: list[int] = []
    timer = PhaseTimer(event_factory=FakeEvent, synchronize=lambda: syncs.append(1))
    for _ in range(2):
        with timer.phase("accept"):
            time.sleep(0.01)
    assert syncs == []  # no sync per phase: events are resolved later
    summary = timer.summary()
    assert len(syncs) == 1
    assert summary["accept"]["count"] == 2
    assert 0.02 <= summary["accept"]["seconds"] < 1.0


def test_memory_stats_are_positive_and_peak_tracks_a_large_allocation() -> None:
    # In a fresh process: inside the test session freed memory is reused and RSS need not grow.
    script = """
import torch
from backends import get_backend
backend = get_backend("cpu")
backend.reset_peak_memory()
before = backend.memory_stats()
assert before["current_bytes"] > 0 and before["peak_bytes"] >= before["current_bytes"]
block = torch.ones(16 * 1024 * 1024)  # 64 MiB, every page touched
del block
after = backend.memory_stats()
assert after["peak_bytes"] >= before["current_bytes"] + 48 * 1024 * 1024, (before, after)
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)


def test_profiler_writes_a_chrome_trace(tmp_path: Path) -> None:
    backend = get_backend("cpu")
    trace = tmp_path / "nested" / "trace.json"
    with backend.profiler(trace):
        torch.ones(64, 64) @ torch.ones(64, 64)
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(event.get("name") == "aten::matmul" for event in events)
    assert [path.name for path in trace.parent.iterdir()] == ["trace.json"]  # no temp file left


def test_profiler_writes_nothing_when_the_body_fails(tmp_path: Path) -> None:
    trace = tmp_path / "trace.json"
    with pytest.raises(ValueError), get_backend("cpu").profiler(trace):
        raise ValueError("boom")
    assert list(tmp_path.iterdir()) == []


def test_cpu_graph_mode_compiles_once_and_replays_like_eager() -> None:
    backend = get_backend("cpu", graph_mode=True)
    assert_capture_replays_like_eager(backend)


def test_more_than_eight_steps_from_one_def_can_be_captured() -> None:
    """Dynamo caches per code object (default limit 8): steps built by one factory must still compile.

    Uses dynamo's "eager" backend to keep the test fast; the limit handling is the same for inductor.
    """
    backend = get_backend("cpu", graph_mode=True)

    def make_scale(factor: float) -> Callable[[torch.Tensor], None]:
        def scale(buffer: torch.Tensor) -> None:
            buffer.mul_(factor).add_(1.0)

        return scale

    for level in range(9):
        buffer = torch.ones(2 + level)
        replay = backend._compile_counted(make_scale(float(level)), (buffer,), f"level{level}", "eager")
        buffer.fill_(1.0)
        replay()
        assert torch.equal(buffer, torch.full_like(buffer, level + 1.0))
    assert dict(backend.capture_count) == {f"level{level}": 1 for level in range(9)}


_STEP_SCALE = 2.0  # read by the step below at trace time: a guard dynamo checks on every replay


def test_a_recompile_after_capture_is_counted_which_selfcheck_reads() -> None:
    """`selfcheck`'s steady_state_no_recompile compares capture counts before and after a second
    image: a guard that fails after capture (here a global the step read) must show as a count."""
    global _STEP_SCALE
    backend = get_backend("cpu", graph_mode=True)

    def step(buffer: torch.Tensor) -> None:
        buffer.mul_(_STEP_SCALE)

    buffer = torch.ones(3)
    replay = backend._compile_counted(step, (buffer,), "scaled", "eager")
    replay()
    assert backend.capture_count["scaled"] == 1  # steady state: replays compile nothing
    try:
        _STEP_SCALE = 3.0
        buffer.fill_(1.0)
        replay()
        assert torch.equal(buffer, torch.full_like(buffer, 3.0))
        assert backend.capture_count["scaled"] == 2  # the recompile is counted
    finally:
        _STEP_SCALE = 2.0


def test_graph_off_returns_an_eager_closure_and_captures_nothing() -> None:
    backend = get_backend("cpu", graph_mode=False)
    state, inputs, counter = make_buffers(backend.device)
    replay = backend.capture(make_step(counter), state, inputs, name="toy_step")
    for _ in range(5):
        replay()
    expected_state, expected_inputs, _ = run_eager(backend.device, 5)
    torch.testing.assert_close(state, expected_state, rtol=0, atol=0)
    torch.testing.assert_close(inputs, expected_inputs, rtol=0, atol=0)
    assert counter.item() == 5  # no warm-up call either
    assert backend.capture_count["toy_step"] == 0


def test_capture_refuses_non_tensor_and_foreign_device_arguments() -> None:
    backend = get_backend("cpu", graph_mode=False)
    with pytest.raises(TypeError, match="static argument 0 is a int"):
        backend.capture(lambda value: None, 3, name="bad")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="static argument 0 is on meta"):
        backend.capture(lambda value: None, torch.empty(2, device="meta"), name="bad")


# -- selection and unavailable hardware -------------------------------------------------------


def test_unknown_device_is_refused() -> None:
    with pytest.raises(UserError, match="unknown device 'tpu' \\(choose auto, cpu, cuda, hpu\\)"):
        get_backend("tpu")


@pytest.mark.skipif(CUDA_PRESENT or HPU_PRESENT, reason="an accelerator is present, so auto picks it")
def test_auto_falls_back_to_cpu_without_accelerators() -> None:
    assert resolve_backend_name("auto") == "cpu"
    assert get_backend("auto").name == "cpu"


@pytest.mark.skipif(CUDA_PRESENT, reason="CUDA is present here")
def test_cuda_without_cuda_is_one_clean_line() -> None:
    with pytest.raises(UserError) as caught:
        get_backend("cuda")
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("cuda is not available: ")
    assert "--device cpu" in message and "docker/Dockerfile.cuda" in message


@pytest.mark.skipif(HPU_PRESENT, reason="a Gaudi device is present here")
def test_hpu_without_habana_is_one_clean_line() -> None:
    with pytest.raises(UserError) as caught:
        get_backend("hpu")
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("hpu is not available: ")
    assert "habana_frameworks" in message and "docker/Dockerfile.hpu" in message


def test_lazy_mode_on_a_stock_torch_names_the_fork_image() -> None:
    """Habana's bridge refuses lazy mode on upstream PyTorch (the upstream image's torch); the
    refusal must say to unset the variable or build on the fork image, and say nothing otherwise."""
    from backends.hpu import lazy_mode_hint

    hint = lazy_mode_hint("1", "2.11.0")
    assert hint is not None and "\n" not in hint
    assert "PT_HPU_LAZY_MODE" in hint and "GAUDI_FLAVOUR=" in hint and "2.11.0" in hint
    assert lazy_mode_hint("1", "2.7.1a0+gitb9ae2b0") is None  # Habana's fork build: lazy works
    assert lazy_mode_hint("0", "2.11.0") is None and lazy_mode_hint(None, "2.11.0") is None


@pytest.mark.skipif(HPU_PRESENT or "habana_frameworks.torch" in sys.modules, reason="the Gaudi bridge is loaded here")
def test_hpu_mode_is_requested_through_the_environment_before_the_bridge_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(LAZY_MODE_ENV, raising=False)
    with pytest.raises(UserError):
        get_backend("hpu", hpu_lazy_mode=False)
    assert os.environ[LAZY_MODE_ENV] == "0"


def test_runtime_devices_lists_every_backend(capsys: pytest.CaptureFixture[str]) -> None:
    from runtime.cli.app import main

    capsys.readouterr()
    main(["devices", "--json"])  # returns normally on success (exit code 0)
    rows = {row["backend"]: row for row in json.loads(capsys.readouterr().out)}
    assert set(rows) == {"cpu", "cuda", "hpu"}
    assert rows["cpu"]["available"] is True and rows["cpu"]["profile"] == "cpu"
    for name, present in (("cuda", CUDA_PRESENT), ("hpu", HPU_PRESENT)):
        assert rows[name]["available"] is present
        assert present or rows[name]["reason"]


def test_runtime_devices_prints_a_table_from_the_console_entry_point() -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "runtime", "devices"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "200"},
    )
    assert completed.returncode == 0, completed.stderr
    for word in ("backend", "available", "cpu", "cuda", "hpu", "torch"):
        assert word in completed.stdout


# -- CUDA (needs an NVIDIA GPU) ---------------------------------------------------------------


@with_marks(needs_cuda)
def test_cuda_graph_capture_replays_like_eager() -> None:
    backend = get_backend("cuda", dtype="fp32")
    assert backend.device.type == "cuda" and backend.dtype == torch.float32
    assert_capture_replays_like_eager(backend)


@with_marks(needs_cuda)
def test_cuda_graph_replays_draw_fresh_random_numbers() -> None:
    backend = get_backend("cuda")
    noise = torch.zeros(1024, device=backend.device)
    replay = backend.capture(lambda out: out.copy_(torch.rand_like(out)), noise, name="noise")
    replay()
    first = noise.clone()
    replay()
    assert not torch.equal(first, noise)  # the Philox offset advances per replay, not frozen at capture
    assert backend.capture_count["noise"] == 1


@with_marks(needs_cuda)
def test_cuda_timer_memory_and_profiler(tmp_path: Path) -> None:
    backend = get_backend("cuda")
    timer = backend.timer()
    backend.reset_peak_memory()
    with timer.phase("verify"):
        block = torch.ones(64 * 1024 * 1024, device=backend.device, dtype=torch.uint8)
        torch.cuda._sleep(10_000_000)
    summary = timer.summary()
    assert summary["verify"]["count"] == 1 and summary["verify"]["seconds"] > 0
    assert backend.memory_stats()["peak_bytes"] >= block.numel()
    with backend.profiler(tmp_path / "trace.json"):
        (block.float() * 2).sum()
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert any(event.get("cat") == "kernel" for event in events)
    info = backend.info()
    assert info["count"] >= 1 and info["cuda"] == torch.version.cuda


# -- HPU (needs an Intel Gaudi device) -------------------------------------------------------


@with_marks(needs_hpu)
def test_hpu_capture_replays_like_eager() -> None:
    backend = get_backend("hpu", dtype="fp32")
    assert backend.device.type == "hpu"
    assert_capture_replays_like_eager(backend)


@with_marks(needs_hpu)
def test_hpu_timer_and_memory() -> None:
    backend = get_backend("hpu")
    timer = backend.timer()
    backend.reset_peak_memory()
    with timer.phase("verify"):
        block = torch.ones(1024, 1024, device=backend.device)
        backend.mark_step()
    assert timer.summary()["verify"]["count"] == 1
    assert backend.memory_stats()["peak_bytes"] >= block.numel() * 4
    assert backend.info()["synapseai"]


def test_runtime_devices_fits_80_columns() -> None:
    completed = subprocess.run([sys.executable, "-m", "runtime", "devices"], capture_output=True, text=True,
                               timeout=120, env={**os.environ, "COLUMNS": "80"})
    assert completed.returncode == 0, completed.stderr
    assert max(len(line) for line in completed.stdout.splitlines()) <= 80
    assert "profile cpu" in completed.stdout


def test_cpu_graph_mode_without_a_compiler_runs_eager_and_says_so(monkeypatch, caplog):
    """Graph mode is the CPU profile's default; a host with no C++ compiler or no Python headers
    for inductor decodes eagerly with one warning instead of failing at the first compile."""
    import logging

    import backends.cpu as cpu
    import backends.toolchain as toolchain

    monkeypatch.setattr(toolchain.shutil, "which", lambda name: None)
    with caplog.at_level(logging.WARNING, logger="backends.cpu"):
        backend = get_backend("cpu", graph_mode=True)
    assert backend.graph_mode is False
    assert any("needs a C++ compiler" in r.getMessage() for r in caplog.records)
    monkeypatch.undo()
    monkeypatch.setattr(toolchain.sysconfig, "get_path", lambda name: "/nonexistent/include")
    with caplog.at_level(logging.WARNING, logger="backends.cpu"):
        assert get_backend("cpu", graph_mode=True).graph_mode is False
    assert any("Python.h" in r.getMessage() for r in caplog.records)
    monkeypatch.undo()
    assert get_backend("cpu", graph_mode=True).graph_mode is (cpu.graph_toolchain_missing() is None)
