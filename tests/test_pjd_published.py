"""`--method pjd --accept published`: the released PJD loop (rows committing out of raster order).

- with one row in flight and greedy decoding it is AR token for token (the slot cache, the
  re-input leading token and the KV kept for committed drafts give AR's context exactly);
- with several rows, every KV the cache holds for a committed token equals what one masked
  forward computes from the tokens each of them saw (the cache's writes and masks are a
  consistent record of the released code's row-causal attention);
- rows run in parallel under the released rules (a row starts after W codes of the row above and
  never passes it), batch and graph mode change nothing, and the settings it does not take are refused.
"""

from __future__ import annotations

import pytest
import torch

from backends import get_backend
from runtime.core import Decoder, MethodSpec, SamplingParams, generate
from runtime.core.slots import SlotRequest
from runtime.core.pjd_published import PublishedPJD
from runtime.utils.errors import UserError
from tiny_models import caption, tiny_pair


def published(params: SamplingParams, **kw) -> MethodSpec:
    return MethodSpec("pjd", sampling=params, accept="published", **{"pjd_window": 3, "pjd_rows": 3, **kw})


@pytest.mark.parametrize("model_type,cfg", [("c2i", 1.0), ("c2i", 3.0), ("t2i", 3.0)])
def test_one_row_in_flight_greedy_equals_ar_token_for_token(model_type, cfg):
    target, _ = tiny_pair(model_type=model_type, vocab=8, grid=6, sharpness=1.0)
    params = SamplingParams(greedy=True, cfg=cfg)
    conds, masks = ([0, 1, 2], None) if model_type == "c2i" else caption(target, n=2)
    ar = generate(target, None, MethodSpec("ar", sampling=params), conds, cond_masks=masks, seed=3)
    for window, init in ((3, "uniform"), (8, "repeat-v")):
        out = generate(target, None, published(params, pjd_rows=1, pjd_window=window, init=init), conds,
                       cond_masks=masks, seed=3)
        assert torch.equal(out.tokens, ar.tokens), window
        assert out.stats["target_forwards"] < ar.stats["target_forwards"]


def _decode_one(target, spec, cond, seed=0):
    dec = PublishedPJD(target, spec)
    dec.admit(0, SlotRequest("x", torch.tensor([cond]), None, seed))
    while not dec.finished():
        dec.step()
    return dec


@pytest.mark.parametrize("greedy", [True, False])
def test_rows_run_in_parallel_under_the_released_rules(greedy):
    target, _ = tiny_pair(vocab=8, grid=8, sharpness=1.0)
    spec = published(SamplingParams(greedy=greedy, cfg=2.0), pjd_window=3, pjd_rows=4)
    dec = _decode_one(target, spec, 1)
    im = dec.images[0]
    trace = im.trace
    assert max(len(f["rows"]) for f in trace) > 1  # several rows verified in one forward
    ar_forwards = 64  # one per token after the prefill's
    assert 1 + im.forwards < ar_forwards
    assert im.committed.all() and sum(sum(f["committed"]) for f in trace) == 64 - 1  # the prefill's token
    codes = [0] * 8
    codes[0] = 1
    for f in trace:
        assert f["rows"] == sorted(f["rows"]) and len(f["rows"]) <= 4
        for k, (r, w, c) in enumerate(zip(f["rows"], f["window"], f["committed"])):
            assert 1 <= w <= 3
            if k == 0:  # the first ongoing row: window <= codes left, commits 1..w (drafts + one sampled)
                assert w <= 8 - codes[r] and 1 <= c <= w
            else:  # a later row: window <= what the row above has beyond it, commits its drafts only
                above = codes[f["rows"][k - 1]]
                assert r == f["rows"][k - 1] + 1 and w <= above - codes[r] and 0 <= c <= w - 1
                assert codes[r] > 0 or codes[r - 1] >= 3 or codes[r - 1] == 8  # started after W codes above
        for r, c in zip(f["rows"], f["committed"]):
            codes[r] += c


@pytest.mark.parametrize("greedy", [True, False])
def test_tokens_do_not_depend_on_the_batch_size(greedy):
    target, _ = tiny_pair(vocab=8, grid=6, sharpness=1.0)
    spec = published(SamplingParams(greedy=greedy, cfg=2.0))
    conds = [0, 1, 2, 3, 1]
    one = generate(target, None, spec, conds, seed=5, batch_size=1)
    three = generate(target, None, spec, conds, seed=5, batch_size=3)
    assert torch.equal(three.tokens, one.tokens)
    assert three.stats["target_forwards"] == one.stats["target_forwards"]
    assert len({tuple(t.tolist()) for t in one.tokens}) > 2


