"""`--dynamic-depth` keeps sampling exact in law, checked where a cut actually happens.

A tiny target on a 3x3 grid with 3 codes (19,683 possible images, the exact AR law enumerated)
and an untrained drafter; an 8-deep chain cut by the dynamic-depth rule; 10,000 images. Every
position's marginal and every adjacent pair's joint law are compared with the enumerated law
(Pearson chi-square, Bonferroni over all 17). A cut decided from the sampled drafts' own path
probability fails this one image at a time (seen: p = 1.2e-8 for the pair (x1, x2)); a cut
decided before the judged level is sampled passes.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from runtime.core import MethodSpec, SamplingParams, generate
from runtime.core.sampling import apply_cfg, probabilities
from tiny_models import tiny_pair

PARAMS = SamplingParams(temperature=1.0, cfg=1.5)
IMAGES = 10_000


def _exact_law(target) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequences (S, T) long, P(sequence) (S,) float64) for class 1, by enumeration."""
    cfg = target.config
    seqs = torch.tensor(list(itertools.product(range(cfg.vocab_size), repeat=cfg.block_size)))
    cond = torch.full((len(seqs),), 1)
    with torch.no_grad():
        logits, _ = target.forward_train(cond, seqs)
        unc, _ = target.forward_train(torch.full_like(cond, cfg.num_classes), seqs)
        probs = probabilities(apply_cfg(torch.cat([logits, unc]), PARAMS.cfg), PARAMS)
    return seqs, probs.double().gather(2, seqs[..., None]).squeeze(-1).prod(1)


def _p_value(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson chi-square upper tail (Wilson-Hilferty), cells of expected count < 5 pooled."""
    small = expected < 5
    o = torch.cat([observed[~small], observed[small].sum()[None]]) if small.any() else observed
    e = torch.cat([expected[~small], expected[small].sum()[None]]) if small.any() else expected
    stat, df = float(((o - e) ** 2 / e.clamp(min=1e-12)).sum()), len(o) - 1
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def marginal_p_values(samples: torch.Tensor, seqs: torch.Tensor, law: torch.Tensor, v: int) -> dict[str, float]:
    """p-value of every position's marginal and every adjacent pair's joint law."""
    n, t = samples.shape
    out = {}
    for j in range(t):
        exp = torch.zeros(v, dtype=torch.float64).index_add_(0, seqs[:, j], law) * n
        out[f"x{j}"] = _p_value(torch.bincount(samples[:, j], minlength=v).double(), exp)
    for j in range(t - 1):
        cell = seqs[:, j] * v + seqs[:, j + 1]
        exp = torch.zeros(v * v, dtype=torch.float64).index_add_(0, cell, law) * n
        obs = torch.bincount(samples[:, j] * v + samples[:, j + 1], minlength=v * v).double()
        out[f"x{j}x{j + 1}"] = _p_value(obs, exp)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("threshold, batch", [(0.1, 1), (0.05, 64)])
def test_dynamic_depth_sampling_matches_the_exact_law_at_every_position(threshold, batch):
    """One image at a time the cut is each image's own (the old rule failed here: at
    threshold 0.1 the pair (x1, x2) at p = 1.2e-8); in a batch the deepest prefix any image
    wants is verified, which is exact too under this rule."""
    target, drafter = tiny_pair(vocab=3, grid=3, sharpness=0.1, seed=2)
    seqs, law = _exact_law(target)
    spec = MethodSpec(method="sd", depth=8, dynamic_depth=threshold, sampling=PARAMS)
    out = generate(target, drafter, spec, [1] * IMAGES, seed=7, batch_size=batch)
    depth = out.stats["mean_drafted_depth"]
    assert 1.2 < depth < 7.5, depth  # the cut happens, and not always at the same depth
    assert out.stats["step_compression"] > 1.3
    p = marginal_p_values(out.tokens, seqs, law, 3)
    worst = min(p, key=p.get)
    assert p[worst] > 1e-3 / len(p), (worst, p[worst])
