"""Every method and sampling option, declared once (pure data, no torch).

One `MethodOption` per option: its name (the `MethodSpec` / `SamplingParams` field, the profile's
`[method]` key and the `runtime bench --methods METHOD:KEY=VALUE` key), its type and range, its
help text and `--help` panel, and the methods that read it. Everything that lists options is
generated from `METHOD_OPTIONS`:

- the command-line options of `runtime run`, `bench`, `tune` and `sample`
  (`runtime.cli.options.with_method_options`), grouped by panel, with their readers;
- `MethodFlags`, the options as given (None = not given), and `FLAG_METHODS`, which lets
  `runtime.generation.settings.resolve_spec` refuse a flag none of a run's methods reads;
- `OPTION_TYPES`, the per-entry options of `runtime bench --methods`;
- the profile's `[method]` keys and their ranges (`runtime.config.profiles.MethodSettings`).

Adding an option: declare it here, add the field to `MethodSpec` (or `SamplingParams`) where it
is used, and test it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, make_dataclass
from enum import StrEnum
from typing import Any


class Drafting(StrEnum):
    """How a method drafts (its policy, `runtime.core.policies.POLICIES`): nothing (ar), a static
    drafter tree, EAGLE-2's dynamic tree, sjd's Jacobi window, pjd's window plus rows."""

    NONE = "none"
    STATIC = "static"
    DYNAMIC = "dynamic"
    JACOBI = "jacobi"
    PJD = "pjd"


class RelaxKind(StrEnum):
    """A relaxation of acceptance: none (exact), delta (LANTERN, additive), lambda (LANTERN++),
    anneal (COOL-SD: min(1, w_d p/q) with w_d decaying with the node's depth d)."""

    NONE = "none"
    DELTA = "delta"
    LAMBDA = "lambda"
    ANNEAL = "anneal"


class AcceptKind(StrEnum):
    """An --accept rule: exact, grouped (GSD-style, sjd) or published (pjd's released loop)."""

    EXACT = "exact"
    GROUPED = "grouped"
    PUBLISHED = "published"


RELAX_RULES: tuple[str, ...] = ("paper", "bounded")
# a relaxed rule's residual on rejection: the rule's own, or the one minimising COOL-SD's TV bound
RESIDUALS: tuple[str, ...] = ("rule", "tv-optimal")
JACOBI_INITS: tuple[str, ...] = ("uniform", "repeat-h", "repeat-v")
COUPLINGS: tuple[str, ...] = ("none", "maximal", "gumbel")
ACCEPT_RULES: tuple[str, ...] = tuple(AcceptKind)
# the largest trees a captured step holds (nodes after the root, levels)
MAX_TREE_NODES = 1024
MAX_TREE_DEPTH = 32
# EAGLE-2 expands top_k children of each of its top_k frontier nodes: top_k^2 candidates a level
MAX_TOP_K_DRAFT = 64
MAX_WINDOW = 64

@dataclass(frozen=True)
class MethodDecl:
    """A method as data: the facts the core, the CLI, profiles, selfcheck and result files read.

    drafting    the policy it builds (`runtime.core.policies.POLICIES`): none, static (a drafter
                tree), dynamic (EAGLE-2's), jacobi (sjd's window), pjd (the window plus rows)
    relaxation  the relaxation its own flags turn on: none, delta (additive), lambda
    auto        `--method auto` may pick it: it runs lossless (at lambda 1 where it relaxes)
    tree        a static tree's source: "chain" (a chain of --depth) or "option" (--tree)
    expansions  a dynamic tree's count of expansions: the option holding it
    checks      its draft depth is decided by a heuristic read between expansions (ddd)
    accepts     the --accept rules it takes (`accept_note`: why others are missing)
    out_of_order  those of its --accept rules that commit tokens out of raster order, which run
                in their own loop (`runtime.core.slots`: PublishedPJD) instead of the shared one
    chooses_relaxation  a relaxation may be chosen for it (--lantern-delta / --lantern-lambda
                on a method whose own relaxation is none: sjd)
    records     what a result file records for it beside the sampling settings, in order
                ("relax": the relaxation in effect); a chosen relaxation's settings and
                grouped acceptance's are recorded when they are in effect
    """

    name: str
    drafting: Drafting
    relaxation: RelaxKind
    summary: str
    auto: bool = True
    tree: str | None = None
    expansions: str | None = None
    checks: bool = False
    accepts: tuple[AcceptKind, ...] = (AcceptKind.EXACT,)
    out_of_order: tuple[AcceptKind, ...] = ()
    accept_note: str = ""  # why a rule it lacks is missing, said when one is asked for
    chooses_relaxation: bool = False
    records: tuple[str, ...] = ()

    @property
    def needs_drafter(self) -> bool:
        """Whether it drafts with a trained drafter head (a static or a dynamic tree)."""
        return self.drafting in (Drafting.STATIC, Drafting.DYNAMIC)


