"""Hardware profiles: per-target settings in TOML (``profiles/*.toml``), validated by pydantic models.

A profile holds what depends on the hardware: the dtype and graph mode, the static draft tree
(its size trades verify cost against accepted length), the drafting budget of the dynamic tree,
and the benchmark's warm-up/repeat counts. Method parameters that depend on the *model* (LANTERN
``k``/``lambda``/``delta``, temperature, CFG) are usually left out, so the model bundle's
recommended values apply; a profile may still pin them. Precedence, highest first: command-line
flag, profile, model bundle, code default.

A profile file holds an optional top-level ``description`` and the tables ``[device]``, ``[tree]``,
``[method]`` and ``[bench]`` (and, where `runtime tune` wrote them, ``[auto]``, ``[roof]`` and ``[quality]``), each a
pydantic model whose fields are its keys;
anything else is refused, and a wrong value is told its key's ``description`` (``'method.top_p'
must be a number in (0, 1], got 0``).
"""

from __future__ import annotations

import importlib.resources
import math
import re
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, StringConstraints, ValidationError, create_model

from runtime.utils.errors import UserError
from runtime.config.method_options import METHOD_DECLS, METHOD_OPTIONS, METHODS, MethodOption
from runtime.config.toml_compat import tomllib

if TYPE_CHECKING:
    import torch

PROFILE_PACKAGE = "profiles"
DTYPE_NAMES: tuple[str, ...] = ("bf16", "fp16", "fp32")
HPU_MODES: tuple[str, ...] = ("lazy", "eager")
_NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*")


# A key's type: strict (true is not 1, 1.5 not an integer, inf not a number), with its description.
def _integer(low: int, high: int | None = None) -> Any:
    expected = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
    return Annotated[int, Strict(), Field(ge=low, le=high, description=expected)]


def _real(low: float, high: float = math.inf, *, low_open: bool = False, high_open: bool = False) -> Any:
    bound = {"gt" if low_open else "ge": low} if math.isfinite(low) else {}
    if math.isfinite(high):
        bound["lt" if high_open else "le"] = high
    if not math.isfinite(high):
        expected = f"a number {'>' if low_open else '>='} {low:g}"
    elif not math.isfinite(low):
        expected = f"a number {'<' if high_open else '<='} {high:g}"
    else:
        expected = f"a number in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    return Annotated[float, Strict(), Field(**bound, description=expected)]


def _choice(options: tuple[str, ...]) -> Any:
    return Annotated[Literal[options], Field(description="one of " + ", ".join(f"'{o}'" for o in options))]


_BOOLEAN = Annotated[bool, Strict(), Field(description="true or false")]


class _Section(BaseModel):
    """A TOML table: unknown keys refused, values frozen; an absent optional key is None (unpinned)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class DeviceSettings(_Section):
    """``[device]``: floating-point dtype, graph mode, (Gaudi only) the bridge's execution mode,
    and how many images decode together (``batch_size``)."""

    dtype: _choice(DTYPE_NAMES)
    graph: _BOOLEAN
    hpu_mode: _choice(HPU_MODES) = None
    batch_size: _integer(1) = 1

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[self.dtype]

    @property
    def hpu_lazy_mode(self) -> bool | None:
        """True for ``hpu_mode = "lazy"``, False for ``"eager"``, None when unset."""
        return None if self.hpu_mode is None else self.hpu_mode == "lazy"


class TreeSettings(_Section):
    """``[tree]``: the static draft tree, a preset name (``naive_extend_57``, ``chain``...) or a file path."""

    name: Annotated[str, Strict(), StringConstraints(strip_whitespace=True, min_length=1),
                    Field(description="a non-empty string")]


def _key_type(option: MethodOption) -> Any:
    """A `[method]` key's type from the option's declaration (runtime.config.method_options)."""
    if option.choices is not None:
        return _choice(option.choices)
    if option.kind is bool:
        return _BOOLEAN
    if option.kind is int:
        return _integer(int(option.low if option.low is not None else -(2**63)),
                        None if option.high is None else int(option.high))
    return _real(option.low if option.low is not None else -math.inf,
                 option.high if option.high is not None else math.inf, low_open=option.low_open,
                 high_open=option.high_open)


class _MethodTable(_Section):
    def pinned(self) -> dict[str, Any]:
        """The parameters this profile sets, without ``name``: ``{"top_k_draft": 10, ...}``."""
        return self.model_dump(exclude={"name"}, exclude_none=True)


# ``[method]``: the decoding method and any parameters the profile pins (None = not pinned); the
# keys, their types and ranges are the method options a profile may pin (`MethodOption.profile`).
MethodSettings = create_model(
    "MethodSettings", __base__=_MethodTable, __module__=__name__,
    name=(_choice(METHODS), ...),
    **{o.name: (_key_type(o), None) for o in METHOD_OPTIONS if o.profile},
)


class BenchSettings(_Section):
    """``[bench]``: untimed warm-up runs (graph capture, compilation) and timed repeats."""

    warmup: _integer(0)
    repeats: _integer(1)


class RoofSettings(_Section):
    """``[roof]``: this machine's measured peaks for the roofline floor of each phase (``runtime
    tune`` writes them on a CPU, where no vendor table applies): memory bandwidth in GB/s and the
    dense matmul rate in TFLOP/s in the profile's dtype, and how they were measured."""

    bandwidth_gbs: _real(0.0, low_open=True)
    matmul_tflops: _real(0.0, low_open=True)
    source: Annotated[str, Strict(), Field(description="a string")] = ""


