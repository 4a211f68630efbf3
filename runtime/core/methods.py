"""Decoding methods as data: a drafting policy x an acceptance rule.

    method     drafting                          acceptance
    ar         none (one token per forward)      -
    sd         static chain of `depth`           exact
    eagle2     EAGLE-2 dynamic tree              exact
    lantern    EAGLE-2 dynamic tree              relaxed, additive bound delta
    ddd        EAGLE-2 tree, dynamic depth       exact
    lantern++  static tree (`tree`)              relaxed, multiplicative bound lambda
    sjd        Jacobi window of `window` future  exact (default), relaxed (`relax` delta or
               positions, no drafter (jacobi.py) lambda), or grouped (`accept`, GSD-style)
    pjd        sjd's window plus `pjd_rows` - 1  exact; or `accept` published: the released
               lookahead rows (pjd.py)           code's loop, every row committing ahead of the
                                                 raster frontier (pjd_published.py, lossy)

With lantern_delta = 0 / lantern_lambda = 1 the relaxed methods are exact; COOL-SD (cool-sd on
a static tree, cool-eagle2 on EAGLE-2's) is exact where w_d = 1 at every depth (cool_delta 1,
cool_nu 0). Its rule and what was chosen where the paper is silent: relaxation.py.

`relax_rule` (lantern, lantern++, relaxed sjd): "paper" (default) is the reference LANTERN
code's acceptance, "bounded" the rule whose output stays within the stated TVD bound per
step (relaxation.py sets out both).

sjd options: `init` (prior of fresh window positions: uniform, repeat-h = the token to the
left, repeat-v = the token above), `coupling` (how the stale tail is redrafted: none = sample
the current p, maximal = keep the old draft with probability min(1, p/q), gumbel =
position-keyed Gumbel noise), `proactive` (K, D): a K-ary tree of depth D drafted at the
rejection point before the chain.

`depth` means what it means in the reference EAGLE-2 / LANTERN code for the dynamic trees:
the number of expansions after the root's own top-k, so the tree has depth + 1 levels and
top_k + depth * top_k^2 candidates (LANTERN's LlamaGen default depth 4 -> 5 levels). For
`sd` it is the length of the drafted chain.

ddd (Dynamic Depth Decoding, arXiv 2409.00142): EAGLE-2 whose number of expansions is decided
per iteration. After `ddd_min_depth` expansions, and then every `ddd_check_every`, the
heuristic H = log(sum over the top-k frontier of exp(path log q)) is compared with
`ddd_threshold`; drafting stops (for that image) once H < threshold, and never goes beyond
`ddd_max_depth` expansions. The paper's setting: threshold -0.3, checks before draft calls
5, 7, 9 of at most 11 (here: after expansions 4, 6 and 8 of at most 10).

dynamic_depth (sd, lantern++): a threshold on the drafted path's cumulative draft probability.
The static tree is drafted level by level; level d+1 is verified only while the best path
probability it can reach, max over level-d nodes of (product of q along the node's path) x
max q(. | node), is at least the threshold; the first level below it and everything deeper
are cut (level 1 is always verified). The cut is decided before the level it judges is
sampled, so sampling stays exact in law. None = off.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from runtime.core.sampling import SamplingParams
from runtime.utils.errors import UserError, did_you_mean
from runtime.config.method_options import (METHOD_OPTIONS, METHOD_TABLE, METHODS, OPTIONS_BY_NAME, AcceptKind, Drafting,
                                    MethodDecl, RelaxKind, default)


# A method is one declared row of `METHOD_TABLE` (runtime.config.method_options: its drafting policy, its
# own relaxation, whether --method auto may pick it, its tree, what result files record; `METHODS`
# are their names in order); the acceptance rule object follows from it and the sampling settings
# (`runtime.core.accept_rules.acceptance_rule`).
__all__ = ["METHOD_TABLE", "METHODS", "MethodSpec", "RELAXATIONS"]
RELAXATIONS: tuple[str, ...] = tuple(RelaxKind)


@dataclass(frozen=True)
class MethodSpec:
    method: str = "lantern++"
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # the code defaults, declared with the options (runtime.config.method_options)
    tree: str = default("tree")
    depth: int = default("depth")
    top_k_draft: int = default("top_k_draft")
    total_tokens: int = default("total_tokens")  # LANTERN's LlamaGen default (root included)
    lantern_k: int = default("lantern_k")
    lantern_delta: float = default("lantern_delta")
    lantern_lambda: float = default("lantern_lambda")
    # relaxation of sjd drafts ("none", "delta" or "lambda"); None = the method's own
    # (lantern: delta, lantern++: lambda, the others none)
    relax: str | None = None
    relax_rule: str = default("relax_rule")
    residual: str = default("residual")
    cool_delta: float = default("cool_delta")
    cool_nu: float = default("cool_nu")
    cool_mu: float | None = None  # None: mean-normalised (`runtime.core.relaxation.anneal_weights`)
    window: int = default("window")
    init: str = default("init")
    coupling: str = default("coupling")
    proactive: tuple[int, int] | None = None
    accept: str = default("accept")
    pjd_window: int = default("pjd_window")
    pjd_rows: int = default("pjd_rows")
    group_window: int = default("group_window")
    group_gap: float = default("group_gap")
    group_dist: float = default("group_dist")
    ddd_threshold: float = default("ddd_threshold")
    ddd_check_every: int = default("ddd_check_every")
    ddd_min_depth: int = default("ddd_min_depth")
    ddd_max_depth: int = default("ddd_max_depth")
    dynamic_depth: float | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise UserError(f"unknown method {self.method!r}{did_you_mean(self.method, METHODS)}; choose one of {', '.join(METHODS)}")
        # every declared option's range and choices (the declarations are the one statement of them)
        for option in METHOD_OPTIONS:
            owner = self.sampling if option.readers is None else self
            value = getattr(owner, option.name, None)
            if option.name == "proactive":  # a (K, D) pair here: checked with sjd's rules below
                continue
            refusal = option.refusal(value)
            if refusal is not None:
                raise UserError(refusal)
        # the rules between fields
        if self.relax is not None and self.relax not in RELAXATIONS:
            raise UserError(f"relax must be one of {', '.join(RELAXATIONS)}, got {self.relax!r}")
        if self.ddd_min_depth > self.ddd_max_depth:
            raise UserError(f"--ddd-min-depth {self.ddd_min_depth} exceeds --ddd-max-depth {self.ddd_max_depth}")
        self._check_jacobi()
        if self.drafting == Drafting.DYNAMIC:
            # ddd: the tree must fill up even when drafting stops at the first check
            least = self.ddd_min_depth if self.decl.checks else self.depth
            limit = self.top_k_draft + least * self.top_k_draft ** 2
            if self.total_tokens - 1 > limit:
                raise UserError(f"--total-tokens {self.total_tokens} exceeds the {limit + 1} nodes a "
                                f"depth-{least}, top-k-{self.top_k_draft} EAGLE-2 tree can hold")
        if self.residual == "tv-optimal" and (self.sampling.greedy or self.relaxation_kind == RelaxKind.NONE):
            why = "--greedy draws no residual" if self.sampling.greedy else "the relaxation is off (exact rule)"
            raise UserError(f"--residual tv-optimal does nothing here: {why}; drop --residual")
        if self.residual == "tv-optimal" and self.relax_rule == "bounded":
            raise UserError("--residual tv-optimal is for --relax-rule paper: the bounded rule's stages are exact "
                            "toward its relaxed target, so its residual is already the TV-optimal one there; drop "
                            "--residual or use --relax-rule paper")
        if self.dynamic_depth is not None and self.drafting != Drafting.STATIC:
            raise UserError(f"--dynamic-depth cuts a static tree (sd, lantern++), not --method {self.method}")

    def _check_jacobi(self) -> None:
        """Options that only mean something for some methods (or only in some combinations) are
        refused elsewhere, from the declarations: who reads them, which --accept rules a method
        takes, whether a relaxation may be chosen for it."""
        s, decl = self.sampling, self.decl
        for name, default_value in (("coupling", "none"), ("proactive", None)):
            readers = OPTIONS_BY_NAME[name].readers or frozenset()
            if self.method not in readers and getattr(self, name) != default_value:
                raise UserError(f"--{name} applies to --method {' / '.join(sorted(readers))} only "
                                f"(got --method {self.method})")
        if self.accept not in decl.accepts:
            raise UserError(f"--method {self.method} takes --accept {' or '.join(decl.accepts)} (got {self.accept!r})"
                            + (f"; {decl.accept_note}" if decl.accept_note else ""))
        if self.relax not in (None, self.own_relaxation) and not decl.chooses_relaxation:
            raise UserError(f"method {self.method} has its own relaxation ({self.own_relaxation}); a chosen "
                            "relaxation is for sjd")
        if self.drafting != Drafting.JACOBI:
            return
        if self.proactive is not None:
            k, d = self.proactive
            if not (1 <= k <= 8 and 1 <= d <= 4):
                raise UserError(f"--proactive K,D needs 1 <= K <= 8 and 1 <= D <= 4, got {k},{d}")
            if d >= self.window:
                raise UserError(f"--proactive depth {d} must be below --window {self.window}")
            if s.greedy:
                raise UserError("--proactive drafts several candidates from the residual, which only sampling "
                                "has; drop --proactive or use --sample")
        if s.greedy and self.coupling != "none":
            raise UserError(f"--coupling {self.coupling} does nothing with --greedy (greedy drafts are the argmax); "
                            "drop --coupling or use --sample")
        if self.accept == AcceptKind.GROUPED:
            if s.greedy:
                raise UserError("--accept grouped is a sampling rule; drop it or use --sample")
            if self.relaxation_kind != RelaxKind.NONE:
                raise UserError("--accept grouped and --lantern-delta/--lantern-lambda are two relaxations; "
                                "choose one")
            if self.proactive is not None:
                raise UserError("--accept grouped judges one draft per position; drop --proactive")

    @property
    def decl(self) -> MethodDecl:
        """The method's declared row (runtime.config.method_options.METHOD_DECLS)."""
        return METHOD_TABLE[self.method]

    @property
    def drafting(self) -> Drafting:
        """The declared drafting kind."""
        return self.decl.drafting

    @property
    def expansions(self) -> int:
        """Dynamic trees: most expansions after the root's top-k (the declared option: ddd's
        maximum depth, EAGLE-2's depth)."""
        return int(getattr(self, self.decl.expansions or "depth"))

    @property
    def ddd_checks(self) -> tuple[int, ...]:
        """ddd: the expansion counts after which the heuristic is read (e.g. 4, 6, 8 of 10)."""
        if not self.decl.checks:
            return ()
        return tuple(range(self.ddd_min_depth, self.ddd_max_depth, self.ddd_check_every))

    @property
    def loop(self) -> str:
        """The loop that runs this spec (`runtime.core.generate.LOOPS`): "out_of_order" for an
        --accept rule the method table declares as committing out of raster order (pjd's
        released loop), else "raster" (the shared decoder)."""
        return "out_of_order" if self.accept in self.decl.out_of_order else "raster"

    @property
    def needs_drafter(self) -> bool:
        """Whether the method drafts with a trained drafter head (sd, eagle2, lantern, lantern++)."""
        return self.decl.needs_drafter

    @property
    def own_relaxation(self) -> RelaxKind:
        return self.decl.relaxation

    @property
    def relaxation_kind(self) -> RelaxKind:
        """The relaxation in effect (none where its bound is exact: delta 0, lambda 1)."""
        kind = self.relax if self.relax is not None else self.own_relaxation
        if kind == RelaxKind.DELTA and self.lantern_delta > 0:
            return RelaxKind.DELTA
        if kind == RelaxKind.LAMBDA and self.lantern_lambda > 1:
            return RelaxKind.LAMBDA
        uniform_one = self.cool_nu == 0 and self.cool_delta * math.exp(-(self.cool_mu or 0.0)) == 1
        if kind == RelaxKind.ANNEAL and not uniform_one:
            return RelaxKind.ANNEAL
        return RelaxKind.NONE

    @property
    def needs_neighbours(self) -> bool:
        """Whether its acceptance reads the codebook neighbour table (LANTERN's relaxations in
        effect; COOL-SD's needs none)."""
        return self.relaxation_kind in (RelaxKind.DELTA, RelaxKind.LAMBDA)

    @property
    def tree_spec(self) -> str:
        """The static tree to load: a chain of --depth (sd) or --tree (lantern++)."""
        return f"chain{self.depth}" if self.decl.tree == "chain" else self.tree

    def describe(self) -> dict[str, Any]:
        """The method's parameters as recorded in result files: the sampling settings, the
        declared `records`, a dynamic tree's expansions as `depth`, --dynamic-depth when on, and
        a chosen relaxation's or grouped acceptance's settings when in effect."""
        out: dict[str, Any] = {"method": self.method, **asdict(self.sampling)}
        if self.drafting == Drafting.DYNAMIC:
            out["depth"] = self.expansions
        for name in self.decl.records:
            value = self.relaxation_kind if name == "relax" else getattr(self, name)
            out[name] = list(value) if name == "proactive" and value else value
        if self.dynamic_depth is not None:
            out["dynamic_depth"] = self.dynamic_depth
        if self.residual != default("residual"):
            out["residual"] = self.residual
        if self.decl.chooses_relaxation and self.relaxation_kind != RelaxKind.NONE:
            bound = "lantern_delta" if self.relaxation_kind == RelaxKind.DELTA else "lantern_lambda"
            out.update({"lantern_k": self.lantern_k, bound: getattr(self, bound), "relax_rule": self.relax_rule})
        if self.accept == AcceptKind.GROUPED:
            out.update(group_window=self.group_window, group_gap=self.group_gap, group_dist=self.group_dist)
        return out

    @property
    def tree_is_file(self) -> bool:
        """Whether `tree` names a TOML file (a profile's tree, or a --tree path), not a preset or chainN."""
        from runtime.core.tree import preset_names

        return not (self.tree in preset_names() or (self.tree[:5] == "chain" and self.tree[5:].isdigit()))

    def cli_args(self) -> list[str]:
        """The `runtime run` flags that pin every setting this spec decodes with, whatever a
        profile or the model recommends: `--method`, the sampling flags, the declared records
        (a dynamic tree's expansions under their own option), --dynamic-depth when on, and a
        chosen relaxation's or grouped acceptance's settings when in effect. A static tree read
        from a file is left out (no path of this machine is given away): it comes from the same
        profile or --tree the spec was resolved with."""
        names = ["greedy", "temperature", "top_k", "top_p", "cfg", "cfg_interval"]
        names += [n for n in self.decl.records if n != "relax"]
        if self.drafting == Drafting.DYNAMIC:
            names.append(self.decl.expansions or "depth")
        if self.dynamic_depth is not None:
            names.append("dynamic_depth")
        if self.residual != default("residual"):
            names.append("residual")
        if self.decl.chooses_relaxation and self.relaxation_kind != RelaxKind.NONE:
            bound = "lantern_delta" if self.relaxation_kind == RelaxKind.DELTA else "lantern_lambda"
            names += ["lantern_k", bound, "relax_rule"]
        if self.accept == AcceptKind.GROUPED:
            names += ["group_window", "group_gap", "group_dist"]
        args = ["--method", self.method]
        for name in dict.fromkeys(names):
            value = getattr(self.sampling, name) if hasattr(self.sampling, name) else getattr(self, name)
            if value is None:
                continue
            if name == "greedy":
                args.append("--greedy" if value else "--sample")
                continue
            if name == "tree" and self.tree_is_file:
                continue
            text = f"{value[0]},{value[1]}" if name == "proactive" else repr(value) if isinstance(value, float) \
                else str(value)
            args += [OPTIONS_BY_NAME[name].cli_flag, text]
        return args
