"""The physical floor of each decoding phase: bytes that must move and FLOPs that must run.

A phase cannot finish faster than `max(bytes / bandwidth, FLOPs / matmul rate)` on a device
(the roofline). The work is counted from the shapes alone, as the least any implementation must
do, so `measured / floor` is how far a phase is from what the hardware allows:

* **weights**: every weight a forward multiplies by is read once per forward (all parameters
  except embedding tables, of which a step gathers only its tokens' rows, counted as such);
* **KV cache**: the keys and values of the `context` committed positions are read once per layer,
  and the new tokens' keys and values written once;
* **logits**: the verify step writes (rows, tokens, vocab) logits; accept reads them once.

FLOPs are 2 per multiply-accumulate: the weight matmuls (2 x weights x rows x tokens) and
attention (4 x layers x width x context x rows x tokens). Elementwise work is left out: it is
bandwidth-bound and its bytes are a few per element of what is counted.

Peak bandwidth and matmul rate per device come from vendors' specifications (`ROOFS`, each with
its source); on a CPU they are measured by a copy and a matmul microbenchmark (`measure_cpu_roof`)
and recorded in the profile `runtime tune` writes (`[roof]`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Sequence

import torch

from runtime.config.method_options import Drafting

if TYPE_CHECKING:
    from backends import Backend
    from runtime.core.steps import DecodeSteps



@dataclass(frozen=True)
class Roof:
    """A device's peaks: `bandwidth` bytes/s of memory, `matmul` FLOP/s of dense matmul per dtype."""

    name: str
    bandwidth: float
    matmul: dict[str, float]
    source: str

    def rate(self, dtype: str) -> float:
        """The matmul peak in `dtype` ("bf16", "fp16", "fp32"); fp16 falls back to bf16's."""
        if dtype in self.matmul:
            return self.matmul[dtype]
        if dtype == "fp16" and "bf16" in self.matmul:
            return self.matmul["bf16"]
        raise KeyError(f"{self.name}: no matmul peak for {dtype}")

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "bandwidth_bytes_per_s": self.bandwidth, "matmul_flops_per_s": dict(self.matmul),
                "source": self.source}


T = 1e12
_NVIDIA = "NVIDIA's datasheet"
_HOT_CHIPS = "Intel's Hot Chips 2024 Gaudi table"
# (substrings of the device name, lower case; the first roof whose every substring matches wins)
ROOFS: tuple[tuple[tuple[str, ...], Roof], ...] = (
    (("h200",), Roof("NVIDIA H200 SXM", 4.8 * T, {"bf16": 989 * T, "fp32": 67 * T},
                     f"{_NVIDIA} (H200: 4.8 TB/s HBM3e, 989 TFLOPS BF16 dense, 67 TFLOPS FP32)")),
    (("h100", "pcie"), Roof("NVIDIA H100 PCIe", 2.0 * T, {"bf16": 756 * T, "fp32": 51 * T},
                            f"{_NVIDIA} (H100 PCIe: 2.0 TB/s HBM2e, 756 TFLOPS BF16 dense, 51 TFLOPS FP32)")),
    (("h100",), Roof("NVIDIA H100 SXM", 3.35 * T, {"bf16": 989 * T, "fp32": 67 * T},
                     f"{_NVIDIA} (H100 SXM5: 3.35 TB/s HBM3, 989 TFLOPS BF16 dense, 67 TFLOPS FP32)")),
    (("a100", "40gb"), Roof("NVIDIA A100 40GB", 1.555 * T, {"bf16": 312 * T, "fp32": 19.5 * T},
                            f"{_NVIDIA} (A100 40GB: 1,555 GB/s, 312 TFLOPS BF16 dense, 19.5 TFLOPS FP32)")),
    (("a100",), Roof("NVIDIA A100 80GB", 2.039 * T, {"bf16": 312 * T, "fp32": 19.5 * T},
                     f"{_NVIDIA} (A100 80GB SXM: 2,039 GB/s, 312 TFLOPS BF16 dense, 19.5 TFLOPS FP32)")),
    (("3090",), Roof("NVIDIA RTX 3090", 0.936 * T, {"bf16": 71 * T, "fp32": 35.6 * T},
                     "NVIDIA's GA102 whitepaper (936 GB/s GDDR6X; 71 TFLOPS BF16 tensor with FP32 accumulate, "
                     "dense; 35.6 TFLOPS FP32)")),
    (("gaudi3",), Roof("Intel Gaudi 3", 3.67 * T, {"bf16": 1835 * T},
                       f"{_HOT_CHIPS} (Gaudi 3: 3.67 TB/s HBM2e, 1,835 TFLOPS BF16 on the MMEs)")),
    (("gaudi2",), Roof("Intel Gaudi 2", 2.46 * T, {"bf16": 432 * T},
                       f"{_HOT_CHIPS} (Gaudi 2: 2.46 TB/s HBM2e, 432 TFLOPS BF16 on the MMEs)")),
    (("hl-225",), Roof("Intel Gaudi 2", 2.46 * T, {"bf16": 432 * T},
                       f"{_HOT_CHIPS} (Gaudi 2: 2.46 TB/s HBM2e, 432 TFLOPS BF16 on the MMEs)")),
)


