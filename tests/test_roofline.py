"""The roofline floor of each phase: bytes and FLOPs counted from shapes, checked by hand."""

from __future__ import annotations

import json

import pytest
import torch

from runtime.tools.roofline import (Roof, StackShape, Work, accept_work, decoder_phases, draft_work, forward_work,
                                    level_tokens, roof_for, target_forward, target_shape)
from runtime.models.configs import gpt_config

TINY = StackShape(weight_params=1000, embed_width=8, layers=2, width=8, kv_width=16)


def test_the_floor_of_a_tiny_forward_worked_out_by_hand():
    # 2 rows x 3 new tokens over 5 context positions, 2-byte weights
    work = forward_work(TINY, rows=2, tokens=3, context=5, itemsize=2)
    weights, gathered = 1000 * 2, 6 * 8 * 2  # every weight once; 6 tokens' embedding rows
    kv_read, kv_write = 2 * 16 * 2 * 5 * 2, 2 * 16 * 6 * 2  # layers x kv width x (rows x context | new tokens)
    assert work.bytes == weights + gathered + kv_read + kv_write == 3120
    assert work.flops == 2 * 1000 * 6 + 4 * 2 * 8 * 6 * (5 + 3) == 15072
    roof = Roof("toy", bandwidth=1000.0, matmul={"bf16": 10_000.0}, source="test")
    assert work.floor_s(roof, "bf16") == pytest.approx(3.12)  # bandwidth-bound: 3120 B / 1000 B/s
    assert work.floor_s(roof, "fp16") == pytest.approx(3.12)  # fp16 takes bf16's matmul peak
    assert Work(10.0, 1e6).floor_s(roof, "bf16") == pytest.approx(100.0)  # rate-bound
    seen = work.against(6.24, roof, "bf16")
    assert seen["over_floor"] == pytest.approx(2.0) and seen["bandwidth_fraction"] == pytest.approx(0.5)
    assert seen["rate_fraction"] == pytest.approx(15072 / 6.24 / 10_000)
    # a target forward writes (rows, tokens, vocab) fp32 logits; accept reads them once
    logits = 2 * 3 * 50 * 4
    assert target_forward(TINY, 50, rows=2, tokens=3, context=5, itemsize=2).bytes == 3120 + logits
    assert accept_work(rows=2, tokens=3, vocab=50) == Work(logits, 0.0)
    # a draft level runs the drafter and the target's head (vocab 50 x width 4) over its tokens
    level = draft_work(TINY, (50, 4), [1], rows=1, context=5, itemsize=2)
    alone = forward_work(TINY, rows=1, tokens=1, context=5, itemsize=2)
    assert level == alone + Work(50 * 4 * 2 + 50 * 4, 2 * 50 * 4)


def test_the_stack_shape_counts_every_weight_but_the_embedding_tables(make_tiny_gpt):
    model = make_tiny_gpt()
    embeds = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding))
    shape = target_shape(model.config)
    assert shape.weight_params == sum(p.numel() for p in model.parameters()) - embeds > 0
    assert shape.layers == model.config.n_layer and shape.kv_width == 2 * model.config.dim  # MHA: kv heads = heads


def test_the_xl_step_moves_its_weights_and_its_cache_within_one_percent():
    cfg = gpt_config("GPT-XL", image_size=256)
    shape = target_shape(cfg)
    # LlamaGen GPT-XL: 775M parameters, of which 22M are the token and class embedding tables
    assert 770e6 < shape.weight_params + (cfg.vocab_size + cfg.num_classes + 1) * cfg.dim < 780e6
    rows, context, itemsize = 2, cfg.cls_token_num + cfg.block_size, 2  # batch 1 with CFG, bf16, a full cache
    cache = cfg.n_layer * 2 * cfg.dim * rows * context * itemsize
    work = target_forward(shape, cfg.vocab_size, rows=rows, tokens=1, context=context, itemsize=itemsize)
    assert work.bytes == pytest.approx(shape.weight_params * itemsize + cache, rel=0.01)