_EAGLE = ("top_k_draft", "total_tokens")
METHOD_DECLS: tuple[MethodDecl, ...] = (
    MethodDecl("ar", Drafting.NONE, RelaxKind.NONE, "one token per target forward"),
    MethodDecl("sd", Drafting.STATIC, RelaxKind.NONE, "a drafter chain of --depth tokens, exact", tree="chain",
               records=("depth",)),
    MethodDecl("eagle2", Drafting.DYNAMIC, RelaxKind.NONE, "EAGLE-2 dynamic tree, exact", expansions="depth",
               records=_EAGLE),
    MethodDecl("ddd", Drafting.DYNAMIC, RelaxKind.NONE, "EAGLE-2 tree whose depth is decided per iteration, exact",
               expansions="ddd_max_depth", checks=True,
               records=(*_EAGLE, "ddd_threshold", "ddd_check_every", "ddd_min_depth")),
    MethodDecl("lantern", Drafting.DYNAMIC, RelaxKind.DELTA,
               "EAGLE-2 dynamic tree, relaxed by an additive bound delta", auto=False,
               expansions="depth", records=(*_EAGLE, "lantern_k", "lantern_delta", "relax_rule")),
    MethodDecl("lantern++", Drafting.STATIC, RelaxKind.LAMBDA, "static tree, relaxed by a multiplicative bound lambda",
               tree="option", records=("tree", "lantern_k", "lantern_lambda", "relax_rule")),
    MethodDecl("cool-sd", Drafting.STATIC, RelaxKind.ANNEAL, "static tree, COOL-SD's annealed acceptance "
               "min(1, w_d p/q)", auto=False, tree="option", records=("tree", "cool_delta", "cool_nu", "cool_mu")),
    MethodDecl("cool-eagle2", Drafting.DYNAMIC, RelaxKind.ANNEAL, "EAGLE-2 dynamic tree, COOL-SD's annealed "
               "acceptance", auto=False, expansions="depth", records=(*_EAGLE, "cool_delta", "cool_nu", "cool_mu")),
    MethodDecl("sjd", Drafting.JACOBI, RelaxKind.NONE,
               "Jacobi window, no drafter; exact, relaxed (--relax) or grouped",
               accepts=(AcceptKind.EXACT, AcceptKind.GROUPED), chooses_relaxation=True,
               records=("window", "init", "coupling", "proactive", "accept", "relax")),
    MethodDecl("pjd", Drafting.PJD, RelaxKind.NONE, "Jacobi windows over several image rows in one forward, no "
               "drafter; exact, or the released code's loop (--accept published, lossy)",
               accepts=(AcceptKind.EXACT, AcceptKind.PUBLISHED), out_of_order=(AcceptKind.PUBLISHED,),
               records=("pjd_window", "pjd_rows", "init", "accept")),
)
METHOD_TABLE: dict[str, MethodDecl] = {d.name: d for d in METHOD_DECLS}
BASELINE = "ar"  # the method every speedup is measured against (one target forward per token)
METHODS: tuple[str, ...] = tuple(d.name for d in METHOD_DECLS)

SAMPLING_PANEL = "Method and sampling (every method)"
DRAFTING_PANEL = "Drafting (read by the methods named)"
RELAXED_PANEL = "Relaxed acceptance (read by the methods named)"
SJD_PANEL = "sjd only"
PJD_PANEL = "pjd only"
# the released PJD code's window_size: tokens verified per row, its leading token included
MAX_PJD_ROWS = 16
DDD_PANEL = "ddd only"


