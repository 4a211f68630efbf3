"""Model configurations as data.

`GPTConfig` mirrors LlamaGen's `ModelArgs` (only the fields inference needs plus the
dropouts used by training). Named configs follow LlamaGen's `GPT_B` ... `GPT_3B`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any


def check_positive(owner: str, **values: Any) -> None:
    """ValueError naming the first field that is not a positive int (bools are not sizes)."""
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{owner} {name} must be a positive integer, got {value!r}")


def find_multiple(n: int, k: int) -> int:
    """Smallest multiple of k that is >= n (LlamaGen rounds the SwiGLU width up)."""
    return n if n % k == 0 else n + k - (n % k)


@dataclass(frozen=True)
class GPTConfig:
    """LlamaGen GPT hyper-parameters.

    `block_size` is the number of image tokens (a perfect square: the token grid is
    sqrt(block_size) on a side). `cls_token_num` is the number of condition positions
    (1 for c2i, 120 for t2i). The null class for classifier-free guidance is `num_classes`.
    """

    dim: int = 4096
    n_layer: int = 32
    n_head: int = 32
    n_kv_head: int | None = None
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    initializer_range: float = 0.02
    token_dropout_p: float = 0.1
    resid_dropout_p: float = 0.1
    ffn_dropout_p: float = 0.1
    num_classes: int = 1000
    caption_dim: int = 2048
    class_dropout_prob: float = 0.1
    model_type: str = "c2i"
    vocab_size: int = 16384
    cls_token_num: int = 1
    block_size: int = 256

    def __post_init__(self) -> None:
        check_positive("GPT", dim=self.dim, n_layer=self.n_layer, n_head=self.n_head, kv_heads=self.kv_heads,
                       multiple_of=self.multiple_of, num_classes=self.num_classes, caption_dim=self.caption_dim,
                       vocab_size=self.vocab_size, cls_token_num=self.cls_token_num, block_size=self.block_size)
        if not (self.norm_eps > 0 and self.rope_base > 0):
            raise ValueError(f"GPT norm_eps and rope_base must be > 0, got {self.norm_eps} and {self.rope_base}")
        if self.n_head % self.kv_heads:
            raise ValueError(f"GPT n_head {self.n_head} is not a multiple of n_kv_head {self.kv_heads}")
        if self.model_type not in ("c2i", "t2i"):
            raise ValueError(f"model_type must be 'c2i' or 't2i', got {self.model_type!r}")
        g = int(round(self.block_size**0.5))
        if g * g != self.block_size:
            raise ValueError(f"block_size must be a perfect square, got {self.block_size}")
        if self.dim % self.n_head:
            raise ValueError(f"dim {self.dim} is not divisible by n_head {self.n_head}")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head if self.n_kv_head is not None else self.n_head

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_head

    @property
    def grid_size(self) -> int:
        return int(round(self.block_size**0.5))

    @property
    def ffn_hidden(self) -> int:
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return find_multiple(hidden, self.multiple_of)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "GPTConfig":
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})

    def with_(self, **changes: Any) -> "GPTConfig":
        return replace(self, **changes)


# Named LlamaGen configs (layers, heads, width). Parameter counts for c2i: B 110.9M,
# L 342.9M, XL 774.7M, XXL 1411.0M, 3B 3096.7M (GPT-3B has head_dim 100).
GPT_SHAPES: dict[str, dict[str, int]] = {
    "GPT-B": dict(n_layer=12, n_head=12, dim=768),
    "GPT-L": dict(n_layer=24, n_head=16, dim=1024),
    "GPT-XL": dict(n_layer=36, n_head=20, dim=1280),
    "GPT-XXL": dict(n_layer=48, n_head=24, dim=1536),
    "GPT-XXXL": dict(n_layer=48, n_head=40, dim=2560),
    "GPT-1B": dict(n_layer=22, n_head=32, dim=2048),
    "GPT-3B": dict(n_layer=24, n_head=32, dim=3200),
    "GPT-7B": dict(n_layer=32, n_head=32, dim=4096),
    # Small configs for tests and the embedded demo (not LlamaGen releases).
    "GPT-tiny": dict(n_layer=2, n_head=2, dim=64, multiple_of=32),
    "GPT-demo": dict(n_layer=8, n_head=8, dim=256, multiple_of=64),
}


def check_gpt_model(name: str) -> None:
    """Refuse a name that is not one of `GPT_SHAPES`, naming the closest one."""
    from runtime.utils.errors import UserError, did_you_mean

    if name not in GPT_SHAPES:
        raise UserError(f"unknown GPT model {name!r}{did_you_mean(name, GPT_SHAPES)}; choose one of {', '.join(GPT_SHAPES)}")


def gpt_config(name: str, *, model_type: str = "c2i", image_size: int = 256,
               downsample: int = 16, **overrides: Any) -> GPTConfig:
    """Build a named GPT config for an image size (block_size = (image_size/downsample)^2)."""
    from runtime.utils.errors import UserError

    check_gpt_model(name)
    if image_size % downsample:
        raise UserError(f"--image-size {image_size} is not a multiple of the VQ downsample {downsample}")
    base: dict[str, Any] = dict(GPT_SHAPES[name])
    base.update(model_type=model_type, block_size=(image_size // downsample) ** 2,
                cls_token_num=120 if model_type == "t2i" else 1)
    base.update(overrides)
    return GPTConfig(**base)


@dataclass(frozen=True)
class VQConfig:
    """VQ tokenizer hyper-parameters (LlamaGen `VQ-16` defaults)."""

    codebook_size: int = 16384
    codebook_embed_dim: int = 8
    codebook_l2_norm: bool = True
    codebook_show_usage: bool = True
    commit_loss_beta: float = 0.25
    entropy_loss_ratio: float = 0.0
    encoder_ch_mult: tuple[int, ...] = (1, 1, 2, 2, 4)
    decoder_ch_mult: tuple[int, ...] = (1, 1, 2, 2, 4)
    z_channels: int = 256
    ch: int = 128
    num_res_blocks: int = 2
    norm_groups: int = 32
    dropout_p: float = 0.0

    def __post_init__(self) -> None:
        check_positive("VQ", codebook_size=self.codebook_size, codebook_embed_dim=self.codebook_embed_dim,
                       z_channels=self.z_channels, ch=self.ch, num_res_blocks=self.num_res_blocks,
                       norm_groups=self.norm_groups)
        if not self.encoder_ch_mult or not self.decoder_ch_mult:
            raise ValueError("VQ encoder_ch_mult and decoder_ch_mult must be non-empty")

    @property
    def downsample(self) -> int:
        return 2 ** (len(self.encoder_ch_mult) - 1)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["encoder_ch_mult"] = list(self.encoder_ch_mult)
        d["decoder_ch_mult"] = list(self.decoder_ch_mult)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "VQConfig":
        known = {f for f in cls.__dataclass_fields__}
        kw = {k: v for k, v in data.items() if k in known}
        for key in ("encoder_ch_mult", "decoder_ch_mult"):
            if key in kw:
                kw[key] = tuple(kw[key])
        return cls(**kw)


VQ_CONFIGS: dict[str, VQConfig] = {
    "VQ-16": VQConfig(),
    "VQ-8": VQConfig(encoder_ch_mult=(1, 2, 2, 4), decoder_ch_mult=(1, 2, 2, 4)),
}


CONDITION_CONTEXTS = ("all", "valid")


@dataclass(frozen=True)
class DrafterConfig:
    """EAGLE/LANTERN drafter hyper-parameters (HF `config.json` field names).

    `cls_token_num` is the *target's* number of condition positions; the drafter's RoPE
    table is offset by `cls_token_num - 1` (EAGLE's one-step shift).
    """

    hidden_size: int = 1280
    intermediate_size: int = 3584
    num_attention_heads: int = 20
    num_key_value_heads: int = 20
    num_hidden_layers: int = 1
    rms_norm_eps: float = 1e-6
    vocab_size: int = 16384
    bias: bool = True
    qkv_bias: bool = False
    rope_base: float = 10000.0
    block_size: int = 256
    cls_token_num: int = 120
    # "llamagen-2d": LlamaGen's 2-D table offset by cls_token_num - 1; "1d": plain positions up to
    # max_position (targets with 1-D positions: Chameleon)
    rope: str = "llamagen-2d"
    max_position: int = 4096
    # which condition positions the drafter attends to, as it was trained: "all" (padded caption
    # positions included, with token id 0: LANTERN's training and inference, and `runtime train
    # drafter`'s) or "valid" (padded positions masked)
    condition_context: str = "all"

    def __post_init__(self) -> None:
        if self.rope not in ("llamagen-2d", "1d"):
            raise ValueError(f"drafter rope must be 'llamagen-2d' or '1d', got {self.rope!r}")
        if self.condition_context not in CONDITION_CONTEXTS:
            raise ValueError(f"drafter condition_context must be one of {', '.join(CONDITION_CONTEXTS)}, "
                             f"got {self.condition_context!r}")
        check_positive("drafter", hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                       num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
                       num_hidden_layers=self.num_hidden_layers, vocab_size=self.vocab_size,
                       block_size=self.block_size, cls_token_num=self.cls_token_num)
        if self.hidden_size % self.num_attention_heads or self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"drafter hidden_size {self.hidden_size}, num_attention_heads "
                             f"{self.num_attention_heads} and num_key_value_heads {self.num_key_value_heads} "
                             "must divide one another")
        if not (self.rms_norm_eps > 0 and self.rope_base > 0):
            raise ValueError(f"drafter rms_norm_eps and rope_base must be > 0, got {self.rms_norm_eps} and "
                             f"{self.rope_base}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "DrafterConfig":
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})

    @classmethod
    def for_target(cls, target: GPTConfig, **overrides: Any) -> "DrafterConfig":
        """A drafter as wide as `target`, as LANTERN trains them."""
        base = dict(hidden_size=target.dim, intermediate_size=target.ffn_hidden,
                    num_attention_heads=target.n_head, num_key_value_heads=target.kv_heads,
                    vocab_size=target.vocab_size, rope_base=target.rope_base,
                    block_size=target.block_size, cls_token_num=target.cls_token_num)
        if getattr(target, "model_type", "") == "chameleon":
            base.update(rope="1d", max_position=target.max_position)
        base.update(overrides)
        return cls(**base)