_FIGURES = ("class_accuracy", "fd", "precision", "recall")
_FIGURE = Annotated[Literal[_FIGURES], Field(description="one of " + ", ".join(f"'{f}'" for f in _FIGURES))]


class QualitySettings(_Section):
    """``[quality]``: the relaxation ``runtime tune --quality-budget`` measured fastest among those
    whose quality stayed within ``budget`` times the AR-vs-AR band on every figure, at ``images``
    images judged by ``features``; ``vs_ar`` holds each figure's paired difference from AR as
    [value, lo, hi] (95 % interval), ``band`` the AR-vs-AR band it was judged against.
    ``--method auto`` and ``runtime serve`` run lantern++ with this relaxation instead of the
    exact rule (they take only settings measured within a budget)."""

    budget: _real(0.0, low_open=True)
    images: _integer(2)
    features: Annotated[str, Strict(), Field(description="a string")]
    relax_rule: _choice(("paper", "bounded"))
    lantern_lambda: _real(1.0)
    speedup: _real(0.0, low_open=True)
    band: Annotated[dict[_FIGURE, _real(0.0)], Field(description="a table of figure -> band")]
    vs_ar: Annotated[dict[_FIGURE, Annotated[list[float], Field(min_length=3, max_length=3)]],
                     Field(description="a table of figure -> [value, lo, hi]")]


# Methods `--method auto` may pick: lossless ones (each image's law is the target's whatever is
# picked; lantern++ runs with lambda 1, its exact tree, unless a [quality] table names a relaxation
# measured within a quality budget).
AUTO_METHODS: tuple[str, ...] = tuple(d.name for d in METHOD_DECLS if d.auto)  # lantern: relaxed by design