@dataclass(frozen=True)
class MethodOption:
    """One option. `readers`: the methods that read it (None: every method, as the sampling
    options). `help` may hold `{readers}`. `default`: the code default (the `MethodSpec` /
    `SamplingParams` field's; a profile or the model may set another). `low` / `high`
    (`low_open` / `high_open`: excluded) and `choices` bound the value, wherever it comes from
    (`refusal`; `MethodSpec` checks every option with it); `profile`: a profile's [method]
    table may pin it."""

    name: str
    kind: type
    help: str
    panel: str
    readers: frozenset[str] | None = None
    default: Any = None
    flag: str | None = None  # default: --name-with-dashes
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    choices: tuple[str, ...] | None = None
    profile: bool = True  # a profile's [method] table may pin it
    per_entry: bool = True  # a `runtime bench --methods METHOD:KEY=VALUE` key
    short: str | None = None  # its name in a run's label (`k=1000 lambda=2`); None: not in labels

    @property
    def cli_flag(self) -> str:
        return self.flag or "--" + self.name.replace("_", "-")

    @property
    def cli_help(self) -> str:
        text = self.help.format(readers=readers(self.name)) if self.readers is not None else self.help
        if self.kind is bool:
            return text
        shown = "off" if self.default is None else self.default
        return f"{text} [code default: {shown}]"

    @property
    def range_text(self) -> str:
        """The allowed values in words: "in [1, 32]", "> 0", "one of a, b"."""
        if self.choices is not None:
            return "one of " + ", ".join(self.choices)
        low, high = self.low, self.high
        if low is not None and high is not None and math.isfinite(low):
            return f"in {'(' if self.low_open else '['}{low:g}, {high:g}{')' if self.high_open else ']'}"
        if high is not None:
            return f"{'<' if self.high_open else '<='} {high:g}"
        if low is not None:
            return f"{'>' if self.low_open else '>='} {low:g}"
        return "any value"

    def refusal(self, value: Any) -> str | None:
        """The one line refusing `value` for this option (None: it is allowed): a number must be
        finite and within [low, high] (open ends excluded), a choice one of `choices`."""
        if value is None:
            return None
        if self.choices is not None:
            return None if value in self.choices else f"{self.cli_flag} must be {self.range_text}, got {value!r}"
        if self.kind in (int, float) and not isinstance(value, bool) and isinstance(value, (int, float)):
            bad = not math.isfinite(value)
            if self.low is not None and (value < self.low or (self.low_open and value == self.low)):
                bad = True
            if self.high is not None and (value > self.high or (self.high_open and value == self.high)):
                bad = True
            if bad:
                noun = "an integer" if self.kind is int else "a finite number"
                return f"{self.cli_flag} must be {noun} {self.range_text}, got {value}"
        return None


def _only(*methods: str) -> frozenset[str]:
    return frozenset(methods)


