"""Counter-based random numbers: deterministic, device-independent, and graph-safe.

Every random draw in the decoding loop is a pure function of (seed, counter, index):
splitmix64 over int64 tensors. Nothing is read back to the host, the state is a pair of 0-d
device tensors updated in place (so a captured graph replays correctly), and the same seed
gives the same numbers on CPU, CUDA and HPU. Only 24-bit floats are produced so no fp64 is
needed (Gaudi has none).

Uniforms are (k + 0.5) / 2^23 for a 23-bit integer k: every value is exact in float32 and lies
in [2^-24, 1 - 2^-24], so log(u) and log(-log(u)) are finite. (A 24-bit k rounds k + 0.5 up to
2^24 for the largest k, giving u = 1.0 and Gumbel noise +inf, which picks its index whatever
its probability: about one categorical sample in a thousand at V = 16384.)
"""

from __future__ import annotations

import hashlib

import torch

_MASK64 = (1 << 64) - 1


def _signed(c: int) -> int:
    c &= _MASK64
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MUL1 = _signed(0xBF58476D1CE4E5B9)
_MUL2 = _signed(0x94D049BB133111EB)


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def splitmix64(x: torch.Tensor, final: bool = True) -> torch.Tensor:
    """splitmix64's output mix of x (int64). `final=False` skips the last xor-shift: z ^ (z >>> 31)
    has the top 33 bits of z, so a caller that reads only the top 23 (`_to_uniform`) gets
    the same numbers three kernels sooner."""
    z = x + _GOLDEN
    z = (z ^ _shr(z, 30)) * _MUL1
    z = (z ^ _shr(z, 27)) * _MUL2
    return z ^ _shr(z, 31) if final else z


