"""The one decoding loop: prefill, then draft -> verify -> accept/commit until the image is done.

Every method runs through this file: a method is a drafting policy (drafting.py: none,
static drafter tree, EAGLE-2 dynamic tree, Jacobi window) plus an acceptance rule
(acceptance.py). AR is the empty tree (verify the root, accept nothing, sample the bonus).
Each phase is a method over preallocated state with fixed shapes and no host reads, so a
backend can capture it once and replay it:

    draft   the policy fills `tokens` (B, N+1), and the proposal distributions `q`
            (B, N+1, V) where its drafts are sampled
    verify  one target forward over root + tree; fills `p` (B, N+1, V) and target hidden states
    accept  acceptance rule on the device, KV commit by index ops, output tokens appended,
            next root (bonus) and the next level-0 block prepared

The only host read per iteration is the check whether a slot's image is done (then a few
more to collect it).

Batch: B images decode together (`batch_size`), each in its own slot with its own KV length,
accepted path, bonus token, drafter state and random stream (keyed by the image's seed, so an
image's tokens do not depend on B, on its slot or on the images beside it). Model rows:
[cond_0..cond_B-1, uncond_0..uncond_B-1] with classifier-free guidance (2B), else B. When an
image is done, the host loop takes its tokens and starts the next image of the workload in
its slot (`start_image`, between steps: the captured steps never change shape); a slot with
no image left keeps stepping, with every advance (KV length, token count, drafter cache,
statistics) multiplied by 0, until the last image is done.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from runtime.core.acceptance import Accepted, GroupRule, Relaxation, acceptance_rule
from runtime.core.policies import make_policy
from runtime.core.methods import MethodSpec
from runtime.core.opcount import kernels_generated
from runtime.core.rng import CounterRNG
from runtime.core.state import DecodeState
from runtime.errors import UserError

if TYPE_CHECKING:
    from backends import Backend
    from runtime.models.target import DrafterModel, Target


# the models whose distributions the loop checks for NaN / inf, in `Decoder.nonfinite` order
MODEL_PARTS = ("target model", "drafter")
NO_POSITION = 1 << 40


@dataclass(frozen=True)
class SlotRequest:
    """One image to decode in a slot: key (the caller's name for it, returned with its result),
    cond (1,) label or (1, cls, caption_dim) / (1, cls) prompt, mask (1, cls) or None, seed (its
    random stream: its tokens depend on nothing else)."""
    key: Any
    cond: torch.Tensor
    mask: torch.Tensor | None
    seed: int


@dataclass(frozen=True)
class Finished:
    """A done image: its slot, its request's key, tokens (block_size,) on the device, statistics."""
    slot: int
    key: Any
    tokens: torch.Tensor
    stats: "ImageStats"


class NonFiniteError(UserError):
    """A model produced NaN or infinite logits while decoding (named part, first token index)."""


@dataclass
class ImageStats:
    """Per-image counters (host values, read once after the image is done)."""

    tokens: int
    target_forwards: int
    accepted_tokens: int
    depth_accepted: list[int]
    depth_reached: list[int]
    relax_mass: float
    accepted_drafts: int
    drafted_levels: int = 0  # tree levels drafted, summed over iterations
    # `Decoder.measure_law`: TV(output law, p) at the root's children and the stated bound
    # there, summed over the iterations measured
    law_tvd: float = 0.0
    law_bound: float = 0.0
    law_steps: int = 0


@dataclass
class RunStats:
    """Aggregated statistics over images."""

    images: int = 0
    tokens: int = 0
    target_forwards: int = 0
    accepted_tokens: int = 0
    depth_accepted: list[int] = field(default_factory=list)
    depth_reached: list[int] = field(default_factory=list)
    relax_mass: float = 0.0
    accepted_drafts: int = 0
    drafted_levels: int = 0
    law_tvd: float = 0.0
    law_bound: float = 0.0
    law_steps: int = 0

    def add(self, s: ImageStats) -> None:
        self.images += 1
        self.tokens += s.tokens
        self.target_forwards += s.target_forwards
        self.accepted_tokens += s.accepted_tokens
        if not self.depth_accepted:
            self.depth_accepted = [0] * len(s.depth_accepted)
            self.depth_reached = [0] * len(s.depth_reached)
        self.depth_accepted = [a + b for a, b in zip(self.depth_accepted, s.depth_accepted)]
        self.depth_reached = [a + b for a, b in zip(self.depth_reached, s.depth_reached)]
        self.relax_mass += s.relax_mass
        self.accepted_drafts += s.accepted_drafts
        self.drafted_levels += s.drafted_levels
        self.law_tvd += s.law_tvd
        self.law_bound += s.law_bound
        self.law_steps += s.law_steps

    def summary(self) -> dict[str, Any]:
        """tau = tokens produced (bonus included) per target forward; mean_drafted_depth =
        tree levels drafted per iteration (every image's prefill is a forward, not an iteration);
        step_tvd / step_tvd_bound: mean TV distance of a step's output law from the target and
        the stated bound there (`Decoder.measure_law`; None when not measured)."""
        fw = max(self.target_forwards, 1)
        iterations = max(self.target_forwards - self.images, 1)
        return {
            "mean_accepted_length": self.accepted_tokens / fw,
            "target_forwards": self.target_forwards,
            "tokens": self.tokens,
            "step_compression": self.tokens / fw,
            "per_depth_acceptance": [a / r if r else 0.0 for a, r in zip(self.depth_accepted, self.depth_reached)],
            "mean_relaxation_mass": self.relax_mass / self.accepted_drafts if self.accepted_drafts else 0.0,
            "mean_drafted_depth": self.drafted_levels / iterations,
            "step_tvd": self.law_tvd / self.law_steps if self.law_steps else None,
            "step_tvd_bound": self.law_bound / self.law_steps if self.law_steps else None,
            "law_steps": self.law_steps,
        }


class _NullTimer:
    def phase(self, name: str):
        import contextlib
        return contextlib.nullcontext()


class Decoder:
    """Generates images with one method; state is allocated once and reused across images.

    target: the LlamaGen GPT (eval mode, on its device). drafter: required unless method is
    "ar". neighbours: (V, k) nearest-codebook table for the relaxed methods. backend: an
    object with `capture(fn, name=...)` and `mark_step()` (see backends/); without one,
    steps run eagerly. Set `timer` (an object with `.phase(name)`, e.g. `backend.timer()`)
    to time the phases prefill / draft / verify / accept. `track_nodes`: count in
    `node_hits` (B, N+1) how often each tree node was accepted (runtime tune's calibration).
    Set `measure_law` (every `law_every`-th iteration) to measure what the acceptance rule does
    to the law: between verify and accept, the output law at the root's children (the first
    drafted position) is computed (`runtime.core.law`) and its TV distance from the target is
    summed per image with the stated bound; eager host-side work outside the captured steps,
    for untimed passes. Sampling only (greedy output is no draw from a law), not for grouped
    acceptance (its bound is reported as its relaxation mass).

    The steps, public for the tools that time, count or wrap them (tune, selfcheck, the shape
    projection, opcount): `capture_steps(cond, mask)` captures every step once (graph mode);
    `draft_segments` (the draft as its segments; empty for AR), `draft_finish`, `run_draft()`
    (the draft, returning the depth it reached), `verify_at[depth]` and `accept_at[depth]` (one
    step per tree prefix the policy may verify) are the callables the loop runs, replaced by
    their captured replays; `draft_step`, `verify_step(depth)` and `accept_step(depth)` are the
    eager bodies. A caller may wrap the callables (selfcheck checks them for host syncs) but
    reaches nothing else private.
    """

    def __init__(self, target: Target, drafter: DrafterModel | None, spec: MethodSpec, *,
                 neighbours: torch.Tensor | None = None, backend: Backend | None = None, batch_size: int = 1,
                 track_nodes: bool = False) -> None:
        self.target, self.drafter, self.spec = target, drafter, spec
        self.backend = backend
        self.timer: Any = None
        cfg = target.config
        self.device = target.tok_embeddings.weight.device
        self.dtype = target.tok_embeddings.weight.dtype
        self.params = spec.sampling
        # target.constrain(logits (B, T, V), image index (B, T)) -> logits: a layout's fixed tokens (None: none)
        self.constrain = target.constrain
        if batch_size < 1:
            raise UserError(f"--batch-size must be >= 1, got {batch_size}")
        self.batch = batch_size
        self.rows = (2 if self.params.uses_cfg else 1) * batch_size
        self.num_tokens = cfg.block_size
        self.cls = cfg.cls_token_num
        self.vocab = cfg.vocab_size
        if spec.needs_drafter and drafter is None:
            raise UserError(f"method {spec.method} needs a drafter; pass --drafter DIR or use --method ar")
        dev = self.device

        # -- the state the phases share; the drafting policy owns the tree shape ------------
        self.rng = CounterRNG(self.device, streams=batch_size)
        self.state = DecodeState(spec, target, drafter, self.device, self.dtype, batch_size, self.rows, self.cls,
                                 self.vocab, self.num_tokens, self.rng, constrain=self.constrain)
        self.policy = make_policy(self.state)
        self.tree = self.policy.tree
        if self.tree.max_children > self.vocab:
            raise UserError(f"the draft tree gives a node {self.tree.max_children} children (ranks 0.."
                            f"{self.tree.max_children - 1}) but this model has only {self.vocab} tokens; "
                            "use a narrower tree or a smaller --top-k-draft")
        self.n1 = self.tree.size
        self.max_depth = self.tree.max_depth
        m = self.max_depth + 1  # longest accepted block (root + drafts)
        if cfg.cls_token_num + cfg.block_size + self.max_depth + 1 > target.max_position:
            raise UserError(f"tree depth {self.max_depth} is too deep for this model's RoPE table "
                            f"(at most {target.max_position - cfg.cls_token_num - cfg.block_size - 1})")

        kind = spec.relaxation_kind
        if kind != "none" and neighbours is None:
            raise UserError(f"method {spec.method} needs the codebook neighbour table (pass the VQ model)")
        zero_neighbours = None
        if neighbours is not None:
            # the paper rule clears a rejected draft's k+1 nearest codes (where the table has them)
            zero_neighbours = neighbours[:, : spec.lantern_k + 1].to(dev)
            neighbours = zero_neighbours[:, : spec.lantern_k]
        self.relax = Relaxation(kind, spec.lantern_delta, spec.lantern_lambda, neighbours, rule=spec.relax_rule,
                                zero_neighbours=zero_neighbours)
        self.group = None
        if spec.accept == "grouped":
            self.group = GroupRule.for_target(target, spec.group_window, spec.group_gap, spec.group_dist)

        # -- state (fixed shapes; identities never change) -----------------------------------
        # Target: committed tokens + one verified tree.
        committed = self.cls + self.num_tokens + m
        b = batch_size
        self.cache = target.new_cache(self.rows, committed + self.n1 + self.policy.extra, dev)
        state = self.state
        state.max_depth, state.group = self.max_depth, self.group
        state.allocate(self.n1, cfg.dim, self.policy.needs_q)
        # the shared buffers, by the names the loop below uses (the same tensors)
        self.out, self.count, self.tokens, self.p, self.q, self.hidden = (state.out, state.count, state.tokens,
                                                                          state.p, state.q, state.hidden)
        # count_hist[i, c]: iterations of image i that accepted c nodes (root included); every
        # other counter (iterations, accepted drafts, per-depth acceptance) follows from it and
        # `count`
        self.count_hist = torch.zeros(b, m + 1, dtype=torch.long, device=dev)
        self.relax_mass = torch.zeros(b, device=dev)
        # first image-token index whose target (0) / drafter (1) distribution held NaN or inf,
        # NO_POSITION if none: read when an image is done (the loop's existing host read)
        self.nonfinite = torch.full((len(MODEL_PARTS), b), NO_POSITION, dtype=torch.long, device=dev)
        self.no_position = torch.tensor(NO_POSITION, device=dev)
        self.block_ids = state.block_ids
        # the accept step's results, written in place: each image's new tokens (accepted drafts,
        # then the bonus) and accepted node count (0 once done); the drafter policies read them
        # as their pending block. `live_now`: what `live()` last wrote.
        self.block, self.accepted, self.live_now = state.block, state.accepted, state.live_now
        self.image_ids = torch.arange(b, device=dev)
        self.accept_rule = acceptance_rule(self.params.greedy, self.rng, self.relax, self.group, rows=self.image_ids)
        per_image = self.rows // b
        # model rows of each image, and a condition-sized cache to prefill one image in
        self.image_rows = [i + b * torch.arange(per_image, device=dev) for i in range(b)]
        self.start_cache = target.new_cache(per_image, self.cls, dev)
        self.policy.allocate(committed)
        # A draft whose depth is decided per iteration (ddd, --dynamic-depth) counts, per image,
        # the levels drafted and the depths its accepted path could reach (drafted that deep).
        self.prefix_trees = {d: self.policy.prefix_tree(d) for d in self.policy.verified_depths()}
        self.variable_depth = len(self.prefix_trees) > 1 or self.policy.drafted_levels() is not None
        self.drafted_sum = torch.zeros(b, dtype=torch.long, device=dev)
        self.reached = torch.zeros(b, max(self.max_depth, 1), dtype=torch.long, device=dev)
        self.depth_ids = torch.arange(1, max(self.max_depth, 1) + 1, device=dev)
        self.node_hits = torch.zeros(b, self.n1, dtype=torch.long, device=dev) if track_nodes else None
        self.measure_law, self.law_every = False, 1
        self.law_sums = torch.zeros(3, b, device=dev)  # TV, bound, steps measured
        self._iteration = 0

        # -- steps: eager until `capture_steps` swaps in captured replays ------------------
        # the draft as the policy's segments (one, unless its depth is decided as it goes),
        # and one verify / accept per tree prefix the policy may verify
        self.draft_segments: list[Callable[[], None]] = self.policy.segments() if spec.drafting != "none" else []
        self.draft_finish: Callable[[], None] | None = self.policy.finish()
        self.verify_at: dict[int, Callable[[], None]] = {d: self._verify_fn(d) for d in self.prefix_trees}
        self.accept_at: dict[int, Callable[[], None]] = {d: self._accept_fn(d) for d in self.prefix_trees}
        self.captured = backend is None or not backend.graph_mode
        # kernels the graph compiler generated for each captured step (phase -> count)
        self.kernels_per_step: dict[str, int] = {}
        # the slot API's bookkeeping: the request each slot holds, the same as a device mask
        # (what `finished` checks), whether the batch was prefilled, the counts last read
        self.slots: list[SlotRequest | None] = [None] * b
        self.active = torch.zeros(b, dtype=torch.bool, device=dev)
        self._running = False
        self._counts: list[int] | None = None

    # ------------------------------------------------------------------------------------
    def capture_steps(self, cond: torch.Tensor, cond_mask: torch.Tensor | None) -> None:
        """Capture draft/verify/accept once, on state from a throwaway prefill.

        Capturing runs each step a few times (warm-up, compilation), which advances the
        caches; the real batch's prefill resets all state afterwards.
        """
        self.prefill(cond, cond_mask, seed=0)
        backend = self.backend
        with backend.compile_cache(self.compile_key) if backend is not None else contextlib.nullcontext():
            self._capture_each_step()
        self.captured = True

    @property
    def compile_key(self) -> str:
        """`{method}-b{batch}-{16 hex}`: names every knob that sets a captured step's graph
        (each field of the method spec: tree, window, depths, sampling constants; the batch; the
        target's and drafter's configurations; dtype, device kind, torch version). Equal keys,
        equal graphs; the backend keys its compile caches on it."""
        drafter = getattr(self.drafter, "config", None) if self.drafter is not None else None
        knobs = {"spec": asdict(self.spec), "batch": self.batch, "target": self.target.config,
                 "drafter": drafter, "dtype": str(self.dtype), "device": self.device.type,
                 "torch": torch.__version__}
        digest = hashlib.sha256(json.dumps(knobs, sort_keys=True, default=repr).encode()).hexdigest()[:16]
        return f"{self.spec.method}-b{self.batch}-{digest}"

    def _capture_each_step(self) -> None:
        suffix = f".b{self.batch}" if self.batch > 1 else ""
        backend = self.backend
        assert backend is not None, "steps are captured only with a backend in graph mode (`captured`)"

        def capture(phase: str, step: Callable[[], None], part: str = "") -> Callable[[], None]:
            before = kernels_generated()
            replay = backend.capture(step, name=f"{self.spec.method}.{phase}{part}{suffix}")
            after = kernels_generated()
            made = after - before if before is not None and after is not None else 0
            if made > 0:  # zero: the backend captured without a compiler (eager, CUDA graph)
                self.kernels_per_step[phase] = self.kernels_per_step.get(phase, 0) + made
            return replay

        many = len(self.draft_segments) > 1
        self.draft_segments = [capture("draft", seg, f".{i}" if many else "")
                                for i, seg in enumerate(self.draft_segments)]
        if self.draft_finish is not None:
            self.draft_finish = capture("draft", self.draft_finish, ".finish")
        many = len(self.prefix_trees) > 1
        for d in self.prefix_trees:  # deepest first: it is the one the kernel counts report
            part = f".d{d}" if many else ""
            verify, accept = capture("verify", self.verify_at[d], part), capture("accept", self.accept_at[d], part)
            self.verify_at[d], self.accept_at[d] = verify, accept

    def _timer(self):
        return self.timer if self.timer is not None else _NullTimer()

    def dist(self, logits: torch.Tensor, depth: torch.Tensor | int | None = None, *, draft: bool = False,
             log: bool = False) -> torch.Tensor:
        """`DecodeState.dist`: (rows, T, V) logits -> (B, T, V) processed distribution."""
        return self.state.dist(logits, depth, draft=draft, log=log)

    def pick(self, probs: torch.Tensor, streams: torch.Tensor | None = None) -> torch.Tensor:
        """One token per row of (B, ..., V): argmax (greedy) or a sample (image i's stream;
        `streams`: the images of a subset's rows)."""
        if self.params.greedy:
            return probs.argmax(-1)
        return self.rng.race(probs, streams=streams)  # see `sample`

    def expand_rows(self, t: torch.Tensor) -> torch.Tensor:
        """`DecodeState.expand_rows`: per-image (B, ...) -> per model row (rows, ...)."""
        return self.state.expand_rows(t)

    def live(self) -> torch.Tensor:
        """`DecodeState.live`: (B,) long, 1 for images still generating (written into `live_now`)."""
        return self.state.live()

    def state_bytes(self) -> int:
        """Bytes of the decode state (KV caches, p/q/hidden buffers): what grows with the batch."""
        tensors = [self.cache.k_all, self.cache.v_all, self.p, self.hidden, self.out]
        if self.q is not None:
            tensors.append(self.q)
        dcache = getattr(self.policy, "dcache", None)
        if dcache is not None:
            tensors += [dcache.k_all, dcache.v_all]
        return sum(t.numel() * t.element_size() for t in tensors)

    # -- phases --------------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, cond: torch.Tensor, cond_mask: torch.Tensor | None, seed: int | list[int]) -> None:
        """Reset all state and start B images: cond (B,) labels or (B, cls, caption_dim),
        cond_mask (B, cls) or None, seed one per image (its random stream) or one int for all."""
        seeds = [seed] * self.batch if isinstance(seed, int) else list(seed)
        self.cache.reset()
        for i in range(self.batch):
            self.start_image(i, cond[i:i + 1], None if cond_mask is None else cond_mask[i:i + 1], seeds[i])

    @torch.no_grad()
    def start_image(self, i: int, cond: torch.Tensor, cond_mask: torch.Tensor | None, seed: int) -> None:
        """Start an image in slot i (the other slots keep their state): run its condition
        (1,) / (1, cls, caption_dim) / (1, cls) prompt ids with mask (1, cls) in a condition-sized cache, copy that
        into the slot's rows, restart its random stream at `seed` and pick its first token.
        Always one image at a time, so its numbers never depend on the batch."""
        img, rows = self.image_ids[i:i + 1], self.image_rows[i]
        if self.params.uses_cfg:
            if cond_mask is not None:  # the null condition's own padding (the target knows it)
                cond_mask = torch.cat([cond_mask, self.target.null_condition_mask(cond_mask)])
            cond = torch.cat([cond, self.target.null_condition(cond)])
        self.start_cache.reset()
        hidden = self.target.prefill(cond, self.start_cache, cond_mask)  # (rows per image, cls, dim)
        self.cache.load_rows(rows, self.start_cache)
        self.rng.reset_streams(img, torch.tensor([seed], dtype=torch.long, device=self.device))
        logits = self.target.logits(hidden[:, -1:])
        self.nonfinite[:, i] = NO_POSITION
        self.nonfinite[0, i] = torch.where(torch.isfinite(logits).all(), NO_POSITION, 0)
        first = self.pick(self.dist(logits), streams=img)[:, 0]  # (1,)
        self.out[i] = 0
        self.out[i, :1] = first
        self.tokens[i, :1] = first
        self.count[i] = 1
        self.count_hist[i] = 0
        self.relax_mass[i] = 0.0
        self.drafted_sum[i] = 0
        self.reached[i] = 0
        self.law_sums[:, i] = 0.0
        self.policy.start(i, rows, hidden, first, cond_mask)

    def draft_step(self) -> None:
        """The whole draft, every segment (the deepest draft: what op counts measure)."""
        for seg in self.policy.segments():
            seg()
        finish = self.policy.finish()
        if finish is not None:
            finish()

    def run_draft(self) -> int:
        """The draft's segments until no image wants more (one host read per check); returns
        the depth of the tree prefix to verify."""
        ran = len(self.draft_segments)
        for i, seg in enumerate(self.draft_segments):
            seg()
            if i in self.policy.checks and not bool(self.policy.go_on.any()):
                ran = i + 1
                break
        if self.draft_finish is not None:
            self.draft_finish()
        return self.policy.verified_depth(ran)

    def _verify_fn(self, depth: int) -> Callable[[], None]:
        return lambda: self.verify_step(depth)

    def _accept_fn(self, depth: int) -> Callable[[], None]:
        return lambda: self.accept_step(depth)

    def verify_step(self, depth: int | None = None) -> None:
        """Target forward over the tree (or its prefix down to `depth`): fills p and hidden."""
        tree = self.tree if depth is None else self.prefix_trees[depth]
        n1 = tree.size
        tokens = self.tokens[:, :n1]
        depths = self.expand_rows(tree.depth) if tree.batched else tree.depth[None]
        mask = self.expand_rows(tree.ancestor_mask) if tree.batched else tree.ancestor_mask
        policy = self.policy
        if policy.extra:  # nodes after the tree that nobody judges (pjd's lookahead rows)
            tokens = torch.cat([tokens, policy.extra_tokens], 1)
            depths = torch.cat([depths.expand(self.rows, -1), self.expand_rows(policy.extra_offset)], 1)
            mask = policy.verify_mask
        positions = self.cache.length[:, None] + depths
        x = self.target.tok_embeddings(self.expand_rows(tokens))
        hidden = self.target.forward_cached(x, positions, mask, self.cache)
        if policy.extra:
            policy.extra_p.copy_(self.dist(self.target.logits(hidden[:, n1:]), policy.extra_offset))
            hidden = hidden[:, :n1]
        self.hidden[:, :n1].copy_(hidden)
        logits = self.target.logits(hidden)
        self._note_nonfinite(0, logits, tree.depth)
        if self.policy.sampled_q:  # sampled drafts: q enters acceptance and the residual
            self._note_nonfinite(1, self.policy.q[:, :n1], tree.depth)
        self.p[:, :n1].copy_(self.dist(logits, tree.depth))

    def _note_nonfinite(self, part: int, values: torch.Tensor, depth: torch.Tensor) -> None:
        """Record in `nonfinite[part]` the first image-token index (count + depth) whose row of
        values (rows or B, T, V) holds NaN or inf. A done image's slot may record more; nobody
        reads it (the image was collected, and `start_image` resets the slot)."""
        # x - x is 0 for a finite x and NaN for NaN or inf; a sum of exact zeros is exactly 0
        spread = (values - values).sum(-1)  # (rows or B, T)
        if spread.size(0) != self.batch:  # cond and uncond rows of an image
            spread = spread.view(-1, self.batch, spread.size(1)).sum(0)
        index = torch.where(spread == 0, self.no_position, self.count[:, None] + depth).amin(1)
        self.nonfinite[part].copy_(torch.minimum(self.nonfinite[part], index))

    def accept_step(self, depth: int | None = None) -> None:
        live = self.live()
        if not self.max_depth:
            self._accept_ar(live)
            return
        tree = self.tree if depth is None else self.prefix_trees[depth]
        n1 = tree.size
        tokens, p = self.tokens[:, :n1], self.p[:, :n1]
        q = self.policy.q[:, :n1] if self.policy.sampled_q else None
        acc: Accepted = self.accept_rule(tokens, p, q, tree, self.policy.accept_uniforms(), self.policy.depth_cap())
        path, bonus = acc.path, acc.bonus  # (B, M), (B,)
        if path.size(1) < self.max_depth + 1:  # a prefix tree: pad as path_table does (repeat the last)
            path = torch.cat([path, path[:, -1:].expand(-1, self.max_depth + 1 - path.size(1))], 1)
        n = torch.mul(acc.count, live, out=self.accepted)  # a done image accepts nothing
        self.cache.commit(self.expand_rows(path), self.expand_rows(n))
        if self.variable_depth:
            levels = self.policy.drafted_levels()
            drafted = levels if levels is not None else torch.full_like(n, tree.max_depth)
            self.drafted_sum.add_(drafted * live)
            self.reached.add_(((drafted[:, None] >= self.depth_ids) & (n[:, None] >= self.depth_ids)).long())
        m = path.size(1)
        if self.node_hits is not None:  # path[:, j] (j >= 1) was accepted when j < n
            self.node_hits.scatter_add_(1, path[:, 1:], (self.block_ids[1:m] < n[:, None]).long())
        # new tokens after the root: accepted drafts, then the bonus at index n-1
        self.tokens[:, 0] = bonus  # the next root, and what the commit rows' root entries read
        if acc.commit is not None and acc.commit.size(1) == m:
            block = torch.gather(self.tokens, 1, acc.commit, out=self.block)
        else:
            block = torch.cat([self.tokens.gather(1, path[:, 1:]), bonus[:, None]], 1)
            block = torch.scatter(block, 1, (acc.count - 1)[:, None], bonus[:, None], out=self.block)
        self.out.scatter_(1, self.count[:, None] + self.block_ids[:m], block)
        self.count.add_(n)
        self.count_hist.scatter_add_(1, n[:, None], live[:, None])
        if self.relax.active or self.group is not None:
            self.relax_mass.addcmul_(acc.relax_mass, live)
        self.policy.committed(path, n, block)

    def _measure_law(self, depth: int) -> None:
        """Add TV(output law, p) at the root's children, and the stated bound, for live images
        (`measure_law`); reads the verified tree before accept changes anything."""
        from runtime.core.law import nominal_bound, step_tvd

        tree = self.prefix_trees[depth]
        kids = tree.children[..., 0, :]  # (B, K) or shared (K,); -1 = none
        kids = kids.expand(self.batch, -1) if kids.dim() == 1 else kids
        xs = torch.where(kids >= 0, self.tokens.gather(1, kids.clamp(min=0)), self.vocab)
        p = self.p[:, 0]
        q = self.policy.q[:, 0] if self.policy.sampled_q else None
        live = self.live().to(p.dtype)
        self.law_sums[0] += step_tvd(p, xs, self.relax, q, seed=self._iteration) * live
        self.law_sums[1] += nominal_bound(p, xs, self.relax, q) * live
        self.law_sums[2] += live

    def _accept_ar(self, live: torch.Tensor) -> None:
        """AR: the verified token is already in the cache; pick the next one from p."""
        token = self.pick(self.p[:, :1])  # (B, 1)
        self.cache.advance(self.expand_rows(live))
        self.out.scatter_(1, self.count[:, None], token)
        self.count.add_(live)
        self.tokens[:, :1] = token
        self.count_hist[:, 1].add_(live)

    # -- the slot API: admit -> step -> finished -> release ----------------------------------
    # A caller (generate_many, the server's engine) schedules; the decoder executes and updates.
    # Which slot holds which request lives here (`slots`), nowhere else.
    def admit(self, slot: int, request: SlotRequest) -> None:
        """Start `request` in the free `slot` (0 <= slot < B). Before the first step, requests
        are held and the first step captures (graph mode) and prefills them together; after
        it, the slot's image starts at once (`start_image`) while the others keep theirs."""
        held = self.slots[slot]
        if held is not None:
            raise ValueError(f"slot {slot} is busy (holds {held.key!r})")
        self.slots[slot] = request
        if self._running:
            with self._timer().phase("prefill"):
                self.start_image(slot, request.cond, request.mask, request.seed)
        self.active[slot] = True

    def release(self, slot: int) -> None:
        """Free `slot` (its image finished and was collected, or was cancelled): it keeps stepping
        with every advance multiplied by 0 until a new request is admitted to it."""
        self.slots[slot] = None
        self.active[slot] = False

    def busy(self) -> list[int]:
        """The slots holding a request."""
        return [i for i, r in enumerate(self.slots) if r is not None]

    def step(self) -> None:
        """One iteration for every slot: draft, verify, accept (the busy slots' images advance;
        no host read but the draft's depth checks, when the method has them)."""
        if not self._running:
            self._start_batch()
        timer = self._timer()
        depth = self.max_depth
        if self.draft_segments:
            with timer.phase("draft"):
                depth = self.run_draft()
        with timer.phase("verify"):
            self.verify_at[depth]()
        if self.measure_law and self.max_depth and self.group is None and not self.params.greedy:
            if self._iteration % self.law_every == 0:
                self._measure_law(depth)
            self._iteration += 1
        with timer.phase("accept"):
            self.accept_at[depth]()
        if self.backend is not None:
            self.backend.mark_step()

    def finished(self, progress: bool = False) -> list[Finished]:
        """The busy slots whose image is done, with its tokens (block_size,) on the device and
        statistics; still busy until `release`. The iteration's one host read: whether any is
        done (then the counts and the NaN flags). progress: read the counts in any case, for
        `progress()`. Raises NonFiniteError for an image whose logits held NaN or inf."""
        self._counts = None
        if not self._running:
            return []
        if progress or bool(((self.count >= self.num_tokens) & self.active).any()):
            self._counts = self.count.tolist()
        if self._counts is None:
            return []
        done, nonfinite = [], None
        for i, request in enumerate(self.slots):
            if request is None or self._counts[i] < self.num_tokens:
                continue
            if nonfinite is None:
                nonfinite = self.nonfinite.tolist()
            for part, at in zip(MODEL_PARTS, nonfinite):
                if at[i] != NO_POSITION:
                    raise NonFiniteError(
                        f"the {part} produced NaN or infinite logits for image {request.key} at image token "
                        f"{at[i]} ({str(self.dtype).replace('torch.', '')}); decoding stopped. Finite weights "
                        "overflow in fp16: use --dtype bf16 or fp32")
            done.append(Finished(i, request.key, self.out[i, : self.num_tokens].clone(), self._image_stats(i)))
        return done

    def progress(self) -> list[tuple[int, Any, int]]:
        """(slot, key, tokens known) of every busy slot, from the counts the last
        `finished(progress=True)` read (no host read of its own); empty when it read none."""
        if self._counts is None:
            return []
        return [(i, r.key, min(self._counts[i], self.num_tokens)) for i, r in enumerate(self.slots) if r is not None]

    def committed(self, slot: int, known: int) -> torch.Tensor:
        """The first `known` tokens of the image in `slot` (a `progress` count), on the host: a
        copy (one device read), for a preview of an image still decoding."""
        return self.out[slot, :known].cpu()

    def _start_batch(self) -> None:
        """The first step's prefill (and capture, in graph mode) of the admitted requests; a slot
        with none decodes a copy of the first, unused (its advances are multiplied by 0)."""
        held = [r for r in self.slots if r is not None]
        if not held:
            raise ValueError("step() before any request was admitted")
        padded = [r if r is not None else held[0] for r in self.slots]
        cond = torch.cat([r.cond for r in padded])
        mask = None if padded[0].mask is None else torch.cat([_mask_of(r) for r in padded])
        timer = self._timer()
        if not self.captured:
            with timer.phase("capture"):
                self.capture_steps(cond, mask)
        with timer.phase("prefill"):
            self.prefill(cond, mask, [r.seed for r in padded])
        self._running = True

    def reset_slots(self) -> None:
        """Forget every slot and the running batch: the next admitted requests are prefilled
        together by the next step (a new workload; captured steps are kept)."""
        self.slots = [None] * self.batch
        self.active.zero_()
        self._running, self._counts = False, None

    # -- loops over the slot API --------------------------------------------------------------
    @torch.no_grad()
    def generate_many(self, conds: list[tuple[torch.Tensor, torch.Tensor | None, int]],
                      on_image: Callable[[int, torch.Tensor, ImageStats], None] | None = None
                      ) -> tuple[list[torch.Tensor], list[ImageStats]]:
        """Decode a workload B images at a time: conds[j] = (cond (1,) or (1, cls, caption_dim),
        mask (1, cls) or None, seed). The first B images fill the slots; each time one is done
        its slot starts the next. Returns each image's tokens (block_size,) on the device and
        statistics, in workload order; `on_image(j, tokens, stats)` is called as each is done.
        With fewer than B images the spare slots decode a copy of the first one, unused."""
        n = len(conds)
        tokens: list[torch.Tensor | None] = [None] * n
        stats: list[ImageStats | None] = [None] * n
        waiting = iter(range(n))
        self.reset_slots()
        for slot in range(self.batch):
            if (j := next(waiting, None)) is not None:
                self.admit(slot, SlotRequest(j, *conds[j]))
        while self.busy():
            self.step()
            for done in self.finished():
                tokens[done.key], stats[done.key] = done.tokens, done.stats
                if on_image is not None:
                    on_image(done.key, done.tokens, done.stats)
                self.release(done.slot)
                if (j := next(waiting, None)) is not None:
                    self.admit(done.slot, SlotRequest(j, *conds[j]))
        return tokens, stats  # type: ignore[return-value]

    @torch.no_grad()
    def generate_one(self, cond: torch.Tensor, cond_mask: torch.Tensor | None = None,
                     seed: int = 0) -> tuple[torch.Tensor, ImageStats]:
        """One image: tokens (block_size,) and its statistics."""
        tokens, stats = self.generate_many([(cond, cond_mask, seed)])
        return tokens[0], stats[0]

    def _image_stats(self, i: int) -> ImageStats:
        """Statistics of the image in slot i, read once it is done. hist[c]: iterations
        accepting c nodes, root included; accepted: tokens known (the prefill's first one plus
        n per iteration)."""
        hist, accepted = self.count_hist[i].tolist(), int(self.count[i])
        iters = sum(hist)
        depth_acc = [sum(hist[d + 2:]) for d in range(self.max_depth)]
        if self.variable_depth:  # reached depth d: drafted that deep and accepted down to d - 1
            reached, drafted = self.reached[i].tolist(), int(self.drafted_sum[i])
        else:
            reached = [iters] + depth_acc[:-1] if self.max_depth else []
            drafted = self.max_depth * iters
        law_tvd, law_bound, law_steps = self.law_sums[:, i].tolist()
        return ImageStats(tokens=self.num_tokens, target_forwards=1 + iters,
                          accepted_tokens=accepted, depth_accepted=depth_acc,
                          depth_reached=reached, relax_mass=float(self.relax_mass[i]),
                          accepted_drafts=accepted - 1 - iters, drafted_levels=drafted,
                          law_tvd=law_tvd, law_bound=law_bound, law_steps=int(law_steps))


def _mask_of(request: SlotRequest) -> torch.Tensor:
    """The condition mask of a request batched with others that carry one."""
    if request.mask is None:
        raise ValueError("the requests of one batch carry a condition mask each, or none does")
    return request.mask