METHOD_OPTIONS: tuple[MethodOption, ...] = (
    # -- sampling: every method ----------------------------------------------------------------
    MethodOption("greedy", bool, "Greedy decoding instead of sampling.", SAMPLING_PANEL, default=False,
                 flag="--greedy/--sample", per_entry=False),
    MethodOption("temperature", float, "Sampling temperature.", SAMPLING_PANEL, default=1.0, low=0.0, low_open=True,
                 per_entry=False),
    MethodOption("top_k", int, "Target top-k filter (0 = off).", SAMPLING_PANEL, default=0, low=0, per_entry=False),
    MethodOption("top_p", float, "Target nucleus filter (1 = off).", SAMPLING_PANEL, default=1.0, low=0.0, high=1.0,
                 low_open=True, per_entry=False),
    MethodOption("cfg", float, "Classifier-free guidance scale (<= 1 = off).", SAMPLING_PANEL, default=1.0, low=0.0,
                 per_entry=False),
    MethodOption("cfg_interval", int, "LlamaGen's cfg_interval: -1 = guide every token; N >= 0 = no guidance "
                 "after decode step N (needs --cfg > 1).", SAMPLING_PANEL, default=-1, low=-1, per_entry=False),
    # -- drafting and relaxed acceptance -------------------------------------------------------
    MethodOption("tree", str, "Static tree: a preset (naive_extend_57, mc_sim_7b_63, chain, small_12), chainN, or "
                 "a TOML file. Read by: {readers}.", DRAFTING_PANEL, _only("lantern++", "cool-sd"), default="naive_extend_57",
                 profile=False, short="tree"),
    MethodOption("lantern_k", int, "Nearest codebook neighbours considered for the proximity set. Read by: "
                 "{readers}.", RELAXED_PANEL, _only("lantern", "lantern++", "sjd"), default=1000, low=1, short="k"),
    MethodOption("lantern_delta", float, "LANTERN total-variation budget (0 = exact). Read by: {readers}.",
                 RELAXED_PANEL, _only("lantern", "sjd"), default=0.1, low=0.0, high=1.0, short="delta"),
    MethodOption("lantern_lambda", float, "LANTERN++ multiplicative bound (1 = exact). Read by: {readers}.",
                 RELAXED_PANEL, _only("lantern++", "sjd"), default=2.0, low=1.0, short="lambda"),
    MethodOption("relax_rule", str, "paper (the reference LANTERN code's acceptance) or bounded (each "
                 "step's output within the stated TVD bound). Read by: {readers} (sjd: with a relaxation).",
                 RELAXED_PANEL, _only("lantern", "lantern++", "sjd"), default="paper", choices=RELAX_RULES,
                 short="rule"),
    MethodOption("residual", str, "What a rejection samples from: rule (the relax rule's own residual) or "
                 "tv-optimal (COOL-SD's G* = norm([p - q f]_+), f the acceptance function: the exact rule's "
                 "residual, no codes cleared; with --relax-rule paper). Read by: {readers}.", RELAXED_PANEL,
                 _only("lantern", "lantern++"), default="rule", choices=RESIDUALS, short="residual"),
    MethodOption("cool_delta", float, "COOL-SD's delta: the mean of w_d over the tree's depths (1 with --cool-nu 0 "
                 "= exact). Read by: {readers}.", RELAXED_PANEL, _only("cool-sd", "cool-eagle2"), default=1.1,
                 low=0.0, low_open=True, high=64.0, short="cdelta"),
    MethodOption("cool_nu", float, "COOL-SD's decay: w_d = delta exp(-nu d - mu) at depth d (0 = uniform). "
                 "Read by: {readers}.", RELAXED_PANEL, _only("cool-sd", "cool-eagle2"), default=0.7, low=0.0,
                 high=16.0, short="nu"),
    MethodOption("cool_mu", float, "COOL-SD's offset mu; unset: mu = log(mean over d = 1..L of exp(-nu d)) for "
                 "the tree's L levels, so delta is the mean of w_d (our reading: the paper leaves mu undefined). "
                 "Read by: {readers}.", RELAXED_PANEL, _only("cool-sd", "cool-eagle2"), low=-16.0, high=16.0,
                 short="mu"),
    MethodOption("depth", int, "Chain length (sd) or EAGLE-2 tree depth. Read by: {readers}.", DRAFTING_PANEL,
                 _only("sd", "eagle2", "lantern", "cool-eagle2"), default=4, low=1, high=MAX_TREE_DEPTH, short="depth"),
    MethodOption("top_k_draft", int, "EAGLE-2 children per expanded node. Read by: {readers}.", DRAFTING_PANEL,
                 _only("eagle2", "ddd", "lantern", "cool-eagle2"), default=10, low=1, high=MAX_TOP_K_DRAFT,
                 short="topk"),
    MethodOption("total_tokens", int, "EAGLE-2 verified tokens per step (root included). Read by: {readers}.",
                 DRAFTING_PANEL, _only("eagle2", "ddd", "lantern", "cool-eagle2"), default=59, low=2, high=MAX_TREE_NODES + 1,
                 short="total"),
    # -- sjd -------------------------------------------------------------------------------------
    MethodOption("window", int, "sjd: draft window length L.", SJD_PANEL, _only("sjd"), default=16, low=1,
                 high=MAX_WINDOW, profile=False, short="window"),
    MethodOption("init", str, "sjd, pjd: prior of fresh window positions: uniform, repeat-h (token to the left) "
                 "or repeat-v (token above).", SJD_PANEL, _only("sjd", "pjd"), default="repeat-v", choices=JACOBI_INITS,
                 profile=False, short="init"),
    MethodOption("coupling", str, "sjd: how stale drafts are redrafted: none, maximal or gumbel.",
                 SJD_PANEL, _only("sjd"), default="none", choices=COUPLINGS, profile=False, short="coupling"),
    MethodOption("proactive", str, "sjd: K,D = a K-ary tree of depth D drafted at the start of the window "
                 "(SJD-PAC style).", SJD_PANEL, _only("sjd"), profile=False, short="proactive"),
    MethodOption("accept", str, "sjd: exact or grouped (GSD-style, lossy; its TVD bound is reported); pjd: "
                 "exact, or published (the released code's loop: every row commits, ahead of the raster "
                 "frontier; lossy, see docs/methods.md).",
                 SJD_PANEL, _only("sjd", "pjd"), default="exact", choices=ACCEPT_RULES, profile=False, short="accept"),
    MethodOption("group_window", int, "--accept grouped: rank window on each side of the draft.",
                 SJD_PANEL, _only("sjd"), default=7, low=1, profile=False, short="gwindow"),
    MethodOption("group_gap", float, "--accept grouped: largest probability gap to the draft.",
                 SJD_PANEL, _only("sjd"), default=0.15, low=0.0, low_open=True, profile=False, short="ggap"),
    MethodOption("group_dist", float, "--accept grouped: largest squared distance of normalised embedding rows.",
                 SJD_PANEL, _only("sjd"), default=0.5, low=0.0, low_open=True, profile=False, short="gdist"),
    # -- pjd (names after the released code: window_size, its rows) ----------------------------
    MethodOption("pjd_window", int, "pjd: tokens verified per row (the released code's window_size), the row's "
                 "leading token included: the frontier row drafts W - 1.", PJD_PANEL, _only("pjd"), default=8,
                 low=2, high=MAX_WINDOW, profile=False, short="pwindow"),
    MethodOption("pjd_rows", int, "pjd: rows verified per forward: the frontier and R - 1 lookahead rows below it; "
                 "--accept published: the most rows in flight (the released code has no cap: 16 never binds at "
                 "768 px).", PJD_PANEL,
                 _only("pjd"), default=4, low=1, high=MAX_PJD_ROWS, profile=False, short="prows"),
    # -- ddd -------------------------------------------------------------------------------------
    MethodOption("ddd_threshold", float, "ddd: stop drafting when log(sum of the beam's path probabilities) falls "
                 "below this (a log probability).", DDD_PANEL, _only("ddd"), default=-0.3, high=0.0, short="ddd"),
    MethodOption("ddd_check_every", int, "ddd: expansions between two checks of the heuristic (each check is one "
                 "host read).", DDD_PANEL, _only("ddd"), default=2, low=1, short="check"),
    MethodOption("ddd_min_depth", int, "ddd: expansions before the first check.", DDD_PANEL,
                 _only("ddd"), default=4, low=1, high=MAX_TREE_DEPTH, short="min"),
    MethodOption("ddd_max_depth", int, "ddd: most expansions.", DDD_PANEL, _only("ddd"), default=10, low=1,
                 high=MAX_TREE_DEPTH),
    MethodOption("dynamic_depth", float, "Cut the static tree at the first depth whose best drafted "
                 "path probability is below this threshold (e.g. 0.2). Read by: {readers}.",
                 DRAFTING_PANEL, _only("sd", "lantern++", "cool-sd"), low=0.0, high=1.0, high_open=True, short="dyn"),
)

OPTIONS_BY_NAME: dict[str, MethodOption] = {o.name: o for o in METHOD_OPTIONS}
# Which methods read each method flag (the sampling flags are read by every method).
FLAG_METHODS: dict[str, frozenset[str]] = {o.name: o.readers for o in METHOD_OPTIONS if o.readers is not None}
# Types of the options `runtime bench --methods` takes per entry (`sjd:coupling=maximal`).
OPTION_TYPES: dict[str, type] = {o.name: o.kind for o in METHOD_OPTIONS if o.per_entry}
SAMPLING_KEYS: tuple[str, ...] = tuple(o.name for o in METHOD_OPTIONS if o.readers is None)


def default(name: str) -> Any:
    """The code default of option `name` (what `MethodSpec` / `SamplingParams` start from)."""
    return OPTIONS_BY_NAME[name].default


def readers(key: str) -> str:
    """The methods reading flag `key`, in the CLI's method order: "sd, lantern++"."""
    return ", ".join(m for m in METHODS if m in FLAG_METHODS[key])


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
