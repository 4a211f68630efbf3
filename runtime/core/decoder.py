"""The one decoding loop: prefill, then draft -> verify -> accept/commit until the image is done.

Every method runs through this file. AR is the empty tree (verify the root, accept nothing,
sample the bonus); chain SD and LANTERN++ draft a static tree; EAGLE-2 and LANTERN build a
dynamic tree of fixed size. Each phase is a method over preallocated state with fixed
shapes and no host reads, so a backend can capture it once and replay it:

    draft   drafter over the last accepted block (level 0), then one drafter step per tree
            level; fills `tokens` (N+1,) and the proposal distributions `q` (N+1, V)
    verify  one target forward over root + tree; fills `p` (N+1, V) and target hidden states
    accept  acceptance rule on the device, KV commit by index ops, output tokens appended,
            next root (bonus) and the next level-0 block prepared

The only host read per iteration is the stop check (`int(self.count)`).

Batch rows: 2 with classifier-free guidance (cond, uncond), else 1; one image at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from runtime.core.acceptance import Accepted, Relaxation, accept_greedy, accept_sampling
from runtime.core.methods import MethodSpec
from runtime.core.opcount import kernels_generated
from runtime.core.rng import CounterRNG
from runtime.core.sampling import apply_cfg, cfg_off_mask, probabilities
from runtime.core.tree import TreeBuffers, buffers_from_parents, load_tree, static_buffers
from runtime.errors import UserError
from runtime.models.drafter import Drafter
from runtime.models.gpt import Transformer

_SMALLEST_NORMAL = 1.1754944e-38
# Floor for log q in EAGLE-2 scores: keeps filtered-out tokens finite and parent > child.
_LOG_FLOOR = -80.0


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

    def summary(self) -> dict[str, Any]:
        """tau = tokens produced (bonus included) per target forward."""
        fw = max(self.target_forwards, 1)
        return {
            "mean_accepted_length": self.accepted_tokens / fw,
            "target_forwards": self.target_forwards,
            "tokens": self.tokens,
            "step_compression": self.tokens / fw,
            "per_depth_acceptance": [a / r if r else 0.0 for a, r in zip(self.depth_accepted, self.depth_reached)],
            "mean_relaxation_mass": self.relax_mass / self.accepted_drafts if self.accepted_drafts else 0.0,
        }


def child_scores(parent: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """EAGLE-2 score of children: parent score + log q, strictly below the parent's score.

    parent broadcasts against logq. A child with log q == 0 (or one whose log q is lost in
    float32 rounding at large |score|) would tie its parent; it takes the next float below
    instead, so in any top-n selection a kept child implies a kept parent.
    """
    below = torch.nextafter(parent, torch.full_like(parent, float("-inf")))
    # next to 0 the next float is denormal, which a flush-to-zero CPU mode (set by compiled
    # kernels) turns back into 0: step down by the smallest normal float there instead
    below = torch.minimum(below, parent - _SMALLEST_NORMAL)
    return torch.minimum(parent + logq, below)


class _NullTimer:
    def phase(self, name: str):
        import contextlib
        return contextlib.nullcontext()


def _root_only_tree(device: torch.device) -> TreeBuffers:
    z = torch.zeros(1, dtype=torch.long, device=device)
    return TreeBuffers(z, z.clone(), z.clone(), torch.ones(1, 1, dtype=torch.bool, device=device),
                       torch.full((1, 1), -1, dtype=torch.long, device=device),
                       torch.zeros(1, 1, dtype=torch.long, device=device), 0, 1)


class Decoder:
    """Generates images with one method; state is allocated once and reused across images.

    target: the LlamaGen GPT (eval mode, on its device). drafter: required unless method is
    "ar". neighbours: (V, k) nearest-codebook table for the relaxed methods. backend: an
    object with `capture(fn, name=...)` and `mark_step()` (see backends/); without one,
    steps run eagerly. Set `timer` (an object with `.phase(name)`, e.g. `backend.timer()`)
    to time the phases prefill / draft / verify / accept.
    """

    def __init__(self, target: Transformer, drafter: Drafter | None, spec: MethodSpec, *,
                 neighbours: torch.Tensor | None = None, backend: Any = None) -> None:
        self.target, self.drafter, self.spec = target, drafter, spec
        self.backend = backend
        self.timer: Any = None
        cfg = target.config
        self.device = target.tok_embeddings.weight.device
        self.dtype = target.tok_embeddings.weight.dtype
        self.params = spec.sampling
        self.rows = 2 if self.params.uses_cfg else 1
        self.num_tokens = cfg.block_size
        self.cls = cfg.cls_token_num
        self.vocab = cfg.vocab_size
        if spec.drafting != "none" and drafter is None:
            raise UserError(f"method {spec.method} needs a drafter; pass --drafter DIR or use --method ar")
        dev = self.device

        # -- tree shape ------------------------------------------------------------------
        if spec.drafting == "none":
            self.tree = _root_only_tree(dev)
        elif spec.drafting == "static":
            self.tree = static_buffers(load_tree(spec.tree_spec)).to(dev)
            self.levels = [self.tree.level(d) for d in range(1, self.tree.max_depth + 1)]
            # per level: each node's parent as an index into the previous level's rows
            starts = [0] + [start for start, _ in self.levels]
            self.level_parent = [self.tree.parent[a:b] - starts[d] for d, (a, b) in enumerate(self.levels)]
        else:
            # EAGLE-2's `depth` counts the expansions after the root's own top-k, so the tree
            # is depth + 1 levels deep (reference `topK_genrate`; depth 4 -> 5 levels).
            k, d = spec.top_k_draft, spec.depth + 1
            n1 = spec.total_tokens
            self.tree = TreeBuffers(torch.zeros(n1, dtype=torch.long, device=dev),
                                    torch.zeros(n1, dtype=torch.long, device=dev),
                                    torch.zeros(n1, dtype=torch.long, device=dev),
                                    torch.eye(n1, dtype=torch.bool, device=dev),
                                    torch.full((n1, k), -1, dtype=torch.long, device=dev),
                                    torch.zeros(n1, d + 1, dtype=torch.long, device=dev), d, k)
        self.n1 = self.tree.size
        self.max_depth = self.tree.max_depth
        m = self.max_depth + 1  # longest accepted block (root + drafts)
        if cfg.cls_token_num + cfg.block_size + self.max_depth + 1 > target.max_position:
            raise UserError(f"tree depth {self.max_depth} is too deep for this model's RoPE table")

        kind = spec.relaxation_kind
        if kind != "none" and neighbours is None:
            raise UserError(f"method {spec.method} needs the codebook neighbour table (pass the VQ model)")
        if neighbours is not None:
            neighbours = neighbours[:, : spec.lantern_k].to(dev)
        self.relax = Relaxation(kind, spec.lantern_delta, spec.lantern_lambda, neighbours)

        # -- state (fixed shapes; identities never change) -----------------------------------
        # Target: committed tokens + one verified tree. Drafter: committed tokens + the pending
        # block + every drafted node it writes, which for EAGLE-2 is depth x top_k frontier
        # slots (all candidates expanded), not the tree size.
        committed = self.cls + self.num_tokens + m
        self.cache = target.new_cache(self.rows, committed + self.n1, dev)
        draft_slots = spec.depth * spec.top_k_draft if spec.drafting == "dynamic" else self.n1
        self.rng = CounterRNG(dev)
        self.out = torch.zeros(self.num_tokens + m + 1, dtype=torch.long, device=dev)
        self.count = torch.zeros((), dtype=torch.long, device=dev)  # tokens known, pending root included
        self.tokens = torch.zeros(self.n1, dtype=torch.long, device=dev)
        self.p = torch.zeros(self.n1, self.vocab, device=dev)
        self.hidden = torch.zeros(self.rows, self.n1, cfg.dim, device=dev, dtype=self.dtype)
        # count_hist[c]: iterations that accepted c nodes (root included); every other counter
        # (iterations, accepted drafts, per-depth acceptance) follows from it and `count`
        self.count_hist = torch.zeros(m + 1, dtype=torch.long, device=dev)
        self.one = torch.ones(1, dtype=torch.long, device=dev)
        self.relax_mass = torch.zeros((), device=dev)
        self.block_ids = torch.arange(m, device=dev)
        self.causal_m = torch.ones(m, m, dtype=torch.bool, device=dev).tril()
        if spec.drafting != "none":
            dcfg = drafter.config
            self.dcache = drafter.new_cache(self.rows, committed + draft_slots, dev)
            self.q = torch.zeros(self.n1, self.vocab, device=dev)
            self.draft_hidden = torch.zeros(self.rows, self.n1, dcfg.hidden_size, device=dev, dtype=self.dtype)
            self.pend_tokens = torch.zeros(m, dtype=torch.long, device=dev)
            self.pend_hidden = torch.zeros(self.rows, m, cfg.dim, device=dev, dtype=self.dtype)
            self.pend_count = torch.ones((), dtype=torch.long, device=dev)
        if spec.drafting == "dynamic":
            k, d = spec.top_k_draft, spec.depth
            self.n_cand = k + d * k * k
            # constants of every EAGLE-2 draft, built once (a captured step would rebuild them)
            earlier = torch.ones(self.n1, self.n1, dtype=torch.bool, device=dev).tril(-1)
            earlier[:, 0] = False  # the root shares parent id 0 with its children but is no sibling
            self._dyn = {
                "zero": torch.zeros((), device=dev), "zero_long": torch.zeros(1, dtype=torch.long, device=dev),
                "no_parent": torch.full((k,), -1, dtype=torch.long, device=dev),
                "arange_k": torch.arange(k, device=dev), "eye_k": torch.eye(k, dtype=torch.bool, device=dev),
                "arange_nodes": torch.arange(self.n1 - 1, device=dev), "earlier": earlier,
            }

        # -- steps: eager until `_capture_steps` swaps in captured replays ------------------
        self._draft: Callable[[], None] | None = self._draft_step if spec.drafting != "none" else None
        self._verify: Callable[[], None] = self._verify_step
        self._accept: Callable[[], None] = self._accept_step
        self.captured = backend is None or not getattr(backend, "graph_mode", False)
        # kernels the graph compiler generated for each captured step (phase -> count)
        self.kernels_per_step: dict[str, int] = {}

    # ------------------------------------------------------------------------------------
    def _capture_steps(self, cond: torch.Tensor, cond_mask: torch.Tensor | None) -> None:
        """Capture draft/verify/accept once, on state from a throwaway prefill.

        Capturing runs each step a few times (warm-up, compilation), which advances the
        caches; the real image's prefill resets all state afterwards.
        """
        self.prefill(cond, cond_mask, seed=0)
        steps = {"verify": self._verify_step, "accept": self._accept_step}
        if self._draft is not None:
            steps = {"draft": self._draft_step, **steps}
        for phase, step in steps.items():
            before = kernels_generated()
            replay = self.backend.capture(step, name=f"{self.spec.method}.{phase}")
            setattr(self, f"_{phase}", replay)
            made = kernels_generated() - before if before is not None else 0
            if made > 0:  # zero: the backend captured without a compiler (eager, CUDA graph)
                self.kernels_per_step[phase] = made
        self.captured = True

    def _timer(self):
        return self.timer if self.timer is not None else _NullTimer()

    def _dist(self, logits: torch.Tensor, depth: torch.Tensor | int | None = None) -> torch.Tensor:
        """(rows, T, V) logits -> (T, V) processed distribution (CFG, temperature, top-k/p).

        depth: tree depth of the T nodes these logits follow ((T,) tensor or an int for all);
        the token they predict has image index count + depth, which decides whether
        `cfg_interval` has switched guidance off. None = the prefill (guidance always on).
        """
        off = None
        if depth is not None and self.params.uses_cfg and self.params.cfg_interval >= 0:
            index = (self.count + depth).reshape(-1).expand(logits.size(1))
            off = cfg_off_mask(index, self.params.cfg_interval)
        return probabilities(apply_cfg(logits, self.params.cfg, off)[0], self.params)

    def _pick(self, probs: torch.Tensor) -> torch.Tensor:
        """One token per row of (T, V): argmax (greedy) or a sample."""
        if self.params.greedy:
            return probs.argmax(-1)
        return torch.argmax(torch.log(probs) + self.rng.gumbel(*probs.shape), dim=-1)

    def _rows(self, t: torch.Tensor) -> torch.Tensor:
        return t[None].expand(self.rows, *t.shape)

    # -- phases --------------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, cond: torch.Tensor, cond_mask: torch.Tensor | None, seed: int) -> None:
        """Reset state and run the condition. cond: (1,) label or (1, cls, caption_dim)."""
        self.cache.reset()
        self.rng.reset(seed)
        for t in (self.count, self.count_hist, self.relax_mass):
            t.zero_()
        if self.params.uses_cfg:
            cond = torch.cat([cond, self.target.null_condition(cond)])
            if cond_mask is not None:
                cond_mask = torch.cat([cond_mask, cond_mask])
        hidden = self.target.prefill(cond, self.cache, cond_mask)  # (rows, cls, dim)
        first = self._pick(self._dist(self.target.logits(hidden[:, -1:])))  # (1,)
        self.out[0] = first[0]
        self.tokens[0] = first[0]
        self.count.fill_(1)
        if self.spec.drafting == "none":
            return
        self.dcache.reset()
        if cond_mask is not None:
            self.dcache.prefix_valid[:, : self.cls] = cond_mask
        if self.cls > 1:  # condition positions 0..cls-2 pair token 0 with the target hidden
            c1 = self.cls - 1
            zeros = torch.zeros(self.rows, c1, dtype=torch.long, device=self.device)
            self.drafter.forward_cached(zeros, hidden[:, :c1], torch.arange(c1, device=self.device),
                                        torch.ones(c1, c1, dtype=torch.bool, device=self.device).tril(),
                                        self.dcache)
            self.dcache.advance(c1)
        self.pend_tokens.fill_(0)
        self.pend_tokens[0] = first[0]
        self.pend_hidden.zero_()
        self.pend_hidden[:, 0] = hidden[:, -1]
        self.pend_count.fill_(1)

    def _draft_level0(self) -> torch.Tensor:
        """Drafter over the last accepted block; returns the root's drafter output (rows, dim)."""
        positions = self.dcache.length + self.block_ids
        out = self.drafter.forward_cached(self._rows(self.pend_tokens), self.pend_hidden, positions,
                                          self.causal_m, self.dcache)
        root = out.index_select(1, (self.pend_count - 1).view(1)).squeeze(1)
        self.dcache.advance(self.pend_count)
        return root

    def _drafter_dist(self, out: torch.Tensor, depth: torch.Tensor | int) -> torch.Tensor:
        return self._dist(self.target.logits(out), depth)

    def _draft_step(self) -> None:
        root = self._draft_level0()
        self.draft_hidden[:, 0] = root
        self.q[0] = self._drafter_dist(root[:, None], 0)[0]
        if self.spec.drafting == "static":
            self._draft_static()
        else:
            self._draft_dynamic()

    def _draft_static(self) -> None:
        tree, k = self.tree, self.tree.max_children
        parent_start, parent_end = 0, 1
        # Sampled drafts: the Gumbel noise of every level in one draw (rows = nodes with
        # children-to-be, i.e. all nodes above the deepest level), one RNG call per step.
        noise = None if self.params.greedy else self.rng.gumbel(self.levels[-1][0], self.vocab)
        base = self.dcache.length - 1
        for d, (start, end) in enumerate(self.levels, start=1):
            q = self.q[parent_start:parent_end]
            if noise is None:
                cand = torch.topk(q, k, dim=-1).indices  # (parents, k)
            else:  # k samples without replacement (Gumbel-top-k)
                cand = torch.topk(torch.log(q) + noise[parent_start:parent_end], k, dim=-1).indices
            par = tree.parent[start:end]
            self.tokens[start:end] = cand[self.level_parent[d - 1], tree.rank[start:end]]
            if d < self.max_depth:
                hid = self.draft_hidden[:, par]
                positions = (base + d).expand(end - start)
                out = self.drafter.forward_cached(self._rows(self.tokens[start:end]), hid, positions,
                                                  tree.ancestor_mask[start:end, 1:end], self.dcache,
                                                  offset=start - 1)
                self.draft_hidden[:, start:end] = out
                self.q[start:end] = self._drafter_dist(out, d)
            parent_start, parent_end = start, end

    def _draft_dynamic(self) -> None:
        """EAGLE-2: the root's top-k, expanded `depth` times; keep the best total_tokens - 1.

        A node's score is its path's summed log q, made strictly lower than its parent's
        (`child_scores`), so the kept top set always holds a node's parent.
        """
        k, depth, dev = self.spec.top_k_draft, self.spec.depth, self.device
        c = self._dyn
        logq = torch.log(self.q[0]).clamp(min=_LOG_FLOOR)  # log 0 = -inf -> the floor
        top = torch.topk(logq, k)
        cand_tok, cand_score = [top.indices], [child_scores(c["zero"], top.values)]
        cand_parent = [c["no_parent"]]
        frontier = c["arange_k"]  # candidate ids of the frontier
        fr_tok, fr_score = top.indices, cand_score[0]
        fr_hidden = self.draft_hidden[:, :1].expand(self.rows, k, -1)
        fr_anc = c["eye_k"]  # (k, l*k) over frontier blocks
        base = k
        for level in range(1, depth + 1):
            positions = (self.dcache.length - 1 + level).expand(k)
            out = self.drafter.forward_cached(self._rows(fr_tok), fr_hidden, positions, fr_anc,
                                              self.dcache, offset=(level - 1) * k)
            lq = torch.log(self._drafter_dist(out, level)).clamp(min=_LOG_FLOOR)
            ch = torch.topk(lq, k, dim=-1)  # (k, k)
            scores = child_scores(fr_score[:, None], ch.values).reshape(-1)
            cand_tok.append(ch.indices.reshape(-1))
            cand_score.append(scores)
            cand_parent.append(frontier.repeat_interleave(k))
            best = torch.topk(scores, k).indices  # (k,) local ids in this block
            parent_local = best // k
            frontier = base + best
            fr_tok = ch.indices.reshape(-1)[best]
            fr_score = scores[best]
            fr_hidden = out[:, parent_local]
            fr_anc = torch.cat([fr_anc[parent_local], c["eye_k"]], dim=1)
            base += k * k
        tok = torch.cat(cand_tok)
        score = torch.cat(cand_score)
        par = torch.cat(cand_parent)
        sel = torch.topk(score, self.n1 - 1).indices.sort().values  # parents before children
        inv = torch.full((self.n_cand,), -1, dtype=torch.long, device=dev)
        inv[sel] = c["arange_nodes"]
        sel_par = par[sel]
        node_parent = torch.where(sel_par < 0, 0, inv[sel_par.clamp(min=0)] + 1)
        parent = torch.cat([c["zero_long"], node_parent])
        rank = ((parent[:, None] == parent[None, :]) & c["earlier"]).sum(1)
        built = buffers_from_parents(parent, rank, depth + 1, k)
        t = self.tree
        for dst, src in ((t.parent, built.parent), (t.depth, built.depth), (t.rank, built.rank),
                         (t.ancestor_mask, built.ancestor_mask), (t.children, built.children),
                         (t.path_table, built.path_table), (t.earlier_sibling, built.earlier_sibling)):
            dst.copy_(src)
        self.tokens[1:] = tok[sel]

    def _verify_step(self) -> None:
        x = self.target.tok_embeddings(self._rows(self.tokens))
        positions = self.cache.length + self.tree.depth
        hidden = self.target.forward_cached(x, positions, self.tree.ancestor_mask, self.cache)
        self.hidden.copy_(hidden)
        self.p.copy_(self._dist(self.target.logits(hidden), self.tree.depth))

    def _accept_step(self) -> None:
        if not self.max_depth:
            self._accept_ar()
            return
        tokens, p = self.tokens[None], self.p[None]
        if self.params.greedy:
            acc: Accepted = accept_greedy(tokens, p, self.tree, self.relax)
        else:
            q = self.q[None] if self.spec.drafting == "static" else None
            acc = accept_sampling(tokens, p, self.tree, self.rng, q=q, relax=self.relax)
        path, n, bonus = acc.path[0], acc.count[0], acc.bonus[0]
        self.cache.commit(path, n)
        m = path.numel()
        # new tokens after the root: accepted drafts, then the bonus at index n-1
        block = torch.cat([self.tokens[path[1:]], bonus.view(1)])
        block = block.scatter(0, (n - 1).view(1), bonus.view(1))
        self.out.index_copy_(0, self.count + self.block_ids[:m], block)
        self.count.add_(n)
        self.tokens[0] = bonus
        self.count_hist.index_add_(0, n.view(1), self.one)
        if self.relax.active:
            self.relax_mass.add_(acc.relax_mass[0])
        if self.spec.drafting != "none":
            self.pend_tokens.copy_(block)
            self.pend_hidden.copy_(self.hidden[:, path])
            self.pend_count.copy_(n)

    def _accept_ar(self) -> None:
        """AR: the verified token is already in the cache; pick the next one from p."""
        token = self._pick(self.p[:1])
        self.cache.advance(1)
        self.out.index_copy_(0, self.count.view(1), token)
        self.count.add_(1)
        self.tokens[:1] = token
        self.count_hist[1:2].add_(1)

    # -- the loop -------------------------------------------------------------------------------
    @torch.no_grad()
    def generate_one(self, cond: torch.Tensor, cond_mask: torch.Tensor | None = None,
                     seed: int = 0) -> tuple[torch.Tensor, ImageStats]:
        """Tokens (block_size,) long on the device and the image's statistics."""
        timer = self._timer()
        if not self.captured:
            with timer.phase("capture"):
                self._capture_steps(cond, cond_mask)
        with timer.phase("prefill"):
            self.prefill(cond, cond_mask, seed)
        mark = getattr(self.backend, "mark_step", None)
        while int(self.count) < self.num_tokens:  # the one host sync per iteration
            if self._draft is not None:
                with timer.phase("draft"):
                    self._draft()
            with timer.phase("verify"):
                self._verify()
            with timer.phase("accept"):
                self._accept()
            if mark is not None:
                mark()
        return self.out[: self.num_tokens].clone(), self._stats()

    def _stats(self) -> ImageStats:
        hist = self.count_hist.tolist()  # hist[c]: iterations accepting c nodes, root included
        iters = sum(hist)
        depth_acc = [sum(hist[d + 2:]) for d in range(self.max_depth)]
        reached = [iters] + depth_acc[:-1] if self.max_depth else []
        accepted = int(self.count)  # tokens known: the prefill's first one plus n per iteration
        return ImageStats(tokens=self.num_tokens, target_forwards=1 + iters,
                          accepted_tokens=accepted, depth_accepted=depth_acc,
                          depth_reached=reached, relax_mass=float(self.relax_mass),
                          accepted_drafts=accepted - 1 - iters)
