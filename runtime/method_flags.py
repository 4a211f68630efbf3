"""Which methods read each method flag (pure data, no torch: the CLI's help is built from it).

A flag that none of a run's methods reads does nothing, so `runtime.pipeline.resolve_spec` refuses
it; `runtime --help` lists the readers beside each flag from the same table.
"""

from __future__ import annotations

FLAG_METHODS: dict[str, frozenset[str]] = {
    "tree": frozenset({"lantern++"}),
    "depth": frozenset({"sd", "eagle2", "lantern"}),
    "top_k_draft": frozenset({"eagle2", "ddd", "lantern"}),
    "total_tokens": frozenset({"eagle2", "ddd", "lantern"}),
    "lantern_k": frozenset({"lantern", "lantern++", "sjd"}),
    "lantern_delta": frozenset({"lantern", "sjd"}),
    "lantern_lambda": frozenset({"lantern++", "sjd"}),
    "relax_rule": frozenset({"lantern", "lantern++", "sjd"}),
    **{k: frozenset({"sjd"}) for k in ("window", "init", "coupling", "proactive", "accept",
                                       "group_window", "group_gap", "group_dist")},
    **{k: frozenset({"ddd"}) for k in ("ddd_threshold", "ddd_check_every", "ddd_min_depth", "ddd_max_depth")},
    "dynamic_depth": frozenset({"sd", "lantern++"}),
}

METHOD_ORDER = ("ar", "sd", "eagle2", "ddd", "lantern", "lantern++", "sjd")


def readers(key: str) -> str:
    """The methods reading flag `key` (a MethodSpec field name), in the CLI's method order: "sd, lantern++"."""
    return ", ".join(m for m in METHOD_ORDER if m in FLAG_METHODS[key])
