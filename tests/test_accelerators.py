"""The decoding core on real accelerators: bf16 models, graph capture equal to eager.

Marked `cuda` / `hpu`; skipped with the reason where the hardware is absent (always in CI).
"""

import pytest
import torch

from backends import get_backend
from backends.cuda import CudaBackend
from backends.hpu import HpuBackend
from runtime.core import Decoder, MethodSpec, SamplingParams, generate
from tiny_models import tiny_pair

CUDA_OK, CUDA_WHY = CudaBackend.availability()
HPU_OK, HPU_WHY = HpuBackend.availability()
DEVICES = [pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not CUDA_OK, reason=f"no CUDA: {CUDA_WHY}")]),
           pytest.param("hpu", marks=[pytest.mark.hpu, pytest.mark.skipif(not HPU_OK, reason=f"no Gaudi: {HPU_WHY}")])]


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_incremental_decoding_matches_full_forward(device):
    backend = get_backend(device, dtype="bf16", graph_mode=False)
    target, _ = tiny_pair(vocab=32)
    target = target.to(backend.device, torch.bfloat16)
    idx = torch.randint(0, 32, (2, target.config.block_size), device=backend.device)
    cond = torch.tensor([0, 1], device=backend.device)
    with torch.no_grad():
        full, _ = target.forward_train(cond, idx)
        cache = target.new_cache(2, 64, backend.device)
        hidden = [target.prefill(cond, cache)[:, -1:]]
        one = torch.ones(1, 1, dtype=torch.bool, device=backend.device)
        for k in range(target.config.block_size - 1):
            hidden.append(target.forward_cached(target.tok_embeddings(idx[:, k:k + 1]), cache.length[:, None], one, cache))
            cache.advance(1)
        logits = target.logits(torch.cat(hidden, 1))
    torch.testing.assert_close(logits, full, atol=0.05, rtol=0.05)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", ["ar", "lantern++", "eagle2"])
def test_graph_capture_equals_eager_on_device(device, method):
    backend = get_backend(device, dtype="fp32", graph_mode=True)
    target, drafter = tiny_pair(vocab=8, sharpness=1.0)
    target, drafter = target.to(backend.device), drafter.to(backend.device)
    nb = torch.stack([torch.roll(torch.arange(8), -i)[1:4] for i in range(8)]).to(backend.device)
    spec = MethodSpec(method=method, sampling=SamplingParams(greedy=False, cfg=2.0), tree="small_12",
                      depth=3, top_k_draft=3, total_tokens=10, lantern_lambda=2.0, lantern_k=3)
    eager = generate(target, drafter, spec, [0, 1, 2], seed=4, neighbours=nb)
    decoder = Decoder(target, drafter, spec, neighbours=nb, backend=backend)
    graph = generate(target, drafter, spec, [0, 1, 2], seed=4, decoder=decoder)
    # counter-based random numbers: the same samples with and without graphs
    assert torch.equal(graph.tokens, eager.tokens)
    assert graph.stats["target_forwards"] == eager.stats["target_forwards"]
    assert all(v == 1 for v in backend.capture_count.values())


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_selfcheck_passes_on_device(device, tmp_path):
    """`runtime selfcheck` on the accelerator: graph == eager, no host sync in replays, exactness."""
    import json

    from runtime.cli.app import main

    out = tmp_path / "selfcheck.json"
    main(["selfcheck", "--device", device, "--no-xl", "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["passed"], report["failed"]
    assert {c["name"]: c["passed"] for c in report["checks"]}["no_hidden_host_sync"] is True
