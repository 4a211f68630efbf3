"""Builders used by the CLI: a LlamaGen GPT (official checkpoint file or HF folder, at the image
size its name states), a VQ tokenizer and a drafter checked against its target."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from runtime.utils.errors import UserError
from runtime.models.configs import DrafterConfig, GPTConfig, VQ_CONFIGS, gpt_config
from runtime.models.loading.drafter_folder import load_drafter_folder
from runtime.models.loading.files import read_checkpoint
from runtime.models.loading.hf_llamagen import is_hf_folder, load_hf_llamagen_folder
from runtime.models.loading.strict import load_state_dict_strict

if TYPE_CHECKING:  # gpt.py / drafter.py are imported lazily so this module imports on its own
    from runtime.models.drafter import Drafter
    from runtime.models.gpt import Transformer
    from runtime.models.vq import VQModel


# Image sizes LlamaGen released GPT checkpoints for, as the `_<size>` token of their file names
# (c2i_B_256.pt, c2i_XL_384.pt, t2i_XL_stage2_512.pt, ...). The weights do not carry the token
# grid (the RoPE table is not in the state dict), so the name is the only record of it.
OFFICIAL_IMAGE_SIZES: tuple[int, ...] = (256, 384, 512)
_NAMED_SIZE = re.compile(r"(?:^|_)(" + "|".join(map(str, OFFICIAL_IMAGE_SIZES)) + r")(?=_|$)")
TOKEN_PIXELS = 16  # VQ-16: one token per 16x16 pixels


def image_size_from_name(path: str | os.PathLike[str]) -> int | None:
    """The image size a checkpoint's file name states (`c2i_XL_384.pt` -> 384), else None.

    Only a `_<size>` token of 256/384/512 in the stem counts; a name stating two different
    sizes states none.
    """
    sizes = {int(m) for m in _NAMED_SIZE.findall(Path(path).stem)}
    return sizes.pop() if len(sizes) == 1 else None


def check_image_size(image_size: int) -> None:
    """UserError unless `image_size` is a positive multiple of the VQ-16 token size."""
    if image_size <= 0 or image_size % TOKEN_PIXELS:
        raise UserError(f"--image-size {image_size} is not a positive multiple of {TOKEN_PIXELS} (one token per "
                        f"{TOKEN_PIXELS}x{TOKEN_PIXELS} pixels); use the size the checkpoint was trained at, "
                        f"e.g. {', '.join(map(str, OFFICIAL_IMAGE_SIZES))}")


def checkpoint_image_size(ckpt_path: str | os.PathLike[str], image_size: int | None) -> int:
    """The image size to build a checkpoint file at: `image_size` (--image-size) if given, else
    the size its file name states. Refuses a size the name contradicts, and a file whose name
    states none when no size is given (a wrong grid would load but decode garbage)."""
    named = image_size_from_name(ckpt_path)
    if image_size is not None:
        check_image_size(image_size)
        if named is not None and named != image_size:
            raise UserError(f"{ckpt_path}: the file name says {named} px but --image-size is {image_size}; "
                            f"drop --image-size or pass --image-size {named}")
        return image_size
    if named is None:
        raise UserError(f"{ckpt_path}: the file name does not state the image size the checkpoint was trained "
                        f"at; pass --image-size ({', '.join(map(str, OFFICIAL_IMAGE_SIZES))})")
    return named


def build_gpt(model_name: str | None, ckpt_path: str | os.PathLike[str], image_size: int | None = None,
              model_type: str = "c2i", trust: bool = False) -> "Transformer":
    """A LlamaGen GPT in eval mode with weights from an official `.pt`/`.pth`/`.safetensors` file
    or an HF LlamaGen folder (whose config.json then defines the model; `model_name` and
    `image_size`, if given, must agree with it).

    A file's token grid is (size / 16)^2 with size = `image_size` or the size its name states
    (`c2i_L_384.pt`: 24x24); see `checkpoint_image_size`.
    """
    from runtime.models.gpt import Transformer

    ckpt_path = Path(ckpt_path)
    if is_hf_folder(ckpt_path):
        cfg, state = load_hf_llamagen_folder(ckpt_path)
        if model_name is not None:
            named = gpt_config(model_name, model_type=cfg.model_type, image_size=16 * cfg.grid_size)
            if (named.dim, named.n_layer, named.n_head) != (cfg.dim, cfg.n_layer, cfg.n_head):
                raise UserError(f"{ckpt_path}: config.json describes dim {cfg.dim}, {cfg.n_layer} layers, "
                                f"{cfg.n_head} heads, which is not {model_name}; drop --gpt-model or fix it")
        if image_size is not None:
            check_image_size(image_size)
            if (image_size // TOKEN_PIXELS) ** 2 != cfg.block_size:
                raise UserError(f"{ckpt_path}: model was converted for a {cfg.grid_size}x{cfg.grid_size} token "
                                f"grid ({16 * cfg.grid_size}px), not --image-size {image_size}")
    else:
        if model_name is None:
            raise UserError(f"{ckpt_path}: a checkpoint file needs --gpt-model (e.g. GPT-B)")
        state = read_checkpoint(ckpt_path, trust=trust)  # first: a missing file is the first problem
        size = checkpoint_image_size(ckpt_path, image_size)
        cfg = gpt_config(model_name, model_type=model_type, image_size=size)
    model = Transformer(cfg)
    load_state_dict_strict(model, state, str(ckpt_path),
                           hint="check that --gpt-model and the model type (c2i/t2i) match the checkpoint")
    return model.eval()


def build_vq(ckpt_path: str | os.PathLike[str], config_name: str = "VQ-16", trust: bool = False) -> "VQModel":
    """A VQ tokenizer in eval mode with weights from an official VQ checkpoint (`vq_ds16_c2i.pt`)."""
    from runtime.models.vq import VQModel

    if config_name not in VQ_CONFIGS:
        raise UserError(f"unknown VQ model {config_name!r}; choose one of {', '.join(VQ_CONFIGS)}")
    state = read_checkpoint(ckpt_path, trust=trust)
    model = VQModel(VQ_CONFIGS[config_name])
    load_state_dict_strict(model, state, str(ckpt_path),
                           hint=f"check that the file is a {config_name} tokenizer checkpoint")
    return model.eval()


def build_drafter(folder: str | os.PathLike[str], target_cfg: GPTConfig) -> "Drafter":
    """A drafter in eval mode from a drafter folder, checked against its target's config."""
    from runtime.models.drafter import Drafter

    cfg, state = load_drafter_folder(folder)
    check_drafter_matches_target(cfg, target_cfg, str(folder))
    model = Drafter(cfg)
    load_state_dict_strict(model, state, str(folder))
    return model.eval()


def check_drafter_matches_target(cfg: DrafterConfig, target: GPTConfig, source: str) -> None:
    """UserError naming the first field where a drafter cannot serve `target`."""
    one_d = getattr(target, "model_type", "") == "chameleon"
    if one_d != (cfg.rope == "1d"):
        raise UserError(f"{source}: a drafter with {cfg.rope} positions cannot serve a "
                        f"{'Chameleon' if one_d else 'LlamaGen'} target; use the drafter trained for this model")
    pairs = (("hidden_size", cfg.hidden_size, "dim", target.dim),
             ("vocab_size", cfg.vocab_size, "vocab_size", target.vocab_size),
             ("block_size", cfg.block_size, "block_size", target.block_size),
             # a Chameleon prompt's length varies per run: its drafter's positions do not depend on it
             *(() if one_d else (("cls_token_num", cfg.cls_token_num, "cls_token_num", target.cls_token_num),)))
    for d_name, d_val, t_name, t_val in pairs:
        if d_val != t_val:
            raise UserError(f"{source}: drafter {d_name} {d_val} does not match the target model's "
                            f"{t_name} {t_val}; use the drafter trained for this model and image size")
