"""`MethodSpec.cli_args()`: the `runtime run` flags that pin a spec's settings give the same spec
back whatever the profile pins and the model recommends (what a served image's `reproduce` line
relies on: under `--method auto` the profile's own lantern++ relaxes, the served one does not)."""

from __future__ import annotations

import pytest

from runtime.core import MethodSpec, SamplingParams
from runtime.core.methods import METHODS
from runtime.config.method_options import OPTIONS_BY_NAME
from runtime.config.profiles import load_profile
from runtime.generation.settings import resolve_spec

pytestmark = pytest.mark.fast

BY_FLAG = {o.cli_flag: o for o in OPTIONS_BY_NAME.values() if o.name != "greedy"}
# a model recommending other settings than every spec below (what the flags must override)
RECOMMENDED = {"cfg": 7.5, "temperature": 0.9, "top_k": 100, "lantern_lambda": 3.0, "depth": 6, "window": 8,
               "tree": "chain2"}


def _flags(args: list[str]) -> tuple[str, dict]:
    """(method, the flags as resolve_spec takes them) from `cli_args()`'s list, as click parses it."""
    method, flags, words = None, {}, list(args)
    while words:
        word = words.pop(0)
        if word in ("--greedy", "--sample"):
            flags["greedy"] = word == "--greedy"
        elif word == "--method":
            method = words.pop(0)
        else:
            option = BY_FLAG[word]
            flags[option.name] = option.kind(words.pop(0)) if option.name != "proactive" else words.pop(0)
    return method, flags


SPECS = [MethodSpec(method=m, sampling=SamplingParams(cfg=4.0, temperature=1.0, top_k=0)) for m in METHODS] + [
    MethodSpec(method="lantern++", tree="chain3", lantern_lambda=1.0, sampling=SamplingParams(greedy=True)),
    MethodSpec(method="lantern++", tree="mc_sim_7b_63", lantern_lambda=5.0, relax_rule="bounded", lantern_k=50,
               dynamic_depth=0.2),
    MethodSpec(method="sjd", relax="lambda", lantern_lambda=3.0, proactive=(3, 2), coupling="maximal",
               sampling=SamplingParams(top_p=0.9, cfg_interval=20, cfg=2.0)),
    MethodSpec(method="sjd", accept="grouped", group_window=5, group_gap=0.2, group_dist=0.4),
    MethodSpec(method="ddd", ddd_threshold=-0.6, ddd_max_depth=8, top_k_draft=6, total_tokens=30),
    MethodSpec(method="pjd", pjd_window=6, pjd_rows=3, init="repeat-h", accept="published"),
    MethodSpec(method="lantern", lantern_delta=0.0, depth=3),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: " ".join(s.cli_args()[1:2]))
@pytest.mark.parametrize("profile", ["cpu-serve", "cpu"])
def test_the_flags_give_the_spec_back_under_any_profile_and_recommendation(spec, profile):
    prof = load_profile(profile)
    method, flags = _flags(spec.cli_args())
    again = resolve_spec(method, flags, prof, RECOMMENDED)
    assert again.describe() == spec.describe(), spec.cli_args()


def test_a_tree_file_is_left_to_the_profile_and_no_path_is_given_away():
    prof = load_profile("cpu-serve")
    served = resolve_spec("lantern++", {}, prof, {}, lossless=True)
    assert served.tree_is_file and served.lantern_lambda == 1.0 and prof.method.lantern_lambda == 5.0
    args = served.cli_args()
    assert "--tree" not in args and not any("/" in a for a in args)
    method, flags = _flags(args)
    assert resolve_spec(method, flags, prof, {}).describe() == served.describe()  # the profile supplies the tree
