"""Parallel Jacobi decoding as the released code runs it (`--method pjd --accept published`).

The released PJD loop (boyaliao/PJD e7b93ad, `scheduler/jacobi_iteration_lumina_mgpt.py`; the
rules are set out in docs/methods.md) gives every started, unfinished image row ("ongoing row")
its own Jacobi window and verifies all of them in one target forward. Later rows commit tokens
ahead of the raster frontier, so the cache holds tokens out of raster order: here each image
index has its own cache slot (slot = cls + index), and a query at index i sees

    the condition,
    every slot j < i whose KV is valid (a committed token's KV, computed once),
    the committed leading tokens (and KV-only nodes) of this forward at j < i,
    its own window's nodes up to itself,

which is the released code's row-layout cache with its row-causal mask (earlier rows' drafts
hidden, their leading tokens visible), written by index instead of by row.

Rows (C = row width, K = codes per row: C - 1 with a row-end token (Lumina-mGPT), else C):

    window      the row's leading token (its last committed code, re-input so its KV is computed,
                or before its first code the row's lead: the row-end token above it) plus drafts.
                The first ongoing row verifies min(K - codes, W) nodes, a later row
                min(codes of the row above - its codes, W): it never passes the row above.
    acceptance  every row walks its drafts with u < min(1, p/q). The first ongoing row samples
                norm(max(p - q, 0)) at its first rejection (the bonus from p when all pass) and
                commits accepted drafts + that token; a later row commits its accepted drafts
                only. After a row's first rejection, a later draft of the row with
                min(1, p/q) > 0.5 is carried into the next forward with its old q; every other
                position takes the target's sample of p there (q = that p). Fresh positions get
                the `init` prior with a one-hot q (the released code: uniform tokens).
    KV          a committed token's KV is the one computed when it was verified, except a row's
                last committed token, re-input as the leading node of the row's next window; a
                finished row's last code is run once more as a KV-only node.
    rows        row r + 1 starts once row r has W codes (or is complete); with a row-end token,
                row r's row-end is committed then (the forced token, row r + 1's lead).

What differs from the released code, each on purpose, is listed in docs/methods.md: the first
image token, per-image acceptance, the `pjd_rows` cap, the shift after a finished row, and a
layout without row-end tokens (LlamaGen).

Shapes are fixed (B images x T = R * W + R nodes, R = `pjd_rows`), so the verify forward is
captured like the other methods' steps, once per node-count bucket (`ROW_BUCKETS` rows of W + 1
nodes; a step replays the smallest that holds its nodes, eager steps run just those). The row
scheduling and the acceptance walk run on the host: three device reads per forward (the
acceptance numbers, the target's samples, then the first row's sampled token). Lossy in law
(later rows condition on a partly generated row above) and not equal to AR
under greedy decoding; with `pjd_rows` 1 and greedy decoding it is AR token for token.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from runtime.core.slots import (Finished, ImageStats, SlotDecoder, SlotRequest, compile_key, nonfinite_error, phase_timer,
                                 prefill_slot)
from runtime.core.law import tv_from_ar
from runtime.core.methods import MethodSpec
from runtime.core.rng import CounterRNG, token_from_uniform
from runtime.core.state import MODEL_PARTS, DecodeConfig
from runtime.utils.errors import UserError

if TYPE_CHECKING:
    from backends import Backend
    from backends.base import PhaseTimer
    from runtime.models.target import Target

# keyed-noise stream of the uniform prior (jacobi.py uses 1 and 2, pjd.py 3)
PRIOR_STREAM = 4
# rows in flight a captured verify is sized for (each also capped at pjd_rows): fine where images
# keep few rows in flight (2-4 at 256 px), coarser beyond (5-7 at 768 px)
ROW_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16)


@dataclass
class _Image:
    """One slot's image on the host: tokens by image index and the rows' progress.

    tok (S,) committed token or current draft; committed / drafted / kv_ok (S,) bool; prior (S,)
    the uniform prior's token per index; codes[r] committed codes of row r (a prefix of the row);
    started[r]; pending: finished rows' last codes whose KV is still to be computed."""

    request: SlotRequest
    tok: np.ndarray
    committed: np.ndarray
    drafted: np.ndarray
    kv_ok: np.ndarray
    prior: np.ndarray
    codes: list[int]
    started: list[bool]
    pending: list[int] = field(default_factory=list)
    forwards: int = 0  # target forwards after the prefill
    accepted_drafts: int = 0
    done: bool = False
    row_ended: bool = False  # a row finished in the last forward
    # `measure_law`: the p (S, V) each token was judged under (index 0: the prefill's), and where set
    judged: torch.Tensor | None = None
    judged_mask: np.ndarray | None = None
    trace: list[dict[str, Any]] = field(default_factory=list)  # per forward: rows, windows, committed


