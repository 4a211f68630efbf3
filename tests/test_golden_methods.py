"""Golden tokens: the drafting-policy refactor (and anything after it) must not change the
tokens any existing method produces on the demo model, greedy or sampling.

The file `golden/demo_methods.json` was written by this module's `__main__` with the code
before the refactor; regenerate it only for a change that is meant to alter tokens, and say so
in the commit. The tokens are those of PyTorch's CPU kernels on this project's CI machines (fp32,
one thread); a CPU whose kernels round differently could flip a sampled token without any code
change, which is why the comparison names the cases that changed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

GOLDEN = Path(__file__).parent / "golden" / "demo_methods.json"
# small settings so each method runs in about a second on 2 CPU cores; lambda 8 / delta 0.3 make
# the relaxed paths (and their sibling stages) actually move mass
CASES = {
    "ar": {},
    "sd": {"depth": 3},
    "eagle2": {"depth": 3, "top_k_draft": 4, "total_tokens": 16},
    # the relaxed methods' keys without a rule are the bounded rule (the rule these tokens were
    # first written with); the paper rule (the default since) has its own cases
    "lantern": {"depth": 3, "top_k_draft": 4, "total_tokens": 16, "lantern_delta": 0.3, "relax_rule": "bounded"},
    "lantern++": {"tree": "small_12", "lantern_lambda": 8.0, "relax_rule": "bounded"},
    "lantern paper": {"depth": 3, "top_k_draft": 4, "total_tokens": 16, "lantern_delta": 0.3, "relax_rule": "paper"},
    "lantern++ paper": {"tree": "small_12", "lantern_lambda": 8.0, "relax_rule": "paper"},
}


def golden_tokens() -> dict[str, list[int]]:
    from runtime.core import MethodSpec, SamplingParams, generate
    from runtime.demo.bundle import load_demo_bundle

    bundle = load_demo_bundle(None, device=torch.device("cpu"), dtype=torch.float32)
    out = {}
    for mode in ("greedy", "sampling"):
        params = SamplingParams(greedy=mode == "greedy", cfg=3.0)
        for method, kw in CASES.items():
            spec = MethodSpec(method=method.split()[0], sampling=params, lantern_k=32, **kw)
            res = generate(bundle.gpt, bundle.drafter if method != "ar" else None, spec, [5],
                           seed=11, vq=bundle.vq)
            out[f"{method}/{mode}"] = res.tokens[0].tolist()
    return out


@pytest.mark.slow
def test_existing_methods_keep_their_tokens():
    want = json.loads(GOLDEN.read_text())
    got = golden_tokens()
    assert sorted(got) == sorted(want)
    changed = [k for k in want if got[k] != want[k]]
    assert not changed, f"tokens changed for {changed}"


if __name__ == "__main__":
    tokens = golden_tokens()
    GOLDEN.write_text(json.dumps(tokens) + "\n")
    print(f"wrote {len(tokens)} cases to {GOLDEN}", file=sys.stderr)