class AutoSettings(_Section):
    """``[auto]``: the fastest lossless method at each batch occupancy, as `runtime tune` measured
    it: ``by_occupancy = { 1 = "lantern++", 8 = "ar" }`` (images decoding together -> method).
    `--method auto` takes the entry of the largest occupancy not above the current one."""

    by_occupancy: Annotated[dict[Annotated[str, StringConstraints(pattern=r"^[1-9][0-9]*$")], _choice(AUTO_METHODS)],
                            Field(min_length=1, description="a table of occupancy (1, 2, ...) -> one of "
                                  + ", ".join(f"'{m}'" for m in AUTO_METHODS))]
    # the same for a model the backend calls memory-bound (`Backend.memory_bound`: on a CPU, weights
    # beyond twice its last-level cache), where a verify of a few tokens costs about one step
    memory_bound: Annotated[dict[Annotated[str, StringConstraints(pattern=r"^[1-9][0-9]*$")], _choice(AUTO_METHODS)],
                            Field(min_length=1, description="a table of occupancy (1, 2, ...) -> one of "
                                  + ", ".join(f"'{m}'" for m in AUTO_METHODS))] | None = None

    def for_model(self, memory_bound: bool) -> "AutoSettings":
        """The table for a model: `memory_bound`'s where the model is and the profile has one."""
        if memory_bound and self.memory_bound is not None:
            return AutoSettings(by_occupancy=self.memory_bound)
        return self

    def method_for(self, occupancy: int) -> str:
        """The method for `occupancy` images decoding together."""
        table = sorted((int(k), v) for k, v in self.by_occupancy.items())
        chosen = table[0][1]
        for at, method in table:
            if at <= max(occupancy, 1):
                chosen = method
        return chosen

    @property
    def methods(self) -> list[str]:
        """The distinct methods of the table, in occupancy order."""
        seen: list[str] = []
        for _, method in sorted((int(k), v) for k, v in self.by_occupancy.items()):
            if method not in seen:
                seen.append(method)
        return seen


class _ProfileFile(_Section):
    """A whole profile file: its top-level keys."""

    description: Annotated[str, Strict(), Field(description="a string")] = ""
    device: DeviceSettings
    tree: TreeSettings
    method: MethodSettings
    bench: BenchSettings
    auto: AutoSettings | None = None
    roof: RoofSettings | None = None
    quality: QualitySettings | None = None


class Profile(_ProfileFile):
    """One validated hardware profile, named ``name``; ``source`` is where it was read from (for messages)."""

    name: str
    source: str

    def to_dict(self) -> dict[str, Any]:
        """Plain data for ``result.json``: ``{"name", "source", "description", "device", ...}``."""
        return {"name": self.name, "source": self.source, **self.model_dump(exclude={"name", "source"})}


def _looks_like_path(value: str | Path) -> bool:
    text = str(value)
    return isinstance(value, Path) or "/" in text or "\\" in text or Path(text).suffix in {".json", ".toml", ".txt", ".py"}


def _describe(err: ValidationError) -> str:
    """The first error as the message after ``<file>: ``, naming the key as ``section.key``."""
    # Unknown keys first (top level, then sections): a misspelt key also leaves its intended key missing.
    first = min(err.errors(include_url=False), key=lambda e: (len(e["loc"]), e["type"] != "extra_forbidden"))
    loc, kind = first["loc"], first["type"]
    key = ".".join(str(part) for part in loc if part != "[key]")
    model = _ProfileFile if len(loc) == 1 else _ProfileFile.model_fields[str(loc[0])].annotation
    model = next((a for a in typing.get_args(model) if isinstance(a, type) and issubclass(a, BaseModel)), model)
    if len(loc) > 2:  # inside a table-valued key (auto.by_occupancy.<occupancy>): the key's own description
        loc = loc[:2]
    if kind == "extra_forbidden":
        return f"unknown key '{key}' (known: {', '.join(model.model_fields)})"
    if kind == "missing":
        return f"missing section [{key}]" if len(loc) == 1 else f"missing key '{key}'"
    if kind == "model_type":
        return f"'{key}' must be a table ([{key}])"
    return f"'{key}' must be {model.model_fields[str(loc[-1])].description}, got {first['input']!r}"


def parse_profile(text: str, *, source: str, name: str, base_dir: Path | None = None) -> Profile:
    """Validate TOML ``text`` into a :class:`Profile`; ``source`` names the file in every error.

    A tree given as a relative path is resolved against ``base_dir`` (the profile's folder).
    """
    try:
        data = _ProfileFile.model_validate(tomllib.loads(text))
    except tomllib.TOMLDecodeError as err:
        raise UserError(f"{source}: not valid TOML ({err})") from None
    except ValidationError as err:
        raise UserError(f"{source}: {_describe(err)}") from None
    tree = data.tree
    if base_dir is not None and _looks_like_path(tree.name) and not Path(tree.name).is_absolute():
        tree = TreeSettings(name=str(base_dir / tree.name))
    return Profile(**{**dict(data), "tree": tree}, name=name, source=source)


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
    if _looks_like_path(name_or_path):
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
