"""Every method and sampling option, declared once (pure data, no torch).

One `MethodOption` per option: its name (the `MethodSpec` / `SamplingParams` field, the profile's
`[method]` key and the `runtime bench --methods METHOD:KEY=VALUE` key), its type and range, its
help text and `--help` panel, and the methods that read it. Everything that lists options is
generated from `METHOD_OPTIONS`:

- the command-line options of `runtime run`, `bench`, `tune` and `sample`
  (`runtime.cli.options.with_method_options`), grouped by panel, with their readers;
- `MethodFlags`, the options as given (None = not given), and `FLAG_METHODS`, which lets
  `runtime.settings.resolve_spec` refuse a flag none of a run's methods reads;
- `OPTION_TYPES`, the per-entry options of `runtime bench --methods`;
- the profile's `[method]` keys and their ranges (`runtime.profiles.MethodSettings`).

Adding an option: declare it here, add the field to `MethodSpec` (or `SamplingParams`) where it
is used, and test it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, make_dataclass
from typing import Any

METHOD_ORDER = ("ar", "sd", "eagle2", "ddd", "lantern", "lantern++", "sjd")
RELAX_RULES: tuple[str, ...] = ("paper", "bounded")

SAMPLING_PANEL = "Method and sampling (every method)"
DRAFTING_PANEL = "Drafting (read by the methods named)"
RELAXED_PANEL = "Relaxed acceptance (read by the methods named)"
SJD_PANEL = "sjd only"
DDD_PANEL = "ddd only"


@dataclass(frozen=True)
class MethodOption:
    """One option. `readers`: the methods that read it (None: every method, as the sampling
    options). `help` may hold `{readers}`. `low` / `high` (`low_open`: low excluded) and
    `choices` bound the value where a profile may pin it (`profile`)."""

    name: str
    kind: type
    help: str
    panel: str
    readers: frozenset[str] | None = None
    flag: str | None = None  # default: --name-with-dashes
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    choices: tuple[str, ...] | None = None
    profile: bool = True  # a profile's [method] table may pin it
    per_entry: bool = True  # a `runtime bench --methods METHOD:KEY=VALUE` key

    @property
    def cli_flag(self) -> str:
        return self.flag or "--" + self.name.replace("_", "-")

    @property
    def cli_help(self) -> str:
        return self.help.format(readers=readers(self.name)) if self.readers is not None else self.help


def _only(*methods: str) -> frozenset[str]:
    return frozenset(methods)


METHOD_OPTIONS: tuple[MethodOption, ...] = (
    # -- sampling: every method ----------------------------------------------------------------
    MethodOption("greedy", bool, "Greedy decoding instead of sampling.", SAMPLING_PANEL, flag="--greedy/--sample",
                 per_entry=False),
    MethodOption("temperature", float, "Sampling temperature.", SAMPLING_PANEL, low=0.0, low_open=True,
                 per_entry=False),
    MethodOption("top_k", int, "Target top-k filter (0 = off).", SAMPLING_PANEL, low=0, per_entry=False),
    MethodOption("top_p", float, "Target nucleus filter (1 = off).", SAMPLING_PANEL, low=0.0, high=1.0,
                 low_open=True, per_entry=False),
    MethodOption("cfg", float, "Classifier-free guidance scale (<= 1 = off).", SAMPLING_PANEL, low=0.0,
                 per_entry=False),
    MethodOption("cfg_interval", int, "LlamaGen's cfg_interval: -1 = guide every token; N >= 0 = no guidance "
                 "after decode step N (needs --cfg > 1).", SAMPLING_PANEL, low=-1, per_entry=False),
    # -- drafting and relaxed acceptance -------------------------------------------------------
    MethodOption("tree", str, "Static tree: a preset (naive_extend_57, mc_sim_7b_63, chain, small_12), chainN, or "
                 "a TOML file. Read by: {readers}.", DRAFTING_PANEL, _only("lantern++"), profile=False),
    MethodOption("lantern_k", int, "Nearest codebook neighbours considered for the proximity set. Read by: "
                 "{readers}.", RELAXED_PANEL, _only("lantern", "lantern++", "sjd"), low=1),
    MethodOption("lantern_delta", float, "LANTERN total-variation budget (0 = exact). Read by: {readers}.",
                 RELAXED_PANEL, _only("lantern", "sjd"), low=0.0, high=1.0),
    MethodOption("lantern_lambda", float, "LANTERN++ multiplicative bound (1 = exact). Read by: {readers}.",
                 RELAXED_PANEL, _only("lantern++", "sjd"), low=1.0),
    MethodOption("relax_rule", str, "paper (default: the reference LANTERN code's acceptance) or bounded (each "
                 "step's output within the stated TVD bound). Read by: {readers} (sjd: with a relaxation).",
                 RELAXED_PANEL, _only("lantern", "lantern++", "sjd"), choices=RELAX_RULES),
    MethodOption("depth", int, "Chain length (sd) or EAGLE-2 tree depth. Read by: {readers}.", DRAFTING_PANEL,
                 _only("sd", "eagle2", "lantern"), low=1),
    MethodOption("top_k_draft", int, "EAGLE-2 children per expanded node. Read by: {readers}.", DRAFTING_PANEL,
                 _only("eagle2", "ddd", "lantern"), low=1),
    MethodOption("total_tokens", int, "EAGLE-2 verified tokens per step (root included). Read by: {readers}.",
                 DRAFTING_PANEL, _only("eagle2", "ddd", "lantern"), low=2),
    # -- sjd -------------------------------------------------------------------------------------
    MethodOption("window", int, "sjd: draft window length L (default 16).", SJD_PANEL, _only("sjd"),
                 profile=False),
    MethodOption("init", str, "sjd: prior of fresh window positions: uniform, repeat-h (token to the left) or "
                 "repeat-v (token above; default).", SJD_PANEL, _only("sjd"), profile=False),
    MethodOption("coupling", str, "sjd: how stale drafts are redrafted: none (default), maximal or gumbel.",
                 SJD_PANEL, _only("sjd"), profile=False),
    MethodOption("proactive", str, "sjd: K,D = a K-ary tree of depth D drafted at the start of the window "
                 "(SJD-PAC style).", SJD_PANEL, _only("sjd"), profile=False),
    MethodOption("accept", str, "sjd: exact (default) or grouped (GSD-style, lossy; its TVD bound is reported).",
                 SJD_PANEL, _only("sjd"), profile=False),
    MethodOption("group_window", int, "--accept grouped: rank window on each side of the draft (default 7).",
                 SJD_PANEL, _only("sjd"), profile=False),
    MethodOption("group_gap", float, "--accept grouped: largest probability gap to the draft (default 0.15).",
                 SJD_PANEL, _only("sjd"), profile=False),
    MethodOption("group_dist", float, "--accept grouped: largest squared distance of normalised embedding rows "
                 "(default 0.5).", SJD_PANEL, _only("sjd"), profile=False),
    # -- ddd -------------------------------------------------------------------------------------
    MethodOption("ddd_threshold", float, "ddd: stop drafting when log(sum of the beam's path probabilities) falls "
                 "below this (default -0.3).", DDD_PANEL, _only("ddd"), low=-math.inf, high=0.0, low_open=True),
    MethodOption("ddd_check_every", int, "ddd: expansions between two checks of the heuristic (default 2; each "
                 "check is one host read).", DDD_PANEL, _only("ddd"), low=1),
    MethodOption("ddd_min_depth", int, "ddd: expansions before the first check (default 4).", DDD_PANEL,
                 _only("ddd"), low=1),
    MethodOption("ddd_max_depth", int, "ddd: most expansions (default 10).", DDD_PANEL, _only("ddd"), low=1),
    MethodOption("dynamic_depth", float, "sd/lantern++: cut the static tree at the first depth whose best drafted "
                 "path probability is below this threshold (e.g. 0.2); off by default. Read by: {readers}.",
                 DRAFTING_PANEL, _only("sd", "lantern++"), low=0.0, high=1.0),
)

OPTIONS_BY_NAME: dict[str, MethodOption] = {o.name: o for o in METHOD_OPTIONS}
# Which methods read each method flag (the sampling flags are read by every method).
FLAG_METHODS: dict[str, frozenset[str]] = {o.name: o.readers for o in METHOD_OPTIONS if o.readers is not None}
# Types of the options `runtime bench --methods` takes per entry (`sjd:coupling=maximal`).
OPTION_TYPES: dict[str, type] = {o.name: o.kind for o in METHOD_OPTIONS if o.per_entry}
SAMPLING_KEYS: tuple[str, ...] = tuple(o.name for o in METHOD_OPTIONS if o.readers is None)


def readers(key: str) -> str:
    """The methods reading flag `key`, in the CLI's method order: "sd, lantern++"."""
    return ", ".join(m for m in METHOD_ORDER if m in FLAG_METHODS[key])


class _Flags:
    """The options as given (None = not given)."""

    @classmethod
    def pick(cls, params: dict[str, Any]) -> "_Flags":
        """The method options among a command's parameters."""
        return cls(**{f.name: params.get(f.name) for f in fields(cls)})  # type: ignore[call-arg]

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}  # type: ignore[arg-type]


MethodFlags = make_dataclass("MethodFlags", [(o.name, "Any", field(default=None)) for o in METHOD_OPTIONS],
                             bases=(_Flags,))
MethodFlags.__module__ = __name__
MethodFlags.__doc__ = "The method and sampling options as given (None = not given), one field per `METHOD_OPTIONS` entry."
