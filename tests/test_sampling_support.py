"""Sampling never returns a token of probability zero (RNG edge values, every sampling path)."""

from __future__ import annotations

import pytest
import torch

from runtime.core.acceptance import accept_sampling
from runtime.core.rng import CounterRNG, _MASK64, _MUL1, _MUL2, _GOLDEN, _to_uniform, splitmix64
from runtime.core.sampling import sample, sample_without_replacement
from runtime.core.tree import load_tree, static_buffers

pytestmark = pytest.mark.fast  # the edit-test tier: python -m pytest -m fast


def _unxorshift(y: int, s: int) -> int:
    x = y
    for _ in range(64 // s + 1):
        x = y ^ (x >> s)
    return x & _MASK64


def _splitmix64_inverse(out: int) -> int:
    """The x with splitmix64(x) == out (python ints, 64-bit)."""
    z = _unxorshift(out, 31)
    z = (z * pow(_MUL2 & _MASK64, -1, 1 << 64)) & _MASK64
    z = _unxorshift(z, 27)
    z = (z * pow(_MUL1 & _MASK64, -1, 1 << 64)) & _MASK64
    z = _unxorshift(z, 30)
    return (z - (_GOLDEN & _MASK64)) & _MASK64


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


def _counter_for_max_bits(rng: CounterRNG) -> int:
    """A counter value whose first draw has all top 24 bits set (the largest uniform)."""
    key = int(splitmix64(rng.seed.clone())) & _MASK64
    x = _splitmix64_inverse(((1 << 24) - 1) << 40 | 12345)
    return _signed(x ^ key)


def test_splitmix_inverse_is_exact():
    for v in (0, 1, 12345, (1 << 63) + 7):
        assert int(splitmix64(torch.tensor(_signed(_splitmix64_inverse(v))))) & _MASK64 == v


def test_uniforms_skip_the_final_mix_without_changing_a_number():
    """`uniform` reads only splitmix64's top 23 bits, which its last xor-shift leaves alone."""
    rng = CounterRNG("cpu", seed=11)
    rng.counter.fill_(-(1 << 40))
    ids = rng.counter[:, None] + torch.arange(1 << 17)
    want = _to_uniform(splitmix64(rng.key[:, None] ^ ids), rng._half)
    assert torch.equal(rng.uniform(1 << 17), want[0])
    out = torch.empty(1, 1000)
    assert torch.equal(rng.uniform(1, 1000, out=out), out)
    assert int(rng.counter) == -(1 << 40) + (1 << 17) + 1000


def test_largest_uniform_is_below_one_and_its_gumbel_finite():
    rng = CounterRNG("cpu", seed=7)
    rng.counter.fill_(_counter_for_max_bits(rng))
    u = rng.uniform(1)
    assert 0.0 < float(u) < 1.0
    rng.counter.fill_(_counter_for_max_bits(rng))
    assert torch.isfinite(rng.gumbel(1)).all()


def test_largest_uniform_never_picks_a_zero_probability_token():
    """The draw with the largest uniform lands on index 0, whose probability is 0."""
    probs = torch.full((1, 8), 1 / 7)
    probs[0, 0] = 0.0
    rng = CounterRNG("cpu", seed=3)
    rng.counter.fill_(_counter_for_max_bits(rng))
    assert int(sample(probs, rng)) != 0
    rng.counter.fill_(_counter_for_max_bits(rng))
    assert 0 not in sample_without_replacement(probs, 3, rng).tolist()


def _sparse(b: int, v: int, g: torch.Generator) -> torch.Tensor:
    """(b, v) distributions with about half the entries exactly zero."""
    p = torch.rand(b, v, generator=g) * (torch.rand(b, v, generator=g) < 0.5)
    p[:, 0] += (p.sum(-1) == 0).float()  # no all-zero row
    return p / p.sum(-1, keepdim=True)


def test_1e5_draws_through_every_sampling_path_never_hit_zero_probability():
    g = torch.Generator().manual_seed(0)
    n, v = 100_000, 24
    rng = CounterRNG("cpu", seed=11)
    probs = _sparse(n, v, g)
    x = sample(probs, rng)
    assert (probs.gather(1, x[:, None]) > 0).all()
    k = sample_without_replacement(probs[:2000], 3, rng)
    support = (probs[:2000] > 0).sum(-1)
    picked = probs[:2000].gather(1, k)
    assert ((picked > 0) | (torch.arange(3)[None] >= support[:, None])).all()
    # acceptance: bonus tokens and residual samples, exact and with sampled drafts
    tree = static_buffers(load_tree("small_12"))
    b = n // 10
    for sampled in (False, True):
        p = torch.stack([_sparse(b, v, g) for _ in range(tree.size)], 1)  # (B, N+1, V)
        q = torch.stack([_sparse(b, v, g) for _ in range(tree.size)], 1) if sampled else None
        src = q if sampled else p
        tokens = torch.multinomial(src[:, tree.parent].reshape(-1, v), 1).view(b, tree.size)
        acc = accept_sampling(tokens, p, tree, rng, q=q)
        last = acc.path.gather(1, (acc.count - 1)[:, None]).squeeze(1)
        # the bonus is drawn from p after the last accepted node (or a residual of it)
        assert (p[torch.arange(b), last].gather(1, acc.bonus[:, None]) > 0).all()


def test_relaxed_rules_never_return_a_token_of_target_probability_zero():
    """Drafts the target rules out (p = 0) are neither accepted nor relaxed, whatever the rule."""
    from runtime.core.acceptance import accept_greedy
    from runtime.core.relaxation import Relaxation
    from runtime.core.proximity import compute_neighbours

    g = torch.Generator().manual_seed(3)
    v, b = 16, 20_000
    nb = compute_neighbours(torch.randn(v, 2, generator=g), 6)
    tree = static_buffers(load_tree("small_12"))
    rng = CounterRNG("cpu", seed=5)
    p = torch.stack([_sparse(b, v, g) for _ in range(tree.size)], 1)
    q = torch.stack([_sparse(b, v, g) for _ in range(tree.size)], 1)
    # drafts drawn from q regardless of p: many have p = 0 at their parent
    tokens = torch.multinomial(q[:, tree.parent].reshape(-1, v), 1).view(b, tree.size)
    for relax in [Relaxation(kind, delta=0.5, lam=8.0, neighbours=nb, rule=rule)
                  for kind in ("delta", "lambda") for rule in ("paper", "bounded")]:
        for sampled in (False, True):
            acc = accept_sampling(tokens, p, tree, rng, q=q if sampled else None, relax=relax)
            rows = torch.arange(b)
            for d in range(1, tree.max_depth + 1):  # every accepted draft has p > 0 at its parent
                node = acc.path[:, d]
                ok = acc.count > d
                px = p[rows, tree.parent[node]].gather(1, tokens[rows, node][:, None]).squeeze(1)
                assert (px[ok] > 0).all(), (relax.kind, sampled, d)
            last = acc.path.gather(1, (acc.count - 1)[:, None]).squeeze(1)
            assert (p[rows, last].gather(1, acc.bonus[:, None]) > 0).all(), (relax.kind, sampled)
        greedy = accept_greedy(tokens, p, tree, relax)
        for d in range(1, tree.max_depth + 1):
            node = greedy.path[:, d]
            ok = greedy.count > d
            px = p[torch.arange(b), tree.parent[node]].gather(1, tokens[torch.arange(b), node][:, None]).squeeze(1)
            assert (px[ok] > 0).all()


def test_race_picks_what_argmax_of_p_over_exponential_picks():
    """race = argmin(p / log u) is argmax(p / E) bit for bit, zeros, ties and u near 1 included."""
    g = torch.Generator().manual_seed(5)
    p = torch.rand(4096, 64, generator=g)
    p[p < 0.3] = 0.0
    p[:, 7] = p[:, 3]  # exact ties
    u = torch.rand(4096, 64, generator=g).clamp(1e-7, 1 - 2**-24)
    u[:, :4] = 1 - 2**-24
    from runtime.core.rng import exponential_from_uniform, race
    assert torch.equal(race(p, u), torch.argmax(p / exponential_from_uniform(u), dim=-1))