def roof_for(device_name: str) -> Roof | None:
    """The vendor roof of a device by its name (torch's `get_device_name`, Habana's device type),
    or None for a device not in the table."""
    name = device_name.lower().replace(" ", "")
    for needles, roof in ROOFS:
        if all(n in name for n in needles):
            return roof
    return None


_MEASURED: dict[tuple[torch.dtype, int], Roof] = {}


def device_roof(backend: Backend, profile: Any = None) -> Roof | None:
    """The roof of the backend's device: the vendor table by device name; else the profile's
    measured `[roof]`; else, on a CPU, measured now (about a second). None for an accelerator
    missing from the table (its floor is then not shown)."""
    from backends.base import dtype_name

    info = backend.info()
    roof = roof_for(str(info.get("name", "")))
    if roof is not None:
        return roof
    dtype = dtype_name(backend.dtype)
    measured = getattr(profile, "roof", None)
    if measured is not None:
        return Roof(f"{info.get('name', backend.name)} (profile {profile.name})", measured.bandwidth_gbs * 1e9,
                    {dtype: measured.matmul_tflops * T}, measured.source or f"profile {profile.name} [roof]")
    if backend.name == "cpu":
        key = (backend.dtype, torch.get_num_threads())
        if key not in _MEASURED:  # once per process: a second bench in it reads the same roof
            _MEASURED[key] = replace(measure_cpu_roof(backend.dtype), name=str(info.get("name", "this CPU")))
        return _MEASURED[key]
    return None


