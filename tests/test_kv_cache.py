"""The static KV cache: incremental decoding, tree blocks and compaction equal plain forwards."""

import pytest
import torch

from runtime.models.configs import DrafterConfig, gpt_config
from runtime.models.drafter import Drafter
from runtime.models.gpt import Transformer

pytestmark = pytest.mark.fast  # the edit-test tier: python -m pytest -m fast


def tiny_gpt(model_type: str = "c2i", seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    cfg = gpt_config("GPT-tiny", model_type=model_type, image_size=64, downsample=16,
                     vocab_size=32, num_classes=5, caption_dim=16,
                     cls_token_num=1 if model_type == "c2i" else 6)
    model = Transformer(cfg)
    model.init_weights()
    torch.nn.init.normal_(model.output.weight, std=0.02)  # a zero head would hide errors
    return model.eval()


def condition(model: Transformer, batch: int = 2):
    cfg = model.config
    if cfg.model_type == "c2i":
        return torch.arange(batch) % cfg.num_classes, None
    emb = torch.randn(batch, cfg.cls_token_num, cfg.caption_dim)
    mask = torch.ones(batch, cfg.cls_token_num, dtype=torch.bool)
    mask[0, :2] = False  # left padding on row 0
    emb = emb * mask[..., None]
    return emb, mask


@pytest.mark.parametrize("model_type", ["c2i", "t2i"])
def test_incremental_decoding_equals_full_forward(model_type):
    model = tiny_gpt(model_type)
    cond, mask = condition(model)
    idx = torch.randint(0, model.config.vocab_size, (2, model.config.block_size))
    with torch.no_grad():
        full_logits, full_hidden = model.forward_train(cond, idx, mask)
        cache = model.new_cache(2, 64, "cpu")
        cls = model.config.cls_token_num
        hidden = [model.prefill(cond, cache, mask)[:, -1:]]
        one = torch.ones(1, 1, dtype=torch.bool)
        for k in range(model.config.block_size - 1):
            pos = cache.length[:, None].clone()
            h = model.forward_cached(model.tok_embeddings(idx[:, k:k + 1]), pos, one, cache)
            cache.advance(1)
            hidden.append(h)
        hidden = torch.cat(hidden, dim=1)
    torch.testing.assert_close(hidden, full_hidden[:, cls - 1:], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(model.logits(hidden), full_logits, atol=1e-5, rtol=1e-4)


def _tree():
    # root 0; children 1, 2 of root; 3 child of 1; 4 child of 2; 5 child of 3
    parents = [-1, 0, 0, 1, 2, 3]
    n = len(parents)
    anc = torch.zeros(n, n, dtype=torch.bool)
    depth = []
    for i, p in enumerate(parents):
        anc[i, i] = True
        d, j = 0, p
        while j >= 0:
            anc[i, j] = True
            j = parents[j]
            d += 1
        depth.append(d)
    return parents, anc, torch.tensor(depth)


def _path_of(node, parents):
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def test_tree_block_equals_sequential_branches_and_compaction():
    model = tiny_gpt("c2i", seed=1)
    cond, _ = condition(model)
    parents, anc, depth = _tree()
    tokens = torch.randint(0, 32, (2, len(parents)))
    prefix = torch.randint(0, 32, (2, 3))
    with torch.no_grad():
        cache = model.new_cache(2, 32, "cpu")
        model.prefill(cond, cache)
        causal = torch.ones(3, 3, dtype=torch.bool).tril()
        model.forward_cached(model.tok_embeddings(prefix), cache.length[:, None] + torch.arange(3), causal, cache)
        cache.advance(3)
        base_len = int(cache.length[0])
        tree_hidden = model.forward_cached(model.tok_embeddings(tokens), cache.length[:, None] + depth, anc, cache)

        for leaf in (5, 4):
            path = _path_of(leaf, parents)
            ref = model.new_cache(2, 32, "cpu")
            model.prefill(cond, ref)
            seq = torch.cat([prefix, tokens[:, path]], dim=1)
            n = seq.size(1)
            h = model.forward_cached(model.tok_embeddings(seq), ref.length[:, None] + torch.arange(n),
                                     torch.ones(n, n, dtype=torch.bool).tril(), ref)
            torch.testing.assert_close(tree_hidden[:, path], h[:, 3:], atol=1e-5, rtol=1e-4)

        # commit the path root->2->4 and check the cache equals decoding that path directly
        path = torch.tensor([0, 2, 4, 0])  # padded to fixed length; count=3
        cache.commit(path.expand(2, -1), torch.tensor([3, 3]))
        assert cache.length.tolist() == [base_len + 3] * 2
        ref = model.new_cache(2, 32, "cpu")
        model.prefill(cond, ref)
        seq = torch.cat([prefix, tokens[:, [0, 2, 4]]], dim=1)
        model.forward_cached(model.tok_embeddings(seq), ref.length[:, None] + torch.arange(6),
                             torch.ones(6, 6, dtype=torch.bool).tril(), ref)
        ref.advance(6)
        n = int(ref.length[0])
        for mine, theirs in zip(cache.k + cache.v, ref.k + ref.v):
            torch.testing.assert_close(mine[:, :, :n], theirs[:, :, :n], atol=1e-5, rtol=1e-4)
        # and the next token decodes identically from both caches
        nxt = torch.randint(0, 32, (2, 1))
        one = torch.ones(1, 1, dtype=torch.bool)
        a = model.forward_cached(model.tok_embeddings(nxt), cache.length[:, None], one, cache)
        b = model.forward_cached(model.tok_embeddings(nxt), ref.length[:, None], one, ref)
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_drafter_cached_equals_teacher_forced():
    target = tiny_gpt("c2i")
    torch.manual_seed(3)
    drafter = Drafter(DrafterConfig.for_target(target.config)).eval()
    s = 7
    hidden = torch.randn(2, s, target.config.dim)
    tokens = torch.randint(0, 32, (2, s))
    with torch.no_grad():
        full = drafter.forward_train(hidden, tokens)
        cache = drafter.new_cache(2, 16, "cpu")
        out = drafter.forward_cached(tokens[:, :4], hidden[:, :4], torch.arange(4),
                                     torch.ones(4, 4, dtype=torch.bool).tril(), cache)
        cache.advance(4)
        rest = drafter.forward_cached(tokens[:, 4:], hidden[:, 4:], 4 + torch.arange(3),
                                      torch.ones(3, 3, dtype=torch.bool).tril(), cache)
    torch.testing.assert_close(torch.cat([out, rest], 1), full, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mask_rows_start_16_byte_aligned_whatever_capacity_is_asked(dtype):
    """Fused attention kernels read the additive mask's rows vectorised; a 267-slot drafter cache
    faulted on an H200 in bf16 ("misaligned address"). The cache rounds its capacity up and masks
    the extra slots."""
    from runtime.models.kv_cache import StaticKVCache

    cache = StaticKVCache(1, 2, 1, 4, 267, "cpu", dtype)
    assert cache.capacity == 272 and cache.k[0].shape == (2, 1, 272, 4)
    cache.advance(3)
    mask = cache.additive_mask(torch.ones(2, 2, dtype=torch.bool))
    assert mask.shape == (2, 1, 2, 272) and (mask.stride(-2) * mask.element_size()) % 16 == 0
    assert torch.isinf(mask[..., 5:]).all() and (mask[..., :5] == 0).all()