@pytest.mark.parametrize("name, roof", [
    ("NVIDIA H100 80GB HBM3", "NVIDIA H100 SXM"), ("NVIDIA H100 PCIe", "NVIDIA H100 PCIe"),
    ("NVIDIA H200", "NVIDIA H200 SXM"), ("NVIDIA GeForce RTX 3090", "NVIDIA RTX 3090"),
    ("NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB"), ("NVIDIA A100-PCIE-40GB", "NVIDIA A100 40GB"),
    ("GAUDI2", "Intel Gaudi 2"), ("GAUDI3", "Intel Gaudi 3"), ("Tesla T4", None),
])
def test_vendor_roofs_are_found_by_device_name(name, roof):
    found = roof_for(name)
    assert (found.name if found else None) == roof
    if found:
        assert found.source and found.bandwidth > 1e11 and found.rate("bf16") > 1e13


def test_decoder_phases_follow_the_tree(make_tiny_gpt):
    from runtime.core import Decoder, MethodSpec
    from runtime.models.configs import DrafterConfig
    from runtime.models.drafter import Drafter

    target = make_tiny_gpt()
    drafter = Drafter(DrafterConfig.for_target(target.config)).eval()
    ar = decoder_phases(Decoder(target, drafter, MethodSpec("ar")))
    assert sorted(ar) == ["accept", "verify"]
    tree = Decoder(target, drafter, MethodSpec("sd", depth=3))
    assert level_tokens(tree) == [1, 1, 1]
    phases = decoder_phases(tree)
    assert sorted(phases) == ["accept", "draft", "verify"]
    assert phases["verify"].bytes > ar["verify"].bytes and phases["verify"].flops == pytest.approx(
        4 * ar["verify"].flops, rel=0.2)  # 4 tokens (root + 3 drafts) against 1


@pytest.mark.slow
def test_bench_shape_reports_each_phase_against_its_floor(tmp_path, run_cli):
    out = tmp_path / "p.json"
    res = run_cli("bench", "--shape", "llamagen-b", "--device", "cpu", "--methods", "lantern++", "--tree", "chain3",
                  "--tau", "2.5", "--iterations", "2", "--warmup", "1", "--out", str(out))
    assert res.exit_code == 0, res.stderr
    data = json.loads(out.read_text())
    assert data["roof"]["source"].startswith("measured") and data["roof"]["context"] == 1 + 128
    for entry in (data["ar_step"], data["runs"][0]):
        floor = entry["floor"]
        assert floor["iteration"]["over_floor"] > 0 and floor["iteration"]["floor_s"] > 0
        for phase in ("verify", "accept"):
            assert floor[phase]["bandwidth_fraction"] > 0 and floor[phase]["floor_s"] > 0
    assert "draft" in data["runs"][0]["floor"] and "iteration / floor" in res.stdout


def test_selfcheck_times_each_phase_of_a_shape_against_its_floor():
    from backends import get_backend
    from runtime.tools.roofline import Roof
    from runtime.tools.selfcheck import measure_xl_shape

    cfg = gpt_config("GPT-B", dim=64, n_layer=2, n_head=2, multiple_of=32, image_size=64)
    roof = Roof("toy", bandwidth=1e9, matmul={"fp32": 1e10}, source="test")
    out = measure_xl_shape({"eager": get_backend("cpu", dtype="fp32", graph_mode=False)}, repeats=2, roof=roof, cfg=cfg)
    assert out["model"].startswith("2 layers x 64") and out["roof"]["name"] == "toy"
    eager = out["eager"]
    assert eager["dtype"] == "fp32" and eager["verify_over_ar_step"] > 0 and eager["draft_over_ar_step"] > 0
    tree = eager["lantern++ naive_extend_57"]
    assert set(tree["floor"]) == {"draft", "verify", "accept", "iteration"}
    assert tree["floor"]["verify"]["bytes"] > eager["ar_step"]["floor"]["verify"]["bytes"]
    assert tree["floor"]["iteration"]["floor_s"] == pytest.approx(
        sum(tree["floor"][p]["floor_s"] for p in ("draft", "verify", "accept")))
