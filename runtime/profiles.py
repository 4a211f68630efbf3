"""Hardware profiles: per-target settings in TOML (``profiles/*.toml``), validated into dataclasses.

A profile holds what depends on the hardware: the dtype and graph mode, the static draft tree
(its size trades verify cost against accepted length), the drafting budget of the dynamic tree,
and the benchmark's warm-up/repeat counts. Method parameters that depend on the *model* (LANTERN
``k``/``lambda``/``delta``, temperature, CFG) are usually left out, so the model bundle's
recommended values apply; a profile may still pin them. Precedence, highest first: command-line
flag, profile, model bundle, code default.

Schema (every key of a section is listed in :data:`SCHEMA`; anything else is refused)::

    description = "one line"            # optional
    [device]  dtype = "bf16"|"fp16"|"fp32"; graph = true|false; optional: hpu_mode = "lazy"|"eager",
              batch_size = 1 (images decoded together; `--batch-size` overrides it)
    [tree]    name = "naive_extend_57"   # a preset name or a path (relative to the profile file)
    [method]  name = "ar"|"sd"|"eagle2"|"lantern"|"lantern++"; optional: lantern_k, lantern_lambda,
              lantern_delta, temperature, top_k, top_p, cfg, cfg_interval, greedy, depth, top_k_draft,
              total_tokens
    [bench]   warmup = 3; repeats = 10
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from runtime.errors import UserError
from runtime.toml_compat import tomllib


PROFILE_PACKAGE = "profiles"
DTYPE_NAMES: tuple[str, ...] = ("bf16", "fp16", "fp32")
HPU_MODES: tuple[str, ...] = ("lazy", "eager")
METHOD_NAMES: tuple[str, ...] = ("ar", "sd", "eagle2", "ddd", "lantern", "lantern++")
_NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*")


@dataclass(frozen=True)
class DeviceSettings:
    """``[device]``: floating-point dtype, graph mode, (Gaudi only) the bridge's execution mode,
    and how many images decode together (``batch_size``)."""

    dtype: str
    graph: bool
    hpu_mode: str | None = None
    batch_size: int = 1

    @property
    def torch_dtype(self) -> torch.dtype:
        return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[self.dtype]

    @property
    def hpu_lazy_mode(self) -> bool | None:
        """True for ``hpu_mode = "lazy"``, False for ``"eager"``, None when unset."""
        return None if self.hpu_mode is None else self.hpu_mode == "lazy"


@dataclass(frozen=True)
class TreeSettings:
    """``[tree]``: the static draft tree, a preset name (``naive_extend_57``, ``chain``...) or a file path."""

    name: str


@dataclass(frozen=True)
class MethodSettings:
    """``[method]``: the decoding method and any parameters the profile pins (None = not pinned)."""

    name: str
    lantern_k: int | None = None
    lantern_lambda: float | None = None
    lantern_delta: float | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    cfg: float | None = None
    cfg_interval: int | None = None
    greedy: bool | None = None
    depth: int | None = None
    top_k_draft: int | None = None
    total_tokens: int | None = None
    ddd_threshold: float | None = None
    ddd_check_every: int | None = None
    ddd_min_depth: int | None = None
    ddd_max_depth: int | None = None
    dynamic_depth: float | None = None

    def pinned(self) -> dict[str, Any]:
        """The parameters this profile sets, without ``name``: ``{"top_k_draft": 10, ...}``."""
        return {
            field.name: getattr(self, field.name)
            for field in dataclasses.fields(self)
            if field.name != "name" and getattr(self, field.name) is not None
        }


@dataclass(frozen=True)
class BenchSettings:
    """``[bench]``: untimed warm-up runs (graph capture, compilation) and timed repeats."""

    warmup: int
    repeats: int


@dataclass(frozen=True)
class Profile:
    """One validated hardware profile. ``source`` is where it was read from (for messages)."""

    name: str
    source: str
    description: str
    device: DeviceSettings
    tree: TreeSettings
    method: MethodSettings
    bench: BenchSettings

    def to_dict(self) -> dict[str, Any]:
        """Plain data for ``result.json``: ``{"name", "source", "description", "device", ...}``."""
        return dataclasses.asdict(self)


# -- validation ------------------------------------------------------------------------------


class _Invalid(Exception):
    """A value failed its check; the message says what was expected."""


Check = Callable[[Any], Any]


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _integer(low: int) -> Check:
    def check(value: Any) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise _Invalid(f"an integer >= {low}")
        return value

    return check


def _real(low: float, high: float = math.inf, *, low_open: bool = False) -> Check:
    bounds = f"> {low:g}" if low_open else f">= {low:g}"
    expected = f"a number {bounds}" if high == math.inf else f"a number in {'(' if low_open else '['}{low:g}, {high:g}]"

    def check(value: Any) -> float:
        if not _is_number(value) or not math.isfinite(value):
            raise _Invalid(expected)
        number = float(value)
        if (number <= low if low_open else number < low) or number > high:
            raise _Invalid(expected)
        return number

    return check


def _boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise _Invalid("true or false")
    return value


def _choice(options: tuple[str, ...]) -> Check:
    def check(value: Any) -> str:
        if not isinstance(value, str) or value not in options:
            raise _Invalid("one of " + ", ".join(f"'{option}'" for option in options))
        return value

    return check


def _nonempty_string(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _Invalid("a non-empty string")
    return value.strip()


@dataclass(frozen=True)
class _Key:
    check: Check
    required: bool = False


SCHEMA: dict[str, dict[str, _Key]] = {
    "device": {
        "dtype": _Key(_choice(DTYPE_NAMES), required=True),
        "graph": _Key(_boolean, required=True),
        "hpu_mode": _Key(_choice(HPU_MODES)),
        "batch_size": _Key(_integer(1)),
    },
    "tree": {
        "name": _Key(_nonempty_string, required=True),
    },
    "method": {
        "name": _Key(_choice(METHOD_NAMES), required=True),
        "lantern_k": _Key(_integer(1)),
        "lantern_lambda": _Key(_real(1.0)),
        "lantern_delta": _Key(_real(0.0, 1.0)),
        "temperature": _Key(_real(0.0, low_open=True)),
        "top_k": _Key(_integer(0)),
        "top_p": _Key(_real(0.0, 1.0, low_open=True)),
        "cfg": _Key(_real(0.0)),
        "cfg_interval": _Key(_integer(-1)),
        "greedy": _Key(_boolean),
        "depth": _Key(_integer(1)),
        "top_k_draft": _Key(_integer(1)),
        "total_tokens": _Key(_integer(2)),
        "ddd_threshold": _Key(_real(float("-inf"), 0.0, low_open=True)),
        "ddd_check_every": _Key(_integer(1)),
        "ddd_min_depth": _Key(_integer(1)),
        "ddd_max_depth": _Key(_integer(1)),
        "dynamic_depth": _Key(_real(0.0, 1.0)),
    },
    "bench": {
        "warmup": _Key(_integer(0), required=True),
        "repeats": _Key(_integer(1), required=True),
    },
}
TOP_LEVEL_KEYS: tuple[str, ...] = ("description", *SCHEMA)


def _looks_like_path(value: str) -> bool:
    return "/" in value or "\\" in value or Path(value).suffix in {".json", ".toml", ".txt", ".py"}


def _validate_section(source: str, section: str, table: Any) -> dict[str, Any]:
    if not isinstance(table, dict):
        raise UserError(f"{source}: '{section}' must be a table ([{section}])")
    keys = SCHEMA[section]
    for key in table:
        if key not in keys:
            raise UserError(f"{source}: unknown key '{section}.{key}' (known: {', '.join(keys)})")
    values: dict[str, Any] = {}
    for key, spec in keys.items():
        if key not in table:
            if spec.required:
                raise UserError(f"{source}: missing key '{section}.{key}'")
            continue
        try:
            values[key] = spec.check(table[key])
        except _Invalid as expected:
            raise UserError(f"{source}: '{section}.{key}' must be {expected}, got {table[key]!r}") from None
    return values


def parse_profile(text: str, *, source: str, name: str, base_dir: Path | None = None) -> Profile:
    """Validate TOML ``text`` into a :class:`Profile`; ``source`` names the file in every error.

    A tree given as a relative path is resolved against ``base_dir`` (the profile's folder).
    """
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise UserError(f"{source}: not valid TOML ({err})") from None
    for key in data:
        if key not in TOP_LEVEL_KEYS:
            raise UserError(f"{source}: unknown key '{key}' (known: {', '.join(TOP_LEVEL_KEYS)})")
    description = data.get("description", "")
    if not isinstance(description, str):
        raise UserError(f"{source}: 'description' must be a string, got {description!r}")
    for section in SCHEMA:
        if section not in data:
            raise UserError(f"{source}: missing section [{section}]")
    sections = {section: _validate_section(source, section, data[section]) for section in SCHEMA}

    tree_name = sections["tree"]["name"]
    if base_dir is not None and _looks_like_path(tree_name) and not Path(tree_name).is_absolute():
        sections["tree"]["name"] = str(base_dir / tree_name)

    return Profile(
        name=name,
        source=source,
        description=description,
        device=DeviceSettings(**sections["device"]),
        tree=TreeSettings(**sections["tree"]),
        method=MethodSettings(**sections["method"]),
        bench=BenchSettings(**sections["bench"]),
    )


# -- lookup ----------------------------------------------------------------------------------


def shipped_profiles() -> list[str]:
    """Names of the profiles shipped as package data (``cpu``, ``gaudi2``, ``h100``, ``rtx3090``, and
    any written there by ``runtime tune``; their ``NAME.tree.toml`` tree files are not profiles)."""
    folder = importlib.resources.files(PROFILE_PACKAGE)
    return sorted(entry.name[: -len(".toml")] for entry in folder.iterdir()
                  if entry.name.endswith(".toml") and not entry.name.endswith(".tree.toml"))


def load_profile(name_or_path: str | Path) -> Profile:
    """A shipped profile by name (``"h100"``) or a profile file by path (``"my/gpu.toml"``).

    Raises:
        UserError: unknown name, missing file, invalid TOML, unknown key or bad value; the
            message names the file and the key.
    """
    text_value = str(name_or_path)
    if isinstance(name_or_path, Path) or text_value.endswith(".toml") or "/" in text_value or "\\" in text_value:
        path = Path(text_value).expanduser()
        if not path.is_file():
            raise UserError(f"profile file '{text_value}' not found; give a shipped name ({', '.join(shipped_profiles())}) or an existing .toml file")
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise UserError(f"{text_value}: cannot read profile ({err})") from None
        return parse_profile(text, source=text_value, name=path.stem, base_dir=path.resolve().parent)

    if not _NAME_PATTERN.fullmatch(text_value):
        raise UserError(f"invalid profile name '{text_value}'; give a shipped name ({', '.join(shipped_profiles())}) or a path to a .toml file")
    resource = importlib.resources.files(PROFILE_PACKAGE) / f"{text_value}.toml"
    if not resource.is_file():
        raise UserError(f"unknown profile '{text_value}' (shipped: {', '.join(shipped_profiles())}); or give a path to a .toml file")
    base_dir = Path(str(resource)).parent if isinstance(resource, Path) else None
    return parse_profile(
        resource.read_text(encoding="utf-8"), source=f"profiles/{text_value}.toml", name=text_value, base_dir=base_dir
    )


def default_profile_name(backend_name: str, device_name: str) -> str:
    """The shipped profile for a detected device: cpu -> ``cpu``; CUDA H100/H200 -> ``h100``;
    any other CUDA GPU -> ``rtx3090``; hpu -> ``gaudi2``."""
    if backend_name == "cpu":
        return "cpu"
    if backend_name == "cuda":
        upper = device_name.upper()
        return "h100" if "H100" in upper or "H200" in upper else "rtx3090"
    if backend_name == "hpu":
        return "gaudi2"
    raise ValueError(f"no default profile for backend '{backend_name}'")


def default_profile_for(backend_name: str, device_name: str) -> Profile:
    """:func:`load_profile` of :func:`default_profile_name`."""
    return load_profile(default_profile_name(backend_name, device_name))
