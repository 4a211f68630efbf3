"""Nothing outside `runtime/core/` reaches a private name of the decoder: tune, selfcheck, the
projection and the step timing use its public steps (`Decoder` docstring)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _private_names() -> set[str]:
    """Private attributes and methods the decoder defines (`def _x` or `self._x = ...`)."""
    text = (ROOT / "runtime" / "core" / "decoder.py").read_text()
    names = set(re.findall(r"def (_[a-z][a-z0-9_]*)\(", text))
    names |= set(re.findall(r"self\.(_[a-z][a-z0-9_]*)\s*(?::[^=\n]+)?=", text))
    return names


def test_no_private_decoder_name_outside_core():
    names = _private_names()
    assert {"_measure_law", "_iteration"} <= names  # the scan finds them
    found = []
    for path in [*(ROOT / "runtime").rglob("*.py"), *(ROOT / "scripts").rglob("*.py")]:
        if (ROOT / "runtime" / "core") in path.parents:
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            for name in re.findall(r"(?<!self)\.(_[a-z][a-z0-9_]*)\b", line):
                if name in names:
                    found.append(f"{path.relative_to(ROOT)}:{i}: .{name}")
    assert not found, "\n".join(found)


def test_method_names_are_declared_once():
    """The core's table is the list of methods; profiles and the option declarations take it."""
    from runtime.core.methods import METHOD_TABLE
    from runtime.method_options import METHOD_ORDER
    from runtime.profiles import AUTO_METHODS, METHOD_NAMES

    assert tuple(METHOD_TABLE) == METHOD_ORDER == METHOD_NAMES
    assert "sjd" in METHOD_NAMES and set(AUTO_METHODS) == set(METHOD_NAMES) - {"lantern"}
