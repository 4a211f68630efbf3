"""Decoding methods as data: a drafting policy x an acceptance rule.

    method     drafting                          acceptance
    ar         none (one token per forward)      -
    sd         static chain of `depth`           exact
    eagle2     EAGLE-2 dynamic tree              exact
    lantern    EAGLE-2 dynamic tree              relaxed, additive bound delta
    lantern++  static tree (`tree`)              relaxed, multiplicative bound lambda

With lantern_delta = 0 / lantern_lambda = 1 the relaxed methods are exact.

`depth` means what it means in the reference EAGLE-2 / LANTERN code for the dynamic trees:
the number of expansions after the root's own top-k, so the tree has depth + 1 levels and
top_k + depth * top_k^2 candidates (LANTERN's LlamaGen default depth 4 -> 5 levels). For
`sd` it is the length of the drafted chain.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from runtime.core.sampling import SamplingParams
from runtime.errors import UserError

METHODS = ("ar", "sd", "eagle2", "lantern", "lantern++")


@dataclass(frozen=True)
class MethodSpec:
    method: str = "lantern++"
    sampling: SamplingParams = field(default_factory=SamplingParams)
    tree: str = "naive_extend_57"
    depth: int = 4
    top_k_draft: int = 10
    total_tokens: int = 60
    lantern_k: int = 1000
    lantern_delta: float = 0.1
    lantern_lambda: float = 2.0

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise UserError(f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}")
        s = self.sampling
        checks = [
            (s.temperature > 0, f"--temperature must be > 0, got {s.temperature}"),
            (s.top_k >= 0, f"--top-k must be >= 0, got {s.top_k}"),
            (0 < s.top_p <= 1, f"--top-p must be in (0, 1], got {s.top_p}"),
            (s.cfg >= 0, f"--cfg must be >= 0, got {s.cfg}"),
            (s.cfg_interval >= -1, f"--cfg-interval must be -1 (always) or >= 0, got {s.cfg_interval}"),
            (1 <= self.depth <= 32, f"--depth must be in [1, 32], got {self.depth}"),
            (self.top_k_draft >= 1, f"--top-k-draft must be >= 1, got {self.top_k_draft}"),
            (self.total_tokens >= 2, f"--total-tokens must be >= 2, got {self.total_tokens}"),
            (self.lantern_k >= 1, f"--lantern-k must be >= 1, got {self.lantern_k}"),
            (self.lantern_delta >= 0, f"--lantern-delta must be >= 0, got {self.lantern_delta}"),
            (self.lantern_lambda >= 1, f"--lantern-lambda must be >= 1, got {self.lantern_lambda}"),
        ]
        for ok, message in checks:
            if not ok:
                raise UserError(message)
        if self.drafting == "dynamic":
            limit = self.top_k_draft + self.depth * self.top_k_draft ** 2
            if self.total_tokens - 1 > limit:
                raise UserError(f"--total-tokens {self.total_tokens} exceeds the {limit + 1} nodes a "
                                f"depth-{self.depth}, top-k-{self.top_k_draft} EAGLE-2 tree can hold")

    @property
    def drafting(self) -> str:
        """"none", "static" or "dynamic"."""
        return {"ar": "none", "sd": "static", "lantern++": "static"}.get(self.method, "dynamic")

    @property
    def relaxation_kind(self) -> str:
        if self.method == "lantern" and self.lantern_delta > 0:
            return "delta"
        if self.method == "lantern++" and self.lantern_lambda > 1:
            return "lambda"
        return "none"

    @property
    def tree_spec(self) -> str:
        """The static tree to load: `chain<depth>` for sd, `tree` for lantern++."""
        return f"chain{self.depth}" if self.method == "sd" else self.tree

    def describe(self) -> dict:
        """The method's parameters as recorded in result files (only those that apply)."""
        out: dict = {"method": self.method, **asdict(self.sampling)}
        if self.method == "sd":
            out["depth"] = self.depth
        if self.method == "lantern++":
            out["tree"] = self.tree
        if self.drafting == "dynamic":
            out.update(depth=self.depth, top_k_draft=self.top_k_draft, total_tokens=self.total_tokens)
        if self.method == "lantern":
            out.update(lantern_k=self.lantern_k, lantern_delta=self.lantern_delta)
        if self.method == "lantern++":
            out.update(lantern_k=self.lantern_k, lantern_lambda=self.lantern_lambda)
        return out
