"""The decoding loop reads the device at most once per iteration (the stop check).

A TorchDispatchMode counts every op that copies a device value to the host
(`_local_scalar_dense`: .item(), int(), bool()) or whose output shape depends on data
(nonzero & co., which synchronise on accelerators). Inside draft/verify/accept there must
be none; over a whole image, one per iteration plus a constant for prefill and statistics.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from runtime.core import Decoder, MethodSpec, SamplingParams
from runtime.core.proximity import compute_neighbours
from tiny_models import tiny_pair

SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "item"}


class SyncCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in SYNC_OPS:
            self.count += 1
        return func(*args, **(kwargs or {}))


SJD = {"sjd": {}, "sjd-maximal-pac": dict(coupling="maximal", proactive=(2, 2)),
       "sjd-gumbel-grouped": dict(coupling="gumbel", accept="grouped")}
# depth decided per iteration: the steps never read the device; the loop reads one flag per check
DYNAMIC = {"ddd": dict(ddd_min_depth=1, ddd_check_every=1, ddd_max_depth=3, ddd_threshold=-0.7),
           "lantern++-dynamic": dict(dynamic_depth=0.3)}


@pytest.mark.parametrize("method", ["ar", "sd", "eagle2", "lantern", "lantern++", "cool-sd", "cool-eagle2", *SJD,
                                    *DYNAMIC])
@pytest.mark.parametrize("greedy", [True, False])
def test_steps_never_read_the_device(method, greedy):
    target, drafter = tiny_pair(vocab=8)
    nb = compute_neighbours(torch.randn(8, 2), 4)
    extra = SJD.get(method, {})
    if greedy and extra:
        pytest.skip("sampling-only sjd options")
    extra = {**extra, **DYNAMIC.get(method, {})}
    spec = MethodSpec(method=method if method.startswith("cool") else method.split("-")[0], sampling=SamplingParams(greedy=greedy, cfg=2.0), tree="small_12",
                      depth=3, top_k_draft=3, total_tokens=10, lantern_k=4, lantern_lambda=3.0,
                      lantern_delta=0.2, **({"window": 5, **extra} if method in SJD else extra))
    dec = Decoder(target, drafter, spec, neighbours=nb)
    with torch.no_grad():
        dec.prefill(torch.tensor([1]), None, seed=0)
        with SyncCounter() as counter:
            for _ in range(3):
                for segment in dec.draft_segments:
                    segment()
                if dec.draft_finish is not None:
                    dec.draft_finish()
                dec.verify_at[dec.policy.tree.max_depth]()
                dec.accept_at[dec.policy.tree.max_depth]()
    assert counter.count == 0

    with SyncCounter() as counter:
        _, stats = dec.generate_one(torch.tensor([2]), None, seed=1)
    iterations = stats.target_forwards - 1
    checks = 1 + len(dec.policy.depth.checks)  # the done check, plus one per depth check reached
    assert iterations <= counter.count <= checks * iterations + 1 + 8  # + prefill + statistics