def derive_seed(seed: int, *keys: int | str) -> int:
    """A 63-bit seed from a run seed and keys (e.g. the image index): stable across runs."""
    h = hashlib.sha256(repr((int(seed),) + tuple(keys)).encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


class CounterRNG:
    """Streams of uniforms in (0, 1), one per image, each keyed by a seed and its own counter.

    seeds, counter (S,): int64 device tensors; key = splitmix64(seeds), kept so a draw does
    not rehash the seeds. One stream (S = 1): `uniform(*shape)` returns float32 of `shape` in
    [2^-24, 1 - 2^-24] from counter positions counter .. counter + numel - 1. S streams (a
    batch of S images): the leading dim of `shape` must be S and row i is drawn from stream i
    at positions counter[i] .. counter[i] + numel/S - 1 (`streams=` draws from a subset of
    them). The counters then advance past what was used, so successive draws never overlap,
    and image i of a batch gets exactly the numbers it gets alone from the same seed, even when
    it starts later than its batch-mates (`reset_streams`).
    """

    def __init__(self, device: torch.device | str, seed: int = 0, streams: int = 1) -> None:
        self.streams = streams
        self.seed = torch.full((streams,), seed, dtype=torch.long, device=device)
        self.key = splitmix64(self.seed)
        self.counter = torch.zeros(streams, dtype=torch.long, device=device)
        self._half = torch.full((), 0.5 / (1 << 23), device=device)

    def reset(self, seed: int | torch.Tensor) -> None:
        """Restart at `seed` (an int, or (S,) seeds, one per stream) in place (buffers keep
        their identity for graphs)."""
        if isinstance(seed, torch.Tensor):
            self.seed.copy_(seed)
        else:
            self.seed.fill_(seed)
        self.key.copy_(splitmix64(self.seed))
        self.counter.zero_()

    def reset_streams(self, streams: torch.Tensor, seeds: torch.Tensor) -> None:
        """Restart streams (long ids) at `seeds` (same shape), leaving the others as they are."""
        self.seed.index_copy_(0, streams, seeds)
        self.key.index_copy_(0, streams, splitmix64(seeds))
        self.counter.index_fill_(0, streams, 0)

    def uniform(self, *shape: int, streams: torch.Tensor | None = None, out: torch.Tensor | None = None
                ) -> torch.Tensor:
        """Uniforms of `shape`; with `streams` (long ids), from those streams only (leading dim
        = len(streams)). out: a contiguous float32 tensor of `shape` to write them into."""
        n = 1
        for s in shape:
            n *= s
        lead = self.streams if streams is None else streams.numel()
        if lead > 1 and (not shape or shape[0] != lead):
            raise ValueError(f"a draw from {lead} streams needs leading dim {lead}, got {shape}")
        per = n // lead
        key, counter = (self.key, self.counter) if streams is None else (self.key[streams], self.counter[streams])
        ids = counter[:, None] + torch.arange(per, device=counter.device)
        bits = splitmix64(key[:, None] ^ ids, final=False)  # (S, per): the top 23 bits are splitmix64's
        if streams is None:
            self.counter.add_(per)
        else:
            self.counter.index_add_(0, streams, torch.full_like(streams, per))
        return _to_uniform(bits, self._half, None if out is None else out.view(bits.shape)).view(shape)

    def gumbel(self, *shape: int, streams: torch.Tensor | None = None) -> torch.Tensor:
        return gumbel_from_uniform(self.uniform(*shape, streams=streams))

    def race(self, weights: torch.Tensor, streams: torch.Tensor | None = None) -> torch.Tensor:
        """One sample per row of weights (..., V) by `race`, from uniforms of its shape."""
        return race(weights, self.uniform(*weights.shape, streams=streams))

    def exponential(self, *shape: int, streams: torch.Tensor | None = None) -> torch.Tensor:
        """Standard exponential noise E = -log(u), positive and finite: top-k of p / E is
        Gumbel-top-k of p (k draws without replacement), -log(E) being Gumbel noise."""
        return exponential_from_uniform(self.uniform(*shape, streams=streams))

    def keyed_uniform(self, index: torch.Tensor, stream: int = 1) -> torch.Tensor:
        """Uniforms that are a pure function of (seed, stream, index), float32 like `uniform`.

        The counter is not used or advanced: the same index gives the same number every time
        it is drawn (position-keyed noise, e.g. Gumbel-coupled Jacobi drafts). index: long,
        (S, ...) with S streams (row i keyed by stream i's seed), any shape with one stream;
        stream >= 1 keeps these numbers apart from the counter stream.
        """
        stream_key = splitmix64(self.key + _signed(stream * 0x9E3779B97F4A7C15))
        if self.streams > 1:
            stream_key = stream_key.view(-1, *([1] * (index.dim() - 1)))
        else:
            stream_key = stream_key[0]
        return _to_uniform(splitmix64(stream_key ^ index, final=False), self._half)


# the smallest normal float32: the floor of exponential noise (and its negation's ceiling)
_SMALLEST_NORMAL = 1.1754944e-38


def _to_uniform(bits: torch.Tensor, half: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """(k + 0.5) / 2^23 for k the top 23 bits, float32: one add that scales k on the way
    (every step exact in float32, so this equals converting, adding and scaling apart).
    half: the 0-d float32 0.5 / 2^23; out: where to write them (bits' shape)."""
    if out is None:
        return torch.add(half, _shr(bits, 41), alpha=1.0 / (1 << 23))
    return torch.add(half, _shr(bits, 41), alpha=1.0 / (1 << 23), out=out)


def exponential_from_uniform(u: torch.Tensor) -> torch.Tensor:
    """Standard exponential noise -log(u) for u in (0, 1), floored at the smallest normal
    float32 so that a device whose log rounds log(1 - 2^-24) to 0 still yields a positive
    number (and finite Gumbel noise below)."""
    return (-torch.log(u)).clamp(min=_SMALLEST_NORMAL)


def neg_exponential_from_uniform(u: torch.Tensor) -> torch.Tensor:
    """-E for E = `exponential_from_uniform(u)`, bit for bit (IEEE negation is exact), in two
    kernels instead of three: log(u) capped below 0. A score w / -E is the exact negation of
    w / E, so the smallest scores of one are the largest of the other."""
    return torch.log(u).clamp(max=-_SMALLEST_NORMAL)


def race(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The exponential race argmax(w / E), E = exponential_from_uniform(u), over the last dim:
    a sample of index i with probability w_i / sum(w) (w >= 0, not all 0). Computed as
    argmin(w / -E) with -E = log(u) capped below 0: bit for bit the negated scores (IEEE
    negation and division are sign-symmetric), so the same index, in four kernels instead
    of five."""
    return torch.argmin(weights / neg_exponential_from_uniform(u), dim=-1)


def gumbel_from_uniform(u: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise -log(-log(u)) for u in (0, 1); finite for every u `uniform` returns."""
    return -torch.log(exponential_from_uniform(u))


def token_from_uniform(u: torch.Tensor, vocab: int) -> torch.Tensor:
    """A uniform token in [0, vocab) from uniforms u in [0, 1) (same shape, long): floor(u * vocab),
    clamped where float rounding lands on vocab."""
    return (u * vocab).long().clamp(max=vocab - 1)
