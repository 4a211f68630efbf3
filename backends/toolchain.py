"""What the CPU backend builds native code with: the host's C++ compiler and Python's headers
(inductor's graph-mode kernels, `backends.cpu_kernels`)."""

from __future__ import annotations

import os
import shutil
import sysconfig


def cxx_compiler() -> str | None:
    """The C++ compiler inductor would build graph-mode kernels with ($CXX, else g++, c++ or
    clang++ on PATH), or None."""
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def graph_toolchain_missing() -> str | None:
    """What inductor lacks here to build CPU kernels (a C++ compiler, Python's C headers), or None."""
    if cxx_compiler() is None:
        return "a C++ compiler (g++ or clang++, or $CXX)"
    include = sysconfig.get_path("include")
    if not include or not os.path.isfile(os.path.join(include, "Python.h")):
        return f"Python's C headers (Python.h in {include}: the python3-dev package)"
    return None