@dataclass
class _Node:
    """A node of the next forward: its token, image index (position - cls), cache slot, window id,
    whether its token is committed (its KV is visible to later rows in this forward), its q key
    (the ring entry of a draft's q) or -1, and whether it only computes a finished row's last KV."""

    token: int
    index: int
    slot: int
    window: int
    fresh: bool
    qkey: int = -1
    kv_only: bool = False


class PublishedPJD(SlotDecoder):
    """The released PJD loop over the slot API (`admit` -> `step` -> `finished` -> `release`), as
    `runtime.core.decoder.Decoder` offers it (`SlotDecoder`). See the module docstring."""

    def __init__(self, target: Target, spec: MethodSpec, *, backend: Backend | None = None,
                 batch_size: int = 1) -> None:
        self.config = config = DecodeConfig.for_models(
            target, None, spec, batch_size, lean_head=False,
            attention=None if backend is None else backend.cached_attention())
        self.backend = backend
        self.timer: PhaseTimer | None = None
        self.measure_law = False  # record each token's p and its TV from AR's at the end (`_law`)
        b, dev, s = config.batch, config.device, config.num_tokens
        self.width = target.row_width  # C
        self.row_end = target.row_end
        self.codes_per_row = self.width - 1 if self.row_end >= 0 else self.width  # K
        self.grid_rows = s // self.width  # G
        if self.grid_rows * self.width != s:
            raise UserError(f"--accept published needs an image of whole rows: {s} tokens are not rows of {self.width}")
        self.window, self.rows = spec.pjd_window, spec.pjd_rows  # W, R
        self.nodes = self.rows * self.window + self.rows  # T: R windows and R KV-only nodes
        t, v = self.nodes, config.vocab
        self.scratch = config.cls + s  # first scratch slot: cls + S + node
        self.cache = config.new_cache(target, config.rows, self.scratch + t)
        self.start_cache = config.new_cache(target, config.rows // b, config.cls)
        self.slot_ids = torch.arange(self.cache.capacity, device=dev)

        def longs(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.long, device=dev)

        self.node_tok, self.node_pos, self.node_slot, self.node_win = longs(b, t), longs(b, t), longs(b, t), longs(b, t)
        self.fresh = torch.zeros(b, self.cache.capacity, dtype=torch.bool, device=dev)
        # host staging of the node buffers: filled per image by `_plan`, copied up once per step
        self.host = {name: np.zeros((b, self.nodes), dtype=np.int64) for name in ("tok", "pos", "slot", "win", "qkey")}
        self.host_fresh = np.zeros((b, self.cache.capacity), dtype=bool)
        self.one_hot: list[tuple[int, int, int]] = []  # (image, q key, token) of this step's fresh drafts
        self.q_writes: list[tuple[int, int, int]] = []  # (image, q key, node) of the next drafts' q
        self.p = torch.zeros(b, t, v, device=dev)
        self.q_nodes = torch.zeros(b, t, v, device=dev)
        self.q_ring = torch.zeros(b, self.rows * self.window, v, device=dev)  # a draft's q by (row % R, col % W)
        self.tril = torch.ones(t, t, dtype=torch.bool, device=dev).tril()
        self.image_ids = torch.arange(b, device=dev)
        self.prev_ids = torch.arange(t, device=dev).sub(1).clamp(min=0)  # the node before each (itself for 0)
        self.zero_counts = torch.zeros(b, dtype=torch.long, device=dev)  # dist's counts: nodes carry their index
        self.rng = CounterRNG(dev, streams=b)
        # node counts a captured verify runs: rows in flight 1, 2, 3, 4, 6, 8, 12, 16 up to R, and R,
        # each with W + 1 nodes (the last is T); a step replays the smallest that holds its nodes
        self.buckets = sorted({min(k, self.rows) * (self.window + 1) for k in ROW_BUCKETS + (self.rows,)})
        self.verify_at: dict[int, Callable[[], None]] = {}  # captured verifies by node count (graph mode)
        self.captured = backend is None or not backend.graph_mode
        self.images: list[_Image | None] = [None] * b
        self._pad_nodes()

    # -- the fixed-shape step -------------------------------------------------------------------
    def verify_step(self, used: int | None = None) -> None:
        """One target forward over the first `used` nodes (all T by default, the captured form)
        in `node_*` (B, T): KV written at `node_slot`, the mask built from `fresh` and the windows;
        fills p[:, :used] (B, used, V) after each node. Padding nodes see only themselves and no
        other node sees them, so `used` changes no planned node's numbers' inputs."""
        config, cache = self.config, self.cache
        b, t = config.batch, used or self.nodes
        pos, slot, win = self.node_pos[:, :t], self.node_slot[:, :t], self.node_win[:, :t]
        # by index (slot = cls + index on image slots; a stand-in's scratch slot is never fresh)
        ahead = self.slot_ids[None, None, :] < pos[:, :, None]  # (B, t, cap)
        seen = self.fresh[:, None, :] & ahead
        same = (win[:, :, None] == win[:, None, :]) & self.tril[:t, :t]  # (B, t, t)
        own = torch.zeros_like(seen).scatter_(2, slot[:, None, :].expand(b, t, t), same)
        prefix = cache.prefix_valid & (self.slot_ids < config.cls)  # (rows, cap)
        mask = config.expand_rows(seen | own) | prefix[:, None, :]
        x = config.target.tok_embeddings(config.expand_rows(self.node_tok[:, :t]))
        hidden = config.target.forward_at(x, config.expand_rows(pos), config.expand_rows(slot),
                                          cache.additive(mask)[:, None], cache)
        logits = config.target.logits(hidden)
        index = pos - config.cls + 1  # the image index each node's p is for
        zero = self.zero_counts
        if config.params.greedy:  # a one-hot p: the released code's most greedy setting (top-k 1)
            best = config.dist(logits, zero, index, rank=True).argmax(-1)
            self.p[:, :t].copy_(torch.nn.functional.one_hot(best, config.vocab).to(self.p.dtype))
        else:
            self.p[:, :t].copy_(config.dist(logits, zero, index))

    # -- capture ----------------------------------------------------------------------------------
    @torch.no_grad()
    def capture_steps(self, cond: torch.Tensor | None = None, cond_mask: torch.Tensor | None = None) -> None:
        """Capture the verify forward once per node-count bucket (graph mode); any state does
        (padding nodes)."""
        backend = self.backend
        assert backend is not None, "steps are captured only with a backend in graph mode"
        suffix = f".b{self.config.batch}" if self.config.batch > 1 else ""
        with backend.compile_cache(self.compile_key):
            for t in self.buckets:
                step = functools.partial(self.verify_step, t)
                self.verify_at[t] = backend.capture(step, name=f"pjd-published.verify.t{t}{suffix}")
        self.captured = True

    @property
    def compile_key(self) -> str:
        return compile_key(self.config)

    def state_bytes(self) -> int:
        """Bytes of the decode state: the KV cache and the p / q buffers."""
        return sum(x.numel() * x.element_size() for x in (self.cache.kv_all, self.p, self.q_nodes, self.q_ring))

    # -- the slot API -----------------------------------------------------------------------------
    @torch.no_grad()
    def admit(self, slot: int, request: SlotRequest) -> None:
        """Start `request` in the free `slot`: its prefill now (one image at a time)."""
        held = self.images[slot]
        if held is not None:
            raise ValueError(f"slot {slot} is busy (holds {held.request.key!r})")
        if not self.captured:
            self.capture_steps()
        with self._phase("prefill"):
            self.images[slot] = self._start(slot, request)

    @property
    def slots(self) -> list[SlotRequest | None]:
        """The request each slot holds (None: free), as `Decoder.slots`."""
        return [None if im is None else im.request for im in self.images]

    def release(self, slot: int) -> None:
        self.images[slot] = None

    def busy(self) -> list[int]:
        return [i for i, im in enumerate(self.images) if im is not None]

    def reset_slots(self) -> None:
        self.images = [None] * self.config.batch

    def progress(self) -> list[tuple[int, Any, int]]:
        """(slot, key, tokens known) per busy slot: known = the committed raster prefix (later rows'
        tokens ahead of it are not counted)."""
        return [(i, im.request.key, _prefix(im.committed)) for i, im in enumerate(self.images) if im is not None]

    def committed(self, slot: int, known: int) -> torch.Tensor:
        """The first `known` tokens of the image in `slot` (a `progress` count), on the host."""
        im = self.images[slot]
        assert im is not None
        return torch.from_numpy(im.tok[:known].copy())

    def finished(self, progress: bool = False) -> list[Finished]:
        done = []
        for i, im in enumerate(self.images):
            if im is not None and im.done:
                tokens = torch.from_numpy(im.tok.copy()).to(self.config.device)
                tvd, steps = ((0.0, 0) if im.judged is None or im.judged_mask is None
                              else tv_from_ar(self.config, im.request.cond, im.request.mask, im.tok, im.judged,
                                              im.judged_mask))
                stats = ImageStats(tokens=self.config.num_tokens, target_forwards=1 + im.forwards,
                                   accepted_tokens=self.config.num_tokens, depth_accepted=[], depth_reached=[],
                                   relax_mass=0.0, accepted_drafts=im.accepted_drafts,
                                   law_tvd=tvd, law_bound=float(steps), law_steps=steps)
                done.append(Finished(i, im.request.key, tokens, stats))
        return done


    @torch.no_grad()
    def step(self) -> None:
        """One forward for every busy slot's unfinished image, then each image's acceptance."""
        if not self.busy():
            raise ValueError("step() before any request was admitted")
        plans: list[list[list[_Node]] | None] = []
        with self._phase("draft"):
            self._pad_nodes()
            for i, im in enumerate(self.images):
                plans.append(None if im is None or im.done else self._plan(i, im))
            # eager: the forward over the nodes some image uses; captured: the smallest bucket holding them
            used = max((sum(len(w) for w in plan) for plan in plans if plan is not None), default=1)
            self._upload(used)
        with self._phase("verify"):
            if self.verify_at:
                self.verify_at[next(t for t in self.buckets if t >= used)]()
            else:
                self.verify_step(used)
        with self._phase("accept"):
            self._accept(plans, used)
        if self.backend is not None:
            self.backend.mark_step()

    # -- host side --------------------------------------------------------------------------------
    def _phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        return phase_timer(self.timer).phase(name)

    def _start(self, i: int, request: SlotRequest) -> _Image:
        """Prefill the image's condition into its slot's rows and commit its first token."""
        config = self.config
        _, logits, _ = prefill_slot(config, self.cache, self.start_cache, self.rng, i, request.cond, request.mask,
                                 request.seed)
        img = self.image_ids[i:i + 1]
        _check_finite(logits, request, 0, config)
        zero = torch.zeros(1, dtype=torch.long, device=config.device)
        probs = config.dist(logits, zero)
        first = int(probs.argmax(-1) if config.params.greedy else self.rng.race(probs, streams=img))
        s = config.num_tokens
        index = torch.arange(s, device=config.device)[None].expand(config.batch, s)
        prior = token_from_uniform(self.rng.keyed_uniform(index, stream=PRIOR_STREAM)[i], config.vocab).cpu().numpy()
        im = _Image(request=request, tok=np.zeros(s, dtype=np.int64), committed=np.zeros(s, dtype=bool),
                    drafted=np.zeros(s, dtype=bool), kv_ok=np.zeros(s, dtype=bool), prior=prior,
                    codes=[0] * self.grid_rows, started=[False] * self.grid_rows)
        im.started[0] = True
        self._commit(im, 0, first)
        if self.measure_law and not config.params.greedy:
            im.judged = torch.zeros(s, config.vocab, device=config.device)
            im.judged[0] = probs[0, 0]
            im.judged_mask = np.zeros(s, dtype=bool)
            im.judged_mask[0] = True
        im.codes[0] = 1
        self._start_rows(im)
        return im

    def _commit(self, im: _Image, index: int, token: int) -> None:
        im.tok[index] = token
        im.committed[index] = True

    def _row_of(self, index: int) -> int:
        return index // self.width

    def _ongoing(self, im: _Image) -> list[int]:
        return [r for r in range(self.grid_rows) if im.started[r] and im.codes[r] < self.codes_per_row]

    def _start_rows(self, im: _Image) -> None:
        """Start the row after the last started one once that has W codes (or is complete), while
        fewer than R rows are ongoing; commit its lead (the row-end above it) where the layout has one."""
        last = max(r for r in range(self.grid_rows) if im.started[r])
        if last + 1 >= self.grid_rows or len(self._ongoing(im)) >= self.rows:
            return
        if im.codes[last] >= min(self.window, self.codes_per_row):
            im.started[last + 1] = True
            if self.row_end >= 0:
                self._commit(im, (last + 1) * self.width - 1, self.row_end)

    def _prior_token(self, im: _Image, index: int) -> int:
        """A fresh position's draft: the `init` prior (uniform; repeat-h: the token to the left;
        repeat-v: the one above, where they exist)."""
        init = self.config.spec.init
        if init == "repeat-h" and index % self.width > 0:
            return int(im.tok[index - 1])
        if init == "repeat-v" and index >= self.width:
            return int(im.tok[index - self.width])
        return int(im.prior[index])

    def _qkey(self, index: int) -> int:
        return (self._row_of(index) % self.rows) * self.window + (index % self.width) % self.window

    def _plan(self, i: int, im: _Image) -> list[list[_Node]]:
        """Fill slot i's nodes for the next forward; returns its windows (lists of nodes, leading
        node first; KV-only nodes last, as windows of one)."""
        windows: list[list[_Node]] = []
        ongoing = self._ongoing(im)
        t = 0
        one_hot: list[tuple[int, int]] = []  # (q key, token) of fresh drafts
        leads: set[int] = set()
        for k, r in enumerate(ongoing):
            base = r * self.width
            if k == 0:
                n = min(self.codes_per_row - im.codes[r], self.window)
            else:
                n = min(im.codes[ongoing[k - 1]] - im.codes[r], self.window)
            lead = base + im.codes[r] - 1  # the last committed code, or the lead before the row
            nodes = []
            if im.committed[lead]:
                nodes.append(_Node(int(im.tok[lead]), lead, self.config.cls + lead, k, True))
                leads.add(lead)
            else:  # no row-end token and the row above not done: a stand-in at a scratch slot
                stand_in = int(im.tok[(r - 1) * self.width + im.codes[r - 1] - 1])
                nodes.append(_Node(stand_in, lead, self.scratch + t, k, False))
            for j in range(1, n):
                idx = lead + j
                if not im.drafted[idx]:
                    im.tok[idx] = self._prior_token(im, idx)
                    im.drafted[idx] = True
                    one_hot.append((self._qkey(idx), int(im.tok[idx])))
                nodes.append(_Node(int(im.tok[idx]), idx, self.config.cls + idx, k, False, self._qkey(idx)))
            windows.append(nodes)
            t += len(nodes)
        im.pending = [idx for idx in im.pending if not im.kv_ok[idx]]
        for idx in im.pending:
            if idx not in leads:
                windows.append([_Node(int(im.tok[idx]), idx, self.config.cls + idx, len(windows), True, kv_only=True)])
        flat = [node for w in windows for node in w]
        n, cls, host = len(flat), self.config.cls, self.host
        assert n <= self.nodes, f"{n} nodes > {self.nodes}"
        host["tok"][i, :n] = [nd.token for nd in flat]
        host["pos"][i, :n] = [cls + nd.index for nd in flat]
        host["slot"][i, :n] = [nd.slot if nd.slot < self.scratch else self.scratch + c for c, nd in enumerate(flat)]
        host["win"][i, :n] = [nd.window for nd in flat]
        host["qkey"][i, :n] = [max(nd.qkey, 0) for nd in flat]
        fresh = self.host_fresh[i, cls:self.scratch]
        fresh[:] = im.kv_ok
        fresh[[nd.index for nd in flat if nd.fresh]] = True
        self.one_hot += [(i, key, token) for key, token in one_hot]
        return windows

    def _upload(self, used: int) -> None:
        """The staged nodes to the device buffers: one copy each, the fresh drafts' one-hot q into
        the ring, then the q of the first `used` nodes gathered from it."""
        dev = self.config.device
        for name, buf in (("tok", self.node_tok), ("pos", self.node_pos), ("slot", self.node_slot),
                          ("win", self.node_win)):
            buf.copy_(torch.from_numpy(self.host[name]).to(dev))
        self.fresh.copy_(torch.from_numpy(self.host_fresh).to(dev))
        if self.one_hot:
            i, key, token = (torch.tensor(col, device=dev) for col in zip(*self.one_hot))
            self.q_ring[i, key] = torch.nn.functional.one_hot(token, self.config.vocab).to(self.q_ring.dtype)
            self.one_hot = []
        keys = torch.from_numpy(self.host["qkey"][:, :used]).to(dev)
        self.q_nodes[:, :used] = self.q_ring.gather(1, keys[..., None].expand(-1, -1, self.config.vocab))

    def _pad_nodes(self) -> None:
        """Every staged node a padding node: its own window and scratch slot, position cls; nothing fresh."""
        t, host = self.nodes, self.host
        ids = np.arange(t)
        host["tok"][:] = 0
        host["pos"][:] = self.config.cls
        host["slot"][:] = self.scratch + ids
        host["win"][:] = t + ids  # window ids no planned node uses
        host["qkey"][:] = 0
        self.host_fresh[:] = False

    def _accept(self, plans: list[list[list[_Node]] | None], used: int) -> None:
        """Acceptance numbers on the device for the first `used` nodes, then the walk on the host.
        Each image's random numbers are a function of its own forwards only: every draw advances
        the streams by the full T, whatever `used` (which depends on the batch-mates)."""
        config, b, t, v = self.config, self.config.batch, used, self.config.vocab
        draft = self.node_tok[:, :t]
        pd = self.p[self.image_ids[:, None], self.prev_ids[None, :t], draft]  # p after the node before, at the draft
        qd = self.q_nodes[:, :t].gather(2, draft[..., None])[..., 0]
        ratio = (pd / qd.clamp(min=1e-30)).clamp(max=1.0)
        u = self.rng.uniform(b, self.nodes)
        if config.params.greedy:
            sample = self.p[:, :t].argmax(-1)
        else:
            sample = self.rng.race(self.p[:, :t])
            self.rng.counter.add_((self.nodes - t) * v)
        finite = torch.isfinite(self.p[:, :t]).all(-1).to(ratio.dtype)
        # one transfer for the floats (ratio, uniform, whether p is finite), one for the sampled tokens
        floats = torch.stack([ratio, u[:, :t], finite]).cpu().numpy()
        ratio_h, u_h, sample_h = floats[0], floats[1], sample.cpu().numpy()
        self._check_nodes(plans, floats[2])
        # the walk: per image, per window; the first ongoing row's final token is sampled after it
        final_at = torch.zeros(b, dtype=torch.long)  # node whose p (or residual) gives the token
        residual = torch.zeros(b, dtype=torch.bool)
        walks: list[list[tuple[int, int, int, int | None]]] = [[] for _ in range(b)]  # (start, length, accepted, rejected at)
        for i, windows in enumerate(plans):
            if windows is None or self.images[i] is None:
                continue
            t0, per_window = 0, []
            for nodes in windows:
                n = len(nodes)
                accepted, rejected_at = n - 1, None
                for j in range(1, n):
                    if not u_h[i, t0 + j] < ratio_h[i, t0 + j]:
                        accepted, rejected_at = j - 1, j
                        break
                per_window.append((t0, n, accepted, rejected_at))
                t0 += n
            t0, n, _, rejected_at = per_window[0]  # the first ongoing row's window
            final_at[i] = t0 + (rejected_at if rejected_at is not None else n - 1)
            residual[i] = rejected_at is not None
            walks[i] = per_window
        tokens = self._final_tokens(final_at, residual)
        self.q_writes = []
        for i, windows in enumerate(plans):
            im = self.images[i]
            if windows is None or im is None:
                continue
            self._update(i, im, windows, walks[i], int(tokens[i]), ratio_h[i], sample_h[i])
        if self.q_writes:  # the next drafts' q: the p they were sampled from, one index op
            img, key, node = (torch.tensor(col, device=config.device) for col in zip(*self.q_writes))
            self.q_ring[img, key] = self.p[img, node]

    def _final_tokens(self, at: torch.Tensor, residual: torch.Tensor) -> np.ndarray:
        """Per image the first ongoing row's new token: a sample of norm(max(p - q, 0)) at its
        first rejection (node `at`: p from the node before, q of the rejected draft), else of p
        after its last node (the bonus)."""
        config = self.config
        at, residual = at.to(config.device), residual.to(config.device)
        rows = self.image_ids
        p_before = self.p[rows, (at - 1).clamp(min=0)]
        after = torch.where(residual[:, None], (p_before - self.q_nodes[rows, at]).clamp(min=0), self.p[rows, at])
        # a residual that rounds to zero mass keeps p (the released code would sample NaN)
        empty = after.sum(-1, keepdim=True) <= 0
        after = torch.where(empty, p_before, after)
        if config.params.greedy:
            return after.argmax(-1).cpu().numpy()
        return self.rng.race(after).cpu().numpy()

    def _update(self, i: int, im: _Image, windows: list[list[_Node]], walk: list[tuple[int, int, int, int | None]],
                final: int, ratio: np.ndarray, sample: np.ndarray) -> None:
        """Commit what the walk accepted, set the next drafts and their q, start rows."""
        config = self.config
        im.forwards += 1
        # after_row_end: a row finished in the previous forward (where the released code's tests shift)
        trace: dict[str, Any] = {"rows": [], "window": [], "committed": [], "after_row_end": im.row_ended}
        im.row_ended = False
        q_writes: list[tuple[int, int]] = []  # (q key, node whose p is the new q)
        judged: list[tuple[int, int]] = []  # (image index, node whose p judged it), when measuring
        for nodes, (t0, n, accepted, rejected_at) in zip(windows, walk):
            lead = nodes[0]
            if lead.kv_only:
                im.kv_ok[lead.index] = True
                continue
            r = self._row_of(lead.index + 1)
            first = nodes is windows[0]
            new = accepted + (1 if first else 0)
            for j in range(1, accepted + 1):
                self._commit(im, nodes[j].index, nodes[j].token)
            if first:
                self._commit(im, lead.index + accepted + 1, final)
            if im.judged is not None:  # each new token's p: the target's after the node before it
                judged.extend((lead.index + 1 + j, t0 + j) for j in range(new))
            im.accepted_drafts += accepted
            im.codes[r] += new
            last = r * self.width + im.codes[r] - 1
            for nd in nodes[: accepted + 1]:  # every committed node but the row's last keeps its KV
                if nd.slot == config.cls + nd.index and nd.index != last:
                    im.kv_ok[nd.index] = True
            # next drafts: the target's sample after each node, or a carried draft
            for j in range(n):
                idx = nodes[j].index + 1
                if idx <= last or idx >= r * self.width + self.codes_per_row:
                    continue
                carried = (rejected_at is not None and j + 1 < n and j + 1 > rejected_at
                           and ratio[t0 + j + 1] > 0.5)
                if carried:
                    continue
                im.tok[idx] = int(sample[t0 + j])
                im.drafted[idx] = True
                q_writes.append((self._qkey(idx), t0 + j))
            trace["rows"].append(r)
            trace["window"].append(n)
            trace["committed"].append(new)
            if im.codes[r] == self.codes_per_row:
                im.row_ended = True
                if r + 1 < self.grid_rows and not im.kv_ok[last]:
                    im.pending.append(last)
                if r + 1 == self.grid_rows and self.row_end >= 0:
                    self._commit(im, config.num_tokens - 1, self.row_end)
        im.trace.append(trace)
        if judged and im.judged is not None and im.judged_mask is not None:
            places = [a for a, _ in judged]
            judging = torch.tensor([t for _, t in judged], device=config.device)
            im.judged[torch.tensor(places, device=config.device)] = self.p[i, judging]
            im.judged_mask[places] = True
        self.q_writes += [(i, key, node) for key, node in q_writes]
        if all(c == self.codes_per_row for c in im.codes):
            im.done = True
            return
        self._start_rows(im)

    def _check_nodes(self, plans: list[list[list[_Node]] | None], finite: np.ndarray) -> None:
        """NaN or inf in p stops decoding with the image's name. finite: (B, used) 1.0 where a node's p is."""
        if finite.all():
            return
        for i, windows in enumerate(plans):
            im = self.images[i]
            if windows is None or im is None:
                continue
            hits = np.flatnonzero(finite[i, :sum(len(w) for w in windows)] == 0)
            if hits.size:
                _raise_nonfinite(im.request, int(self.host["pos"][i, hits[0]]) - self.config.cls + 1, self.config)


def _prefix(committed: np.ndarray) -> int:
    """Length of the leading run of True."""
    gaps = np.flatnonzero(~committed)
    return int(gaps[0]) if gaps.size else int(committed.size)


def _check_finite(logits: torch.Tensor, request: SlotRequest, index: int, config: DecodeConfig) -> None:
    if not bool(torch.isfinite(logits).all()):
        _raise_nonfinite(request, index, config)


def _raise_nonfinite(request: SlotRequest, index: int, config: DecodeConfig) -> None:
    raise nonfinite_error(MODEL_PARTS[0], request.key, index, config.dtype)
