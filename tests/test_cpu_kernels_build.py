"""The CPU kernels' tests skip where the kernels cannot build; this one keeps that from hiding a
build that broke: a host with the toolchain graph mode needs must build them."""

from __future__ import annotations

import backends.cpu_kernels as kernels
from backends.toolchain import graph_toolchain_missing


def test_they_build_wherever_graph_mode_can_compile():
    if graph_toolchain_missing() is None and kernels.enabled():
        assert kernels.load() is not None
