"""What the phases of one decoder share: its fixed settings, its buffers, and the contracts
between the loop and its drafting policy.

    DecodeConfig    frozen: the method spec, the models, the sizes, the device (set once)
    DecodeBuffers   frozen: every tensor the loop reads and writes in place, built whole by
                    `DecodeBuffers.allocate` once the tree's size is known
    DraftView       what a drafting policy sees of them: the buffers it writes (the draft
                    tokens and their q) and the ones it only reads
    DraftProposal   what a draft hands to verify and accept: the tokens, their q, the tree
                    (one proposal per tree prefix the policy may verify)

Buffers keep their identities for the decoder's lifetime (graph capture replays into them);
"frozen" means no field is ever rebound, while the tensors are written in place.

Shapes: B images (`batch`), R model rows (`rows`: 2B with classifier-free guidance, else B),
N+1 tree nodes (node 0 the root), V the vocabulary, D the target's width, M = max_depth + 1 the
longest accepted block, S = num_tokens the image tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from runtime.core.methods import MethodSpec
from runtime.core.rng import CounterRNG
from runtime.core.sampling import SamplingParams, apply_cfg, cfg_off_mask, probabilities
from runtime.core.tree import TreeBuffers
from runtime.utils.errors import UserError

if TYPE_CHECKING:
    from runtime.models.target import DrafterModel, Target

# nonfinite[...] when no NaN or inf was seen (any index past an image's end)
NO_POSITION = 1 << 40
# the models whose logits are watched for NaN / inf, in `DecodeBuffers.nonfinite`'s row order
MODEL_PARTS = ("target model", "drafter")


@dataclass(frozen=True, eq=False)
class DecodeConfig:
    """The settings every phase reads and none writes."""

    spec: MethodSpec
    target: Target
    drafter: DrafterModel | None  # None for the policies that draft without one (AR, jacobi, pjd)
    device: torch.device
    dtype: torch.dtype
    batch: int  # B
    rows: int  # R: 2B with classifier-free guidance, else B
    cls: int  # condition positions per row
    vocab: int  # V
    num_tokens: int  # S, tokens per image
    # a layout's fixed tokens: constrain(logits (B, T, V), image index (B, T)) -> logits, or None
    constrain: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None
    # Output-head rows nobody reads are worth skipping at the price of an index op or a few
    # small matmuls: on the CPU, where a matmul costs its multiply-adds. On a GPU or Gaudi the
    # head costs its weight reads whatever the rows, so the plain form stays (`lazy_head_mode`).
    lean_head: bool = False
    # the backend's own attention over a static cache (`Backend.cached_attention`); None: SDPA
    attention: Callable[..., torch.Tensor | None] | None = None

    @classmethod
    def for_models(cls, target: Target, drafter: DrafterModel | None, spec: MethodSpec, batch: int,
                   lean_head: bool | None = None, attention: Callable[..., torch.Tensor | None] | None = None
                   ) -> DecodeConfig:
        """The settings of `spec` on `target` (its device and dtype) at batch size `batch`; refuses
        a batch below 1 and a drafted method without its drafter. lean_head: None = the device's
        (the CPU's)."""
        if batch < 1:
            raise UserError(f"--batch-size must be >= 1, got {batch}")
        if spec.needs_drafter and drafter is None:
            raise UserError(f"method {spec.method} needs a drafter; pass --drafter DIR or use --method ar")
        weight = target.tok_embeddings.weight
        return cls(spec=spec, target=target, drafter=drafter, device=weight.device, dtype=weight.dtype,
                   batch=batch, rows=(2 if spec.sampling.uses_cfg else 1) * batch,
                   cls=target.config.cls_token_num, vocab=target.config.vocab_size,
                   num_tokens=target.config.block_size, constrain=target.constrain,
                   lean_head=weight.device.type == "cpu" if lean_head is None else lean_head, attention=attention)

    def new_cache(self, model: Any, rows: int, capacity: int) -> Any:
        """`model.new_cache(rows, capacity, device)` whose attention is this decoding's (the backend's)."""
        cache = model.new_cache(rows, capacity, self.device)
        cache.attention = self.attention
        return cache

    @property
    def params(self) -> SamplingParams:
        return self.spec.sampling

    def guided(self, cond: torch.Tensor, cond_mask: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One image's condition (1, ...) and mask (1, cls) or None as its model rows: with
        classifier-free guidance the target's null condition (and its padding) appended (2, ...)."""
        if not self.params.uses_cfg:
            return cond, cond_mask
        if cond_mask is not None:
            cond_mask = torch.cat([cond_mask, self.target.null_condition_mask(cond_mask)])
        return torch.cat([cond, self.target.null_condition(cond)]), cond_mask

    def expand_rows(self, t: torch.Tensor) -> torch.Tensor:
        """Per-image (B, ...) -> per model row (R, ...): the cond and uncond rows share it."""
        # a view at B = 1 (the stride-0 dim merges), one copy for larger batches
        return t[None].expand(2, *t.shape).flatten(0, 1) if self.params.uses_cfg else t

    def dist(self, logits: torch.Tensor, count: torch.Tensor, depth: torch.Tensor | int | None = None, *,
             draft: bool = False, log: bool = False, rank: bool = False,
             head: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """(R, T, V) logits -> (B, T, V) processed distribution (CFG, temperature, top-k/p).

        count: (B,) tokens known per image. depth: tree depth of the T nodes these logits follow
        ((T,) or per image (B, T) tensor, or an int for all); the token they predict has image
        index count + depth, which decides whether `cfg_interval` has switched guidance off.
        None = the prefill (guidance always on). draft: the drafter's logits, mixed by the
        fused CFG (`apply_cfg`); log: the log of the distribution (`probabilities`). rank (greedy
        only): the guided, constrained logits, unnormalised; they order the tokens as the
        distribution does, which is all a greedy top-k reads. head (drafts only): `logits` are
        the (R, T, D) hidden states before the model's output head, a linear map (`Target.logits`),
        so guidance mixes them before it: (s h_c + (1 - s) h_u) W is s h_c W + (1 - s) h_u W in
        half the head's multiply-adds (B rows instead of 2B), rounded differently.
        """
        params = self.params
        assert not rank or params.greedy, "rank is the greedy distribution's order; sampling needs the distribution"
        off = None
        if depth is not None and params.uses_cfg and params.cfg_interval >= 0:
            index = (count[:, None] + depth).expand(self.batch, logits.size(1))
            off = cfg_off_mask(index, params.cfg_interval)
        mixed = apply_cfg(logits, params.cfg, off, fused=draft)
        if head is not None:
            mixed = head(mixed)
        if self.constrain is not None:  # tokens the model's layout fixes or forbids at an image index
            # the prefill (depth None) picks image index 0 for each of its rows, whatever the batch
            index = count[:, None] + depth if depth is not None else count.new_zeros(mixed.size(0), 1)
            mixed = self.constrain(mixed, index.expand(mixed.size(0), mixed.size(1)))
        return mixed if rank else probabilities(mixed, params, log=log)


@dataclass(frozen=True, eq=False)
class DecodeBuffers:
    """Every tensor the loop keeps between steps, allocated together.

    The decode:
        tokens     (B, N+1) long   node tokens; the policy fills the drafts, accept sets the root
        q          (B, N+1, V)     q[:, i] = the distribution node i's children were drawn from
                                   (None when the policy's drafts are not sampled; a greedy
                                   static tree keeps its guided logits there, an order only)
        p          (B, N+1, V)     the target's processed distribution after each node (verify)
        hidden     (R, N+1, D)     the target's last hidden state at each node (verify)
        count      (B,) long       tokens known per image, the pending root included
        out        (B, S + 2M + 1) each image's tokens so far (a done image's block still lands,
                                   unread, past its end: room for two blocks)
        block      (B, M) long     the last accept's new tokens (accepted drafts, then the bonus)
        block_ids  (M,) long       arange(M)
        accepted   (B,) long       the last accept's node count (root included; 0 once done)
        live_now   (B,) long       1 for images still generating (what `live()` last wrote)
    The statistics (read once an image is done):
        count_hist (B, M+1) long   iterations of image i that accepted c nodes (root included);
                                   iterations, accepted drafts and per-depth acceptance follow
        relax_mass (B,)            summed relaxation mass of the accepted steps
        nonfinite  (2, B) long     first image index whose target (0) / drafter (1) logits held
                                   NaN or inf, NO_POSITION if none
        drafted_sum (B,) long      tree levels drafted (a depth decided per iteration)
        reached    (B, max(M-1,1)) iterations whose accepted path could reach depth d+1
        depth_ids  (max(M-1,1),)   arange(1, ...)
        node_hits  (B, N+1) long   how often each node was accepted (`track_nodes`), or None
        law_sums   (3, B)          measured TV, its bound, steps measured (`measure_law`)
    """

    tokens: torch.Tensor
    q: torch.Tensor | None
    p: torch.Tensor
    hidden: torch.Tensor
    count: torch.Tensor
    out: torch.Tensor
    block: torch.Tensor
    block_ids: torch.Tensor
    accepted: torch.Tensor
    live_now: torch.Tensor
    count_hist: torch.Tensor
    relax_mass: torch.Tensor
    nonfinite: torch.Tensor
    drafted_sum: torch.Tensor
    reached: torch.Tensor
    depth_ids: torch.Tensor
    node_hits: torch.Tensor | None
    law_sums: torch.Tensor

    @classmethod
    def allocate(cls, config: DecodeConfig, tree: TreeBuffers, dim: int, *, sampled_q: bool,
                 track_nodes: bool = False) -> DecodeBuffers:
        """The buffers of a decoder verifying `tree` with a target of width `dim`; `sampled_q`
        allocates q, `track_nodes` node_hits."""
        b, nodes, m, dev, v = config.batch, tree.size, tree.max_depth + 1, config.device, config.vocab
        deep = max(tree.max_depth, 1)

        def longs(*size: int) -> torch.Tensor:
            return torch.zeros(*size, dtype=torch.long, device=dev)

        return cls(tokens=longs(b, nodes),
                   q=torch.zeros(b, nodes, v, device=dev) if sampled_q else None,
                   p=torch.zeros(b, nodes, v, device=dev),
                   hidden=torch.zeros(config.rows, nodes, dim, device=dev, dtype=config.dtype),
                   count=longs(b), out=longs(b, config.num_tokens + 2 * m + 1),
                   block=longs(b, m), block_ids=torch.arange(m, device=dev),
                   accepted=longs(b) + 1, live_now=longs(b) + 1,
                   count_hist=longs(b, m + 1), relax_mass=torch.zeros(b, device=dev),
                   nonfinite=longs(len(MODEL_PARTS), b) + NO_POSITION,
                   drafted_sum=longs(b), reached=longs(b, deep), depth_ids=torch.arange(1, deep + 1, device=dev),
                   node_hits=longs(b, nodes) if track_nodes else None,
                   law_sums=torch.zeros(3, b, device=dev))

    def live(self, num_tokens: int) -> torch.Tensor:
        """(B,) long: 1 for images still generating, 0 for those done (their advances are 0).
        Written into `live_now` (one kernel, no conversion): the same tensor every call."""
        return torch.lt(self.count, num_tokens, out=self.live_now)


@dataclass(frozen=True, eq=False)
class DraftView:
    """What a drafting policy sees of the loop: its settings, its random streams, and buffers.

    The policy writes `tokens[:, 1:]` (node 0 is the root the last accept set) and, where its
    drafts are sampled, `q`; everything else it only reads: `count`, `out` (tokens known),
    `p` and `hidden` (the last verify's), `block` and `accepted` (the last accept's new tokens
    and node count: the drafter policies' pending block), `block_ids`, `live_now` (through `live()`). Shapes as in
    `DecodeBuffers`.
    """

    config: DecodeConfig
    rng: CounterRNG  # one counter-based stream per image
    grouped: bool  # acceptance is grouped (it draws its own uniforms)
    tokens: torch.Tensor
    q: torch.Tensor | None
    count: torch.Tensor
    out: torch.Tensor
    p: torch.Tensor
    hidden: torch.Tensor
    block: torch.Tensor
    accepted: torch.Tensor
    block_ids: torch.Tensor
    live_now: torch.Tensor

    @classmethod
    def of(cls, config: DecodeConfig, rng: CounterRNG, buffers: DecodeBuffers, *, grouped: bool) -> DraftView:
        b = buffers
        return cls(config, rng, grouped, b.tokens, b.q, b.count, b.out, b.p, b.hidden, b.block, b.accepted,
                   b.block_ids, b.live_now)

    def dist(self, logits: torch.Tensor, depth: torch.Tensor | int | None = None, *, draft: bool = False,
             log: bool = False, rank: bool = False,
             head: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """`DecodeConfig.dist` at the images' current counts."""
        return self.config.dist(logits, self.count, depth, draft=draft, log=log, rank=rank, head=head)

    def live(self) -> torch.Tensor:
        """(B,) long, 1 for images still generating (`DecodeBuffers.live`, into the same tensor)."""
        return torch.lt(self.count, self.config.num_tokens, out=self.live_now)


@dataclass(frozen=True, eq=False)
class LookaheadRows:
    """Nodes verified after the tree in the same forward that acceptance never judges (pjd's
    lookahead rows; E of them). The policy fills `tokens` (B, E) and `offset` (B, E) (position
    minus the root's) in its draft; `mask` (N+1+E, N+1+E) is the whole forward's attention
    mask; verify writes the target's distributions after them into `p` (B, E, V)."""

    tokens: torch.Tensor
    offset: torch.Tensor
    mask: torch.Tensor
    p: torch.Tensor


@dataclass(frozen=True, eq=False)
class DraftProposal:
    """A draft's output for verify and accept, at one verified depth (the tree cut to its
    depths <= `depth`; the whole tree at the deepest). The tensors are views of the buffers the
    draft fills in place, so one proposal per depth serves every iteration (graph capture
    replays into the same memory).

        tokens  (B, n1) long     the tree's node tokens, n1 = tree.size, root first
        q       (B, n1, V)       the distributions the drafts were sampled from, or None when the
                                 drafts are deterministic (acceptance then treats them as such)
        tree    the tree these nodes form (batched (B, ...) buffers for dynamic trees)
        lookahead  nodes verified after the tree that nobody judges, or None
    """

    depth: int
    tree: TreeBuffers
    tokens: torch.Tensor
    q: torch.Tensor | None
    lookahead: LookaheadRows | None = None


# The head's multiply-adds `lazy_head_mode` must skip before the extra ops it costs (about 25 per
# depth for the path walk) pay on the CPU: about 1 ms of one core.
LAZY_HEAD_MIN_MACS = 1 << 25


def lazy_head_mode(given: bool | None, config: DecodeConfig, tree: Any, relaxed: bool, policy: Any) -> str | None:
    """Where greedy acceptance runs the target's head instead of over all N + 1 verified nodes in
    the verify: "path" (exact: along the path it accepts, D + 1 one-row matmuls,
    `accept_greedy_path`; verify leaves p alone), "parents" (relaxed: at the nodes with
    children, whose distributions the drafts are judged against, in the verify, at most
    `policy.most_parents` of them, and at the accepted leaf for the bonus), or None (the head
    over every node: sampling, a policy that reads p, or not worth it).

    given: the caller's choice (True: wherever one applies); None = where it saves compute: on
    the CPU (compute-bound), when the head work skipped is worth more than the extra ops (a head
    that is a large part of a small model's verify). Where reading the weights is the cost (a
    GPU or Gaudi), every extra small matmul reads the whole head again (LlamaGen-XL's: 42 MB in
    bf16), so it stays off there.
    """
    if not config.params.greedy or policy.reads_p or not tree.max_depth or given is False:
        return None
    mode, kept = ("parents", policy.most_parents + 1) if relaxed else ("path", tree.max_depth + 1)
    skipped = config.rows * (tree.size - kept) * config.vocab * config.target.config.dim
    return mode if given or (config.lean_head and skipped >= LAZY_HEAD_MIN_MACS) else None


def check_tree(tree: Any, config: DecodeConfig) -> None:
    """Refuse a tree this model cannot verify: more children than tokens, or deeper than its RoPE table."""
    if tree.max_children > config.vocab:
        raise UserError(f"the draft tree gives a node {tree.max_children} children (ranks 0.."
                        f"{tree.max_children - 1}) but this model has only {config.vocab} tokens; "
                        "use a narrower tree or a smaller --top-k-draft")
    room = config.target.max_position - config.cls - config.num_tokens
    if room < 1:
        raise UserError(f"this model's positions (max_position_embeddings {config.target.max_position}) cannot hold "
                        f"a prompt of {config.cls} tokens and an image of {config.num_tokens} tokens; choose a "
                        "smaller --image-size or --prompt-length")
    if tree.max_depth + 1 > room:
        raise UserError(f"tree depth {tree.max_depth} is too deep for this model's RoPE table (at most {room - 1})")