@pytest.mark.parametrize("greedy", [True, False])
def test_each_query_sees_the_committed_tokens_before_it_and_its_own_window_only(greedy):
    """The released row-causal attention, checked forward by forward from the masks the model got:
    a query at image index i sees every committed token before i whose KV is kept, the committed
    leading tokens of this forward before i, and the earlier nodes of its own window; never
    another row's drafts, nothing after i. And a KV once kept is never written again."""
    target, _ = tiny_pair(vocab=8, grid=6, sharpness=1.0, seed=2)
    spec = published(SamplingParams(greedy=greedy, cfg=2.0), pjd_window=3, pjd_rows=3)
    calls = []
    forward_at = target.forward_at

    def record(x, positions, slots, mask, cache):
        calls.append((positions[0].clone(), slots[0].clone(), mask[0, 0] == 0))
        return forward_at(x, positions, slots, mask, cache)

    target.forward_at = record
    try:
        dec = PublishedPJD(target, spec)
        dec.admit(0, SlotRequest("x", torch.tensor([2]), None, 4))
        cls, s = dec.config.cls, dec.config.num_tokens
        kept_at: dict[int, int] = {}  # slot -> the forward after which its KV was kept
        f = 0
        while not dec.finished():
            im = dec.images[0]
            committed, kv_ok = im.committed.copy(), im.kv_ok.copy()
            calls.clear()
            dec.step()
            (positions, slots, seen), = calls
            windows = dec.node_win[0]
            # this forward's committed nodes (leading tokens, KV-only nodes), by slot
            leads = {int(slot) for slot in slots if cls <= int(slot) < cls + s and committed[int(slot) - cls]}
            for t in range(len(positions)):  # every node, padding included
                slot, index = int(slots[t]), int(positions[t]) - cls
                assert slot not in kept_at, f"forward {f} rewrote slot {slot}, kept after forward {kept_at[slot]}"
                own = {int(slots[u]) for u in range(t + 1) if windows[u] == windows[t]}
                visible = {j for j in range(cls, dec.cache.capacity) if bool(seen[t, j])}
                before = {cls + j for j in range(index) if kv_ok[j]} | {j for j in leads if j - cls < index}
                assert visible == before | own, (f, t)
            for j in range(s):
                if im.kv_ok[j] and not kv_ok[j]:
                    kept_at[cls + j] = f
            f += 1
    finally:
        del target.forward_at
    assert f > 0 and len(kept_at) > s // 2


@pytest.mark.slow
def test_graph_mode_equals_eager():
    target, _ = tiny_pair(vocab=8, grid=6, sharpness=1.0)
    spec = published(SamplingParams(cfg=2.0))
    eager = generate(target, None, spec, [0, 1], seed=1, batch_size=2)
    backend = get_backend("cpu", graph_mode=True)
    dec = PublishedPJD(target, spec, backend=backend, batch_size=2)
    graph = generate(target, None, spec, [0, 1], seed=1, decoder=dec)
    assert torch.equal(graph.tokens, eager.tokens)
    assert graph.stats["target_forwards"] == eager.stats["target_forwards"]
    assert dict(backend.capture_count) == {f"pjd-published.verify.t{t}.b2": 1 for t in (4, 8, 12)}  # 1, 2, 3 rows


@pytest.mark.parametrize("kw,match", [
    (dict(method="sjd", accept="published"), r"--method sjd takes --accept exact or grouped"),
    (dict(method="pjd", accept="grouped"), r"--method pjd takes --accept exact or published"),
])
def test_published_is_pjds_only(kw, match):
    with pytest.raises(UserError, match=match):
        MethodSpec(**kw)


def test_the_shared_decoder_refuses_it_with_the_tools_that_drive_it():
    target, _ = tiny_pair(vocab=8, grid=4)
    with pytest.raises(UserError, match="runtime run, bench, sample and serve do"):
        Decoder(target, None, published(SamplingParams()))


def test_the_serve_engine_drives_it_with_each_image_equal_to_its_lone_decode():
    """The server's engine runs the published loop through the slot API (admissions into freed
    slots while others decode): every image equals the same seed decoded alone."""
    from runtime.serve.engine import Engine, Job

    target, _ = tiny_pair(vocab=8, grid=6, sharpness=1.0)
    spec = published(SamplingParams(cfg=2.0))
    engine = Engine({"pjd": PublishedPJD(target, spec, batch_size=2)}, torch.device("cpu"))
    engine.start()
    assert engine.ready.wait(10)
    try:
        jobs = [Job("r", i, label, 40 + i) for i, label in enumerate([0, 1, 2, 3, 1])]
        engine.submit(jobs)
        results = [job.future.result(60) for job in jobs]
    finally:
        engine.stop(drain=False, timeout=10)
    alone = PublishedPJD(target, spec)
    for job, (tokens, _) in zip(jobs, results):
        want, _ = alone.generate_one(torch.tensor([job.label]), None, job.seed)
        assert torch.equal(tokens, want.cpu())


def test_the_measured_law_is_ars_with_one_row_and_departs_with_several():
    """`measure_law`: TV between the p each token was judged under and AR's p given the finished
    image. One row in flight judges every token under AR's own p (0 up to rounding); rows that
    commit ahead of the frontier condition on a partly generated row above (> 0)."""
    target, _ = tiny_pair(vocab=8, grid=6, sharpness=1.0)
    tvd = {}
    for rows in (1, 3):
        spec = published(SamplingParams(cfg=2.0), pjd_rows=rows)
        dec = PublishedPJD(target, spec, batch_size=2)
        dec.measure_law = True
        out = generate(target, None, spec, [0, 1, 2], seed=6, decoder=dec)
        assert out.stats["law_steps"] == 3 * 36 and out.stats["step_tvd_bound"] == 1.0
        tvd[rows] = out.stats["step_tvd"]
    assert tvd[1] < 1e-5 and tvd[3] > 1e-3, tvd


def test_nan_logits_in_a_forward_stop_decoding_with_the_image_named():
    """The NaN check rides on the acceptance transfer: a non-finite p in any used node raises."""
    from runtime.core.slots import NonFiniteError

    target, _ = tiny_pair(vocab=8, grid=6, sharpness=1.0)
    logits, calls = target.logits, [0]

    def poisoned(hidden):
        calls[0] += 1
        out = logits(hidden)
        return out if calls[0] < 4 else out.clone().fill_(float("nan"))

    target.logits = poisoned
    try:
        with pytest.raises(NonFiniteError, match=r"NaN or infinite logits for image x at image token \d+"):
            _decode_one(target, published(SamplingParams(cfg=2.0)), 1)
    finally:
        del target.logits
