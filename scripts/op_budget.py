"""Ops per decoding iteration of lantern++ naive_extend_57 on the demo (sampling and greedy), as JSON:
`python scripts/op_budget.py` (results/op_budget_lanternpp_naive57_cpu.json ran it on the commits it lists)."""

import json

import torch

from runtime.core import Decoder, MethodSpec, SamplingParams, neighbours_for
from runtime.core.opcount import phase_ops
from runtime.demo.bundle import load_demo_bundle

torch.set_num_threads(1)
bundle = load_demo_bundle()
out = {}
for greedy in (False, True):
    spec = MethodSpec("lantern++", SamplingParams(greedy=greedy, cfg=3.0), lantern_k=8, tree="naive_extend_57",
                      lantern_lambda=2.0)
    neighbours = neighbours_for(bundle.vq, spec, bundle.gpt.config.vocab_size)
    decoder = Decoder(bundle.gpt, bundle.drafter, spec, neighbours=neighbours)
    with torch.no_grad():
        ops = phase_ops(decoder, torch.tensor([3]), seed=0, iterations=2)
    ops["draft_plus_accept_over_verify"] = (ops["draft"] + ops["accept"]) / ops["verify"]
    out["greedy" if greedy else "sampling"] = ops
print(json.dumps(out))
