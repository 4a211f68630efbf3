"""The phase steps of the shared decoding loop over preallocated state: prefill, then draft ->
verify -> accept/commit until the image is done (`Decoder` in decoder.py adds the slot API).

Every method that commits tokens in raster order runs through these steps (each iteration
extends an image's committed prefix): a method is a drafting policy (drafting.py: none, static
drafter tree, EAGLE-2 dynamic tree, Jacobi window, pjd's rows) plus an acceptance rule
(acceptance.py). AR is the empty tree (verify the root, accept nothing, sample the bonus).
Each phase is a method over preallocated state with fixed shapes and no host reads, so a
backend can capture it once and replay it:

    draft   the policy fills `tokens` (B, N+1), and the proposal distributions `q`
            (B, N+1, V) where its drafts are sampled
    verify  one target forward over root + tree; fills `p` (B, N+1, V) and target hidden states
    accept  acceptance rule on the device, KV commit by index ops, output tokens appended,
            next root (bonus) and the next level-0 block prepared

Batch: B images decode together (`batch_size`), each in its own slot with its own KV length,
accepted path, bonus token, drafter state and random stream (keyed by the image's seed, so an
image's tokens do not depend on B, on its slot or on the images beside it). Model rows:
[cond_0..cond_B-1, uncond_0..uncond_B-1] with classifier-free guidance (2B), else B. An image
starts in its slot between steps (`start_image`: the captured steps never change shape); a
slot with no image keeps stepping, with every advance (KV length, token count, drafter cache,
statistics) multiplied by 0.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Callable

import torch

from runtime.core.accept_rules import acceptance_parts, acceptance_rule
from runtime.core.acceptance import Accepted, accept_greedy, accept_greedy_path
from runtime.core.policies import make_policy
from runtime.core.methods import MethodSpec
from runtime.core.opcount import kernels_generated
from runtime.core.rng import CounterRNG
from runtime.core.slots import NullTimer, compile_key, phase_timer, prefill_slot
from runtime.core.state import (NO_POSITION, DecodeBuffers, DecodeConfig, DraftProposal, DraftView, check_tree,
                                lazy_head_mode)
from runtime.core.tree import TreeBuffers
from runtime.utils.errors import UserError
from runtime.config.method_options import Drafting

if TYPE_CHECKING:
    from backends import Backend
    from backends.base import PhaseTimer
    from runtime.models.target import DrafterModel, Target


class DecodeSteps:
    """The phases of one method's decoding; state is allocated once and reused across images.

    target: the LlamaGen GPT (eval mode, on its device). drafter: required unless method is
    "ar". neighbours: (V, k) nearest-codebook table for the relaxed methods. backend: an
    object with `capture(fn, name=...)` and `mark_step()` (see backends/); without one,
    steps run eagerly. Set `timer` (an object with `.phase(name)`, e.g. `backend.timer()`)
    to time the phases prefill / draft / verify / accept. `track_nodes`: count in
    `buffers.node_hits` (B, N+1) how often each tree node was accepted (runtime tune's
    calibration). `lazy_head`: the output heads run only where they are read (greedy acceptance,
    `lazy_head_mode`; a static tree's draft, `DecodeConfig.lean_head`) rather than over every node;
    None = where that saves work (the CPU), False = the accelerators' form everywhere.
    Set `measure_law` (every `law_every`-th iteration) to measure what the
    acceptance rule does to the law: between verify and accept, the output law at the root's
    children (the first drafted position) is computed (`runtime.core.law`) and its TV distance
    from the target is summed per image with the stated bound; eager host-side work outside
    the captured steps, for untimed passes. Sampling only (greedy output is no draw from a
    law), not for grouped acceptance (its bound is reported as its relaxation mass).

    What it holds: `config` (the frozen settings: spec, models, sizes, device), `buffers`
    (every tensor the phases share, `DecodeBuffers`), `policy` (the drafting policy, which owns
    the tree, `policy.tree`, and how deep it drafts, `policy.depth`), `proposals` (the policy's
    `DraftProposal` per verified depth) and the target's KV `cache`.

    The steps, public for the tools that time, count or wrap them (tune, selfcheck, the shape
    projection, opcount): `capture_steps(cond, mask)` captures every step once (graph mode);
    `draft_segments` (the draft as its segments; empty for AR), `draft_finish`, `run_draft()`
    (the draft, returning the proposal to verify), `verify_at[depth]` and `accept_at[depth]`
    (one step per tree prefix the policy may verify) are the callables the loop runs, replaced
    by their captured replays; `draft_step`, `verify_step(proposal)` and
    `accept_step(proposal)` are the eager bodies. A caller may wrap the callables (selfcheck
    checks them for host syncs) but reaches nothing else private.
    """

    def __init__(self, target: Target, drafter: DrafterModel | None, spec: MethodSpec, *,
                 neighbours: torch.Tensor | None = None, backend: Backend | None = None, batch_size: int = 1,
                 track_nodes: bool = False, lazy_head: bool | None = None) -> None:
        if spec.loop != "raster":
            raise UserError("--method pjd --accept published commits tokens out of raster order in its own loop, "
                            "which this tool does not drive; runtime run, bench, sample and serve do "
                            "(or use --accept exact)")
        self.config = config = DecodeConfig.for_models(
            target, drafter, spec, batch_size, lean_head=lazy_head,
            attention=None if backend is None else backend.cached_attention())
        self.backend = backend
        for model in (target, drafter):
            if backend is not None and isinstance(model, torch.nn.Module):
                backend.prepare_inference(model)
        self.timer: PhaseTimer | None = None
        b, dev = config.batch, config.device

        # -- the drafting policy owns the tree shape ----------------------------------------
        self.policy = make_policy(config)
        tree = self.policy.tree
        check_tree(tree, config)
        self.relax, self.group = acceptance_parts(config, neighbours, tree.max_depth)

        # -- state (fixed shapes; identities never change) -----------------------------------
        # Target: committed tokens (+ a longest block) + one verified tree (+ the policy's extra nodes)
        committed = config.cls + config.num_tokens + tree.max_depth + 1
        self.cache = config.new_cache(target, config.rows, committed + tree.size + self.policy.extra)
        self.buffers = DecodeBuffers.allocate(config, tree, target.config.dim, sampled_q=self.policy.needs_q,
                                              track_nodes=track_nodes)
        self.rng = CounterRNG(dev, streams=b)  # one counter-based stream per image
        self.policy.bind(DraftView.of(config, self.rng, self.buffers, grouped=self.group is not None), committed)
        self.no_position, self.image_ids = torch.tensor(NO_POSITION, device=dev), torch.arange(b, device=dev)
        self.accept_rule = acceptance_rule(config.params.greedy, self.rng, self.relax, self.group, rows=self.image_ids)
        self.lazy_head = lazy_head_mode(lazy_head, config, tree, self.relax.active, self.policy)
        per_image = config.rows // b
        # model rows of each image, and a condition-sized cache to prefill one image in
        self.image_rows = [i + b * torch.arange(per_image, device=dev) for i in range(b)]
        self.start_cache = config.new_cache(target, per_image, config.cls)
        # what the draft hands to verify and accept, per tree prefix the policy may verify; a
        # draft whose depth is decided per iteration (ddd, --dynamic-depth) counts, per image,
        # the levels drafted and the depths its accepted path could reach (drafted that deep)
        depth = self.policy.depth
        self.proposals = {d: self.policy.proposal(d) for d in depth.verified_depths()}
        self.variable_depth = len(self.proposals) > 1 or depth.drafted_levels() is not None
        self.measure_law, self.law_every, self._iteration = False, 1, 0
        self._eager_steps()
        self.captured = backend is None or not backend.graph_mode
        # kernels the graph compiler generated for each captured step (phase -> count)
        self.kernels_per_step: dict[str, int] = {}

    def _eager_steps(self) -> None:
        """The steps, eager until `capture_steps` swaps in captured replays: the draft as the
        policy's segments (one, unless its depth is decided as it goes), and one verify /
        accept per tree prefix the policy may verify."""
        depth = self.policy.depth
        self.draft_segments: list[Callable[[], None]] = (
            depth.segments() if self.config.spec.drafting != Drafting.NONE else [])
        self.draft_finish: Callable[[], None] | None = depth.finish()
        self.verify_at: dict[int, Callable[[], None]] = {d: self._verify_fn(p) for d, p in self.proposals.items()}
        self.accept_at: dict[int, Callable[[], None]] = {d: self._accept_fn(p) for d, p in self.proposals.items()}

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
        """`compile_key(config)`: equal keys, equal captured graphs."""
        return compile_key(self.config)

    def _capture_each_step(self) -> None:
        suffix = f".b{self.config.batch}" if self.config.batch > 1 else ""
        backend = self.backend
        assert backend is not None, "steps are captured only with a backend in graph mode (`captured`)"

        def capture(phase: str, step: Callable[[], None], part: str = "") -> Callable[[], None]:
            before = kernels_generated()
            replay = backend.capture(step, name=f"{self.config.spec.method}.{phase}{part}{suffix}")
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
        many = len(self.proposals) > 1
        for d in self.proposals:  # deepest first: it is the one the kernel counts report
            part = f".d{d}" if many else ""
            verify, accept = capture("verify", self.verify_at[d], part), capture("accept", self.accept_at[d], part)
            self.verify_at[d], self.accept_at[d] = verify, accept

    def _timer(self) -> PhaseTimer | NullTimer:
        return phase_timer(self.timer)

    def _dist(self, logits: torch.Tensor, depth: torch.Tensor | int | None = None) -> torch.Tensor:
        """The target's (R, T, V) logits -> (B, T, V) processed distribution at the current counts
        (its order only, the guided logits, where nothing reads more: `p_is_order`)."""
        return self.config.dist(logits, self.buffers.count, depth, rank=self.p_is_order)

    @property
    def p_is_order(self) -> bool:
        """Greedy exact acceptance reads only the target's argmax, so `p` may keep the guided
        logits and skip the softmax; a relaxation, a policy that reads `p` or sampling need
        the distributions."""
        return self.config.params.greedy and not self.relax.active and not self.policy.reads_p

    def _target_choice(self, node: torch.Tensor, depth: torch.Tensor | int) -> torch.Tensor:
        """The target's greedy token (B,) after node (B,) long of the verified tree at `depth`
        (an int for every image, or (B,)): its head over that node's verified hidden state."""
        config, buf = self.config, self.buffers
        at = config.expand_rows(node)[:, None, None].expand(-1, 1, buf.hidden.size(-1))
        logits = config.target.logits(buf.hidden.gather(1, at))  # (R, 1, V)
        depth = depth[:, None] if isinstance(depth, torch.Tensor) else depth
        self._note_nonfinite(0, logits, depth)
        return self._dist(logits, depth)[:, 0].argmax(-1)

    def pick(self, probs: torch.Tensor, streams: torch.Tensor | None = None) -> torch.Tensor:
        """One token per row of (B, ..., V): argmax (greedy) or a sample (image i's stream;
        `streams`: the images of a subset's rows)."""
        if self.config.params.greedy:
            return probs.argmax(-1)
        return self.rng.race(probs, streams=streams)  # see `sample`

    def state_bytes(self) -> int:
        """Bytes of the decode state (KV caches, p/q/hidden buffers): what grows with the batch."""
        buf = self.buffers
        tensors = [self.cache.k_all, self.cache.v_all, buf.p, buf.hidden, buf.out]
        if buf.q is not None:
            tensors.append(buf.q)
        dcache = getattr(self.policy, "dcache", None)
        if dcache is not None:
            tensors += [dcache.k_all, dcache.v_all]
        return sum(t.numel() * t.element_size() for t in tensors)

    # -- phases --------------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, cond: torch.Tensor, cond_mask: torch.Tensor | None, seed: int | list[int]) -> None:
        """Reset all state and start B images: cond (B,) labels or (B, cls, caption_dim),
        cond_mask (B, cls) or None, seed one per image (its random stream) or one int for all."""
        seeds = [seed] * self.config.batch if isinstance(seed, int) else list(seed)
        self.cache.reset()
        for i in range(self.config.batch):
            self.start_image(i, cond[i:i + 1], None if cond_mask is None else cond_mask[i:i + 1], seeds[i])

    @torch.no_grad()
    def start_image(self, i: int, cond: torch.Tensor, cond_mask: torch.Tensor | None, seed: int) -> None:
        """Start an image in slot i (the other slots keep their state): run its condition
        (1,) / (1, cls, caption_dim) / (1, cls) prompt ids with mask (1, cls) in a condition-sized cache, copy that
        into the slot's rows, restart its random stream at `seed` and pick its first token.
        Always one image at a time, so its numbers never depend on the batch."""
        config, buf = self.config, self.buffers
        img, rows = self.image_ids[i:i + 1], self.image_rows[i]
        hidden, logits, cond_mask = prefill_slot(config, self.cache, self.start_cache, self.rng, i, cond, cond_mask,
                                                 seed)
        buf.nonfinite[:, i] = NO_POSITION
        buf.nonfinite[0, i] = torch.where(torch.isfinite(logits).all(), NO_POSITION, 0)
        first = self.pick(self._dist(logits), streams=img)[:, 0]  # (1,)
        buf.out[i] = 0
        buf.out[i, :1] = first
        buf.tokens[i, :1] = first
        buf.count[i] = 1
        buf.block[i] = 0  # the pending block (the drafter policies' level 0): the first token alone
        buf.block[i, :1] = first
        buf.accepted[i] = 1
        buf.count_hist[i] = 0
        buf.relax_mass[i] = 0.0
        buf.drafted_sum[i] = 0
        buf.reached[i] = 0
        buf.law_sums[:, i] = 0.0
        self.policy.start(i, rows, hidden, first, cond_mask)

    def draft_step(self) -> None:
        """The whole draft, every segment (the deepest draft: what op counts measure)."""
        for seg in self.policy.depth.segments():
            seg()
        finish = self.policy.depth.finish()
        if finish is not None:
            finish()

    def run_draft(self) -> DraftProposal:
        """The draft's segments until no image wants more (one host read per check); returns
        the proposal to verify (the tree prefix the segments that ran filled)."""
        ran, depth = len(self.draft_segments), self.policy.depth
        for i, seg in enumerate(self.draft_segments):
            seg()
            if i in depth.checks and not bool(depth.go_on.any()):
                ran = i + 1
                break
        if self.draft_finish is not None:
            self.draft_finish()
        return self.proposals[depth.verified_depth(ran)]

    def _verify_fn(self, proposal: DraftProposal) -> Callable[[], None]:
        return lambda: self.verify_step(proposal)

    def _accept_fn(self, proposal: DraftProposal) -> Callable[[], None]:
        return lambda: self.accept_step(proposal)

    def _deepest(self) -> DraftProposal:
        return self.proposals[self.policy.tree.max_depth]

    def verify_step(self, proposal: DraftProposal | None = None) -> None:
        """Target forward over the proposal's tree (the deepest by default): fills p and hidden."""
        config, buf = self.config, self.buffers
        proposal = proposal or self._deepest()
        tree, extra = proposal.tree, proposal.lookahead
        n1 = tree.size
        tokens = proposal.tokens
        depths = config.expand_rows(tree.depth) if tree.batched else tree.depth[None]
        mask = config.expand_rows(tree.ancestor_mask) if tree.batched else tree.ancestor_mask
        if extra is not None:  # nodes after the tree that nobody judges (pjd's lookahead rows)
            tokens = torch.cat([tokens, extra.tokens], 1)
            depths = torch.cat([depths.expand(config.rows, -1), config.expand_rows(extra.offset)], 1)
            mask = extra.mask
        positions = self.cache.length[:, None] + depths
        x = config.target.tok_embeddings(config.expand_rows(tokens))
        hidden = config.target.forward_cached(x, positions, mask, self.cache)
        if extra is not None:
            ahead = config.target.logits(hidden[:, n1:])
            self._note_nonfinite(0, ahead, extra.offset)  # they feed the next drafts: NaN stops decoding too
            extra.p.copy_(self._dist(ahead, extra.offset))
            hidden = hidden[:, :n1]
        buf.hidden[:, :n1].copy_(hidden)
        if self.lazy_head is not None and tree.max_depth:
            self._lazy_verify(tree, hidden)
            return
        logits = config.target.logits(hidden)
        self._note_nonfinite(0, logits, tree.depth)
        if proposal.q is not None:  # sampled drafts: q enters acceptance and the residual
            self._note_nonfinite(1, proposal.q, tree.depth)
        buf.p[:, :n1].copy_(self._dist(logits, tree.depth))

    def _lazy_verify(self, tree: TreeBuffers, hidden: torch.Tensor) -> None:
        """The verify's head under `lazy_head`: none on the path (acceptance asks for the
        target's choices itself), else at the nodes with children only, into p's first J rows."""
        if self.lazy_head == "path":
            return
        config = self.config
        judged, _ = self._judging(tree)
        if tree.batched:  # (B, J): each image's own
            at = config.expand_rows(judged)[..., None].expand(-1, -1, hidden.size(-1))
            logits, depth = config.target.logits(hidden.gather(1, at)), tree.depth.gather(1, judged)
        else:
            logits, depth = config.target.logits(hidden[:, judged]), tree.depth[judged]
        self._note_nonfinite(0, logits, depth)
        self.buffers.p[:, : judged.size(-1)].copy_(self._dist(logits, depth))

    def _lazy_accept(self, proposal: DraftProposal) -> Accepted:
        """Greedy acceptance under `lazy_head`: exact along the path, asking for the target's
        choices as it goes (`accept_greedy_path`); relaxed over p's J judging rows, the bonus's
        head run once the accepted leaf is known."""
        tree, cap = proposal.tree, self.policy.depth.depth_cap()
        if self.lazy_head == "path":
            return accept_greedy_path(proposal.tokens, tree, self._target_choice, cap)
        judged, parent_row = self._judging(tree)

        def depth_of(best: torch.Tensor) -> torch.Tensor:
            return tree.depth.gather(1, best[:, None])[:, 0] if tree.batched else tree.depth[best]

        return accept_greedy(proposal.tokens, self.buffers.p[:, : judged.size(-1)], tree, self.relax, cap,
                             bonus_at=lambda best: self._target_choice(best, depth_of(best)), parent_row=parent_row)

    def _judging(self, tree: TreeBuffers) -> tuple[torch.Tensor, torch.Tensor]:
        """The J = `policy.most_parents` nodes whose rows of p judge drafts (the nodes with
        children; a batched tree's other places filled with leaves), and each node's parent's
        place among them: static trees (J,) and (N+1,) (`StageLayout`), batched (B, J), (B, N+1)."""
        if not tree.batched:
            stages = tree.stages
            assert stages is not None, "a static tree has its stage layout"
            return stages.order[: stages.rows[0]], stages.parent_row
        parents = torch.zeros_like(tree.parent, dtype=torch.int8).scatter_(1, tree.parent, 1)
        order = torch.sort(1 - parents, dim=1, stable=True).indices  # nodes with children first, in id order
        ids = torch.arange(order.size(1), device=order.device).expand_as(order)
        place = torch.empty_like(order).scatter_(1, order, ids)
        return order[:, : self.policy.most_parents], place.gather(1, tree.parent)

    def _note_nonfinite(self, part: int, values: torch.Tensor, depth: torch.Tensor | int) -> None:
        """Record in `nonfinite[part]` the first image-token index (count + depth; depth an int,
        (T,) or per image (B, T)) whose row of values (rows or B, T, V) holds NaN or inf. A done
        image's slot may record more; nobody reads it (the image was collected, and
        `start_image` resets the slot)."""
        buf, b = self.buffers, self.config.batch
        # x - x is 0 for a finite x and NaN for NaN or inf; a sum of exact zeros is exactly 0
        spread = (values - values).sum(-1)  # (rows or B, T)
        if spread.size(0) != b:  # cond and uncond rows of an image
            spread = spread.view(-1, b, spread.size(1)).sum(0)
        index = torch.where(spread == 0, self.no_position, buf.count[:, None] + depth).amin(1)
        buf.nonfinite[part].copy_(torch.minimum(buf.nonfinite[part], index))

    def accept_step(self, proposal: DraftProposal | None = None) -> None:
        """The acceptance rule over the verified proposal (the deepest by default), the KV commit,
        the new tokens appended and the statistics counted; the policy's `committed` last."""
        config, buf, policy = self.config, self.buffers, self.policy
        live = buf.live(config.num_tokens)
        max_depth = policy.tree.max_depth
        if not max_depth:
            self._accept_ar(live)
            return
        proposal = proposal or self._deepest()
        tree = proposal.tree
        n1 = tree.size
        acc: Accepted = self._lazy_accept(proposal) if self.lazy_head is not None else self.accept_rule(
            proposal.tokens, buf.p[:, :n1], proposal.q, tree, policy.accept_uniforms(), policy.depth.depth_cap())
        path, bonus = acc.path, acc.bonus  # (B, M), (B,)
        if path.size(1) < max_depth + 1:  # a prefix tree: pad as path_table does (repeat the last)
            path = torch.cat([path, path[:, -1:].expand(-1, max_depth + 1 - path.size(1))], 1)
        n = torch.mul(acc.count, live, out=buf.accepted)  # a done image accepts nothing
        self.cache.commit(config.expand_rows(path), config.expand_rows(n))
        if self.variable_depth:
            levels = policy.depth.drafted_levels()
            drafted = levels if levels is not None else torch.full_like(n, tree.max_depth)
            buf.drafted_sum.add_(drafted * live)
            buf.reached.add_(((drafted[:, None] >= buf.depth_ids) & (n[:, None] >= buf.depth_ids)).long())
        m = path.size(1)
        if buf.node_hits is not None:  # path[:, j] (j >= 1) was accepted when j < n
            buf.node_hits.scatter_add_(1, path[:, 1:], (buf.block_ids[1:m] < n[:, None]).long())
        # new tokens after the root: accepted drafts, then the bonus at index n-1
        buf.tokens[:, 0] = bonus  # the next root, and what the commit rows' root entries read
        if acc.commit is not None and acc.commit.size(1) == m:
            block = torch.gather(buf.tokens, 1, acc.commit, out=buf.block)
        else:
            block = torch.cat([buf.tokens.gather(1, path[:, 1:]), bonus[:, None]], 1)
            block = torch.scatter(block, 1, (acc.count - 1)[:, None], bonus[:, None], out=buf.block)
        buf.out.scatter_(1, buf.count[:, None] + buf.block_ids[:m], block)
        buf.count.add_(n)
        buf.count_hist.scatter_add_(1, n[:, None], live[:, None])
        if self.relax.active or self.group is not None:
            buf.relax_mass.addcmul_(acc.relax_mass, live)
        policy.committed(path, n, block)

    def _measure_law(self, proposal: DraftProposal) -> None:
        """Add TV(output law, p) at the root's children, and the stated bound, for live images
        (`measure_law`); reads the verified tree before accept changes anything."""
        from runtime.core.law import nominal_bound, step_tvd

        config, buf = self.config, self.buffers
        kids = proposal.tree.children[..., 0, :]  # (B, K) or shared (K,); -1 = none
        kids = kids.expand(config.batch, -1) if kids.dim() == 1 else kids
        xs = torch.where(kids >= 0, buf.tokens.gather(1, kids.clamp(min=0)), config.vocab)
        p = buf.p[:, 0]
        q = proposal.q[:, 0] if proposal.q is not None else None
        live = buf.live(config.num_tokens).to(p.dtype)
        buf.law_sums[0] += step_tvd(p, xs, self.relax, q, seed=self._iteration) * live
        buf.law_sums[1] += nominal_bound(p, xs, self.relax, q) * live
        buf.law_sums[2] += live

    def _accept_ar(self, live: torch.Tensor) -> None:
        """AR: the verified token is already in the cache; pick the next one from p."""
        buf = self.buffers
        token = self.pick(buf.p[:, :1])  # (B, 1)
        self.cache.advance(self.config.expand_rows(live))
        buf.out.scatter_(1, buf.count[:, None], token)
        buf.count.add_(live)
        buf.tokens[:, :1] = token
        buf.count_hist[:, 1].add_(live)
