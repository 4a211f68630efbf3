"""`--method auto` on a model the backend calls memory-bound reads the profile's [auto]
memory_bound table (the CPU's: measured on the LlamaGen-XL shape), and elsewhere its
by_occupancy table; a profile without the table keeps one table for every model."""

from __future__ import annotations

import pytest

from backends.cpu import CpuBackend
from runtime import ImageGenerator
from runtime.config.method_options import RelaxKind
from runtime.config.profiles import AutoSettings, load_profile


def test_the_cpu_profile_names_a_method_per_occupancy_for_memory_bound_models():
    table = load_profile("cpu").auto
    assert table.memory_bound is not None
    assert table.for_model(True).method_for(1) == "lantern++" and table.for_model(False).method_for(1) == "ar"
    plain = AutoSettings(by_occupancy={"1": "ar"})
    assert plain.for_model(True) is plain


@pytest.mark.parametrize("memory_bound", [False, True])
def test_the_generator_picks_the_table_by_the_model(monkeypatch, memory_bound):
    monkeypatch.setattr(CpuBackend, "memory_bound", lambda self, module: memory_bound)
    with ImageGenerator(method="auto", device="cpu", graph=False) as g:
        spec = g.spec_for(1)
        assert g.memory_bound is memory_bound
        assert spec.method == ("lantern++" if memory_bound else "ar")
        assert ("[auto] memory_bound" in g.sources(spec, 1)["method"]) is memory_bound
        assert set(g.auto_specs()) == set(g.auto_table.methods)
        if memory_bound:
            assert spec.relaxation_kind == RelaxKind.NONE  # auto runs lossless: the exact tree


def test_the_demo_is_not_memory_bound_and_a_large_model_is(monkeypatch):
    import backends.cpu as cpu

    backend = CpuBackend(graph_mode=False)
    monkeypatch.setattr(cpu, "last_level_cache_bytes", lambda: 1 << 20)
    import torch

    assert not backend.memory_bound(torch.nn.Linear(256, 256))  # 256 KiB
    assert backend.memory_bound(torch.nn.Linear(1024, 1024))  # 4 MiB > 2 x 1 MiB