def measure_cpu_roof(dtype: torch.dtype = torch.float32, *, copy_mb: int = 256, size: int = 1024,
                     repeats: int = 5) -> Roof:
    """This CPU's peaks, measured on the threads torch uses now (about a second): the memory's
    rate as the better of `repeats` copies of a `copy_mb` MB tensor (bytes read + written per
    second) and `repeats` sums over it (bytes read per second: a decoding step mostly reads
    weights, and a core can read faster than it copies), and the best of `size`^3 matmuls in
    `dtype` (2 size^3 FLOPs each)."""
    src = torch.empty(copy_mb * 2**20 // 4, dtype=torch.float32)
    src.fill_(1.0)
    dst = torch.empty_like(src)
    best_copy = min(_timed(lambda: dst.copy_(src)) for _ in range(repeats))
    best_read = min(_timed(lambda: src.sum()) for _ in range(repeats))
    bandwidth = max(2 * src.numel() * 4 / best_copy, src.numel() * 4 / best_read)
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    a @ b  # warm-up: the BLAS picks its kernel
    best_mm = min(_timed(lambda: a @ b) for _ in range(repeats))
    name = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    return Roof("this CPU", bandwidth, {name: 2 * size**3 / best_mm},
                f"measured: best of {repeats} {copy_mb} MB copies and reads and {size}^3 {name} matmuls, "
                f"{torch.get_num_threads()} threads")


class ReadProbe:
    """The memory's read rate sampled while steps are timed: one sum over a `mb` MB buffer per
    call, its bytes per second kept. A host whose bandwidth drifts with its neighbours' load
    (the shared 2-core CI machine: 34 to 60 GB/s between runs) gets a floor from the rate its
    steps met rather than from a moment before them."""

    def __init__(self, mb: int = 256) -> None:
        self.buffer = torch.ones(mb * 2**20 // 4, dtype=torch.float32)
        self.rates: list[float] = []

    def __call__(self) -> None:
        self.rates.append(self.buffer.numel() * 4 / _timed(lambda: self.buffer.sum()))

    def applied(self, roof: Roof) -> Roof:
        """`roof` with the median sampled read rate as its bandwidth (unchanged without samples)."""
        if not self.rates:
            return roof
        rate = float(sorted(self.rates)[len(self.rates) // 2])
        return replace(roof, bandwidth=rate, source=f"{roof.source}; bandwidth: the median of {len(self.rates)} "
                       f"reads of {self.buffer.numel() * 4 >> 20} MB taken between the timed rounds")


def _timed(fn: Any) -> float:
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began


@dataclass(frozen=True)
class Work:
    """What a phase must do at least: `bytes` moved to or from memory and `flops` of matmul."""

    bytes: float
    flops: float

    def __add__(self, other: "Work") -> "Work":
        return Work(self.bytes + other.bytes, self.flops + other.flops)

    def floor_s(self, roof: Roof, dtype: str) -> float:
        """max(bytes / bandwidth, FLOPs / rate): no device finishes the phase faster."""
        return max(self.bytes / roof.bandwidth, self.flops / roof.rate(dtype))

    def against(self, measured_s: float, roof: Roof, dtype: str) -> dict[str, float]:
        """The phase's floor, measured / floor, and the achieved fractions of bandwidth and rate."""
        floor = self.floor_s(roof, dtype)
        return {"bytes": self.bytes, "flops": self.flops, "floor_s": floor, "measured_s": measured_s,
                "over_floor": measured_s / floor,
                "bandwidth_fraction": self.bytes / measured_s / roof.bandwidth,
                "rate_fraction": self.flops / measured_s / roof.rate(dtype)}


@dataclass(frozen=True)
class StackShape:
    """A transformer stack as the roofline sees it: the weights a forward multiplies by, and what
    one position of context or one new token costs in the KV cache."""

    weight_params: int  # parameters read by every forward (embedding tables excluded)
    embed_width: int  # width of the embedding rows a forward gathers per token (0: none)
    layers: int
    width: int  # attention width (heads x head dim): FLOPs per context position and token
    kv_width: int  # keys + values stored per position and layer (2 x kv heads x head dim)


def target_shape(config: Any) -> StackShape:
    """A LlamaGen GPT config's StackShape, counted on the meta device (no memory)."""
    from runtime.models.gpt import Transformer

    with torch.device("meta"):
        model = Transformer(config)
    return _stack(model, config.n_layer, config.dim, 2 * config.kv_heads * (config.dim // config.n_head))


def drafter_shape(config: Any) -> StackShape:
    """An EAGLE/LANTERN drafter config's StackShape (its layers; the head is the target's)."""
    from runtime.models.drafter import Drafter

    with torch.device("meta"):
        model = Drafter(config)
    head_dim = config.hidden_size // config.num_attention_heads
    return _stack(model, config.num_hidden_layers, config.hidden_size, 2 * config.num_key_value_heads * head_dim)


def _stack(model: torch.nn.Module, layers: int, width: int, kv_width: int) -> StackShape:
    embeds = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    weights = sum(p.numel() for p in model.parameters() if id(p) not in embeds)
    return StackShape(weights, width if embeds else 0, layers, width, kv_width)


def forward_work(stack: StackShape, *, rows: int, tokens: int, context: int, itemsize: int,
                 head: tuple[int, int] | None = None, logits_itemsize: int = 4) -> Work:
    """One forward of `stack` over `tokens` new positions in each of `rows` rows, attending to
    `context` earlier positions (plus the new ones). `head` (vocab, width): an extra output
    matrix it multiplies by (the target's, for a drafter), whose logits it writes."""
    n = rows * tokens
    weights = stack.weight_params * itemsize
    gathered = n * stack.embed_width * itemsize
    kv_read = stack.layers * stack.kv_width * rows * context * itemsize
    kv_write = stack.layers * stack.kv_width * n * itemsize
    flops = 2.0 * stack.weight_params * n + 4.0 * stack.layers * stack.width * n * (context + tokens)
    work = Work(weights + gathered + kv_read + kv_write, flops)
    if head is not None:
        vocab, width = head
        work = work + Work(vocab * width * itemsize + n * vocab * logits_itemsize, 2.0 * vocab * width * n)
    return work


def target_forward(stack: StackShape, vocab: int, *, rows: int, tokens: int, context: int, itemsize: int,
                   logits_itemsize: int = 4) -> Work:
    """A target forward (AR step or verify): its weights include its output head, and it writes
    (rows, tokens, vocab) logits."""
    return forward_work(stack, rows=rows, tokens=tokens, context=context, itemsize=itemsize) + Work(
        rows * tokens * vocab * logits_itemsize, 0.0)


def draft_work(drafter: StackShape, head: tuple[int, int], level_tokens: Sequence[int], *, rows: int, context: int,
               itemsize: int) -> Work:
    """The draft phase: one drafter forward per level over that level's tokens, each through
    the target's head (`head` = (vocab, width))."""
    total = Work(0.0, 0.0)
    for depth, tokens in enumerate(level_tokens):
        total = total + forward_work(drafter, rows=rows, tokens=tokens, context=context + depth, itemsize=itemsize,
                                     head=head)
    return total


def accept_work(*, rows: int, tokens: int, vocab: int, logits_itemsize: int = 4) -> Work:
    """The accept phase: the verify's logits read once (sampling, the acceptance test, the
    residual); its own FLOPs are elementwise."""
    return Work(float(rows * tokens * vocab * logits_itemsize), 0.0)


def floors(work: dict[str, Work], medians: dict[str, float], roof: Roof, dtype: torch.dtype) -> dict[str, Any]:
    """Each phase's floor against its median measured seconds (`medians`, with the whole
    iteration's under "iteration"), and the iteration's floor: its phases' floors summed (they
    run one after another)."""
    from backends.base import dtype_name

    name = dtype_name(dtype)
    out: dict[str, Any] = {phase: w.against(medians[phase], roof, name) for phase, w in work.items() if phase in medians}
    total = sum(v["floor_s"] for v in out.values())
    out["iteration"] = {"floor_s": total, "measured_s": medians["iteration"],
                        "over_floor": medians["iteration"] / total}
    return out


def level_tokens(decoder: DecodeSteps) -> list[int]:
    """Tokens each drafter forward runs: the root first, then at each level the nodes whose
    children it drafts (a static tree's nodes at that depth; EAGLE-2's top-k frontier)."""
    tree = decoder.policy.tree
    if decoder.config.spec.drafting == Drafting.DYNAMIC:
        return [1] + [tree.max_children] * (tree.max_depth - 1)
    depth = tree.depth.cpu()
    return [1] + [int((depth == d).sum()) for d in range(1, tree.max_depth)]


def decoder_phases(decoder: DecodeSteps, context: int | None = None) -> dict[str, Work]:
    """The floor work of a built Decoder's phases (`draft` where it drafts, `verify`, `accept`)
    at `context` committed positions (default: the mean over an image, condition + half the
    image tokens). LlamaGen targets and drafters; {} for a target of another family."""
    from runtime.models.configs import DrafterConfig, GPTConfig

    cfg = decoder.config.target.config
    if not isinstance(cfg, GPTConfig):
        return {}  # a Chameleon-family target: its layers are not counted here yet
    itemsize = torch.empty((), dtype=decoder.config.dtype).element_size()
    ctx = cfg.cls_token_num + cfg.block_size // 2 if context is None else context
    vocab = cfg.vocab_size
    target = target_shape(cfg)
    phases: dict[str, Work] = {}
    config, tree = decoder.config, decoder.policy.tree
    if tree.max_depth and config.spec.drafting in (Drafting.STATIC, Drafting.DYNAMIC) and isinstance(
            getattr(config.drafter, "config", None), DrafterConfig):
        phases["draft"] = draft_work(drafter_shape(config.drafter.config), (vocab, cfg.dim), level_tokens(decoder),
                                     rows=config.rows, context=ctx, itemsize=itemsize)
    phases["verify"] = target_forward(target, vocab, rows=config.rows, tokens=tree.size, context=ctx,
                                      itemsize=itemsize)
    phases["accept"] = accept_work(rows=config.rows, tokens=tree.size, vocab=vocab)
    return phases
