"""The demo bundle: target GPT, VQ tokenizer, drafter and quality classifier in one folder.

Layout (written by `runtime.models.loading.save_bundle`):
    gpt.safetensors, vq.safetensors, drafter.safetensors, classifier.safetensors
    manifest.json   parts (file + config of each), image_size, downsample, num_classes,
                    class_names, recommended sampling settings, training record and metrics

The target and drafter are stored in fp16 (the bundle ships inside the package and must stay
small); `load_demo_bundle` casts them to the requested run dtype. The VQ and the classifier are
stored and run in fp32, as LlamaGen runs its tokenizer.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Mapping

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from torch import nn

from runtime.assets import default_bundle_path
from runtime.config.validation import Bool, Count, NonNegative, PositiveInt, Text, Unit, describe
from runtime.demo.classifier import ClassifierConfig, DemoClassifier
from runtime.utils.errors import UserError
from runtime.models.configs import DrafterConfig, GPTConfig, VQConfig
from runtime.models.drafter import Drafter
from runtime.models.gpt import Transformer
from runtime.models.loading import load_state_dict_strict, read_bundle, save_bundle
from runtime.models.vq import VQModel

PART_NAMES = ("gpt", "vq", "drafter", "classifier")
# Parts stored in half precision to keep the packaged bundle under its size budget.
HALF_PARTS = ("gpt", "drafter")
STORAGE_DTYPE = torch.float16


@dataclass
class DemoBundle:
    """A loaded demo bundle; every model is in eval mode on the requested device."""

    path: Path
    manifest: dict[str, Any]
    gpt: Transformer
    vq: VQModel
    drafter: Drafter
    classifier: DemoClassifier

    @property
    def class_names(self) -> list[str]:
        return list(self.manifest["class_names"])

    @property
    def num_classes(self) -> int:
        return int(self.manifest["num_classes"])

    @property
    def image_size(self) -> int:
        return int(self.manifest["image_size"])

    @property
    def recommended(self) -> dict[str, Any]:
        """Recommended sampling settings: temperature, top_k, top_p, cfg, method, tree,
        lantern_k, lantern_lambda, lantern_delta."""
        return dict(self.manifest["recommended"])


def storage_state(module: nn.Module, name: str) -> dict[str, torch.Tensor]:
    """The state dict of part `name` as it is stored: fp16 for HALF_PARTS, the VQ's usage ring
    buffer (training statistics only) dropped."""
    state = {k: v.detach().cpu().contiguous() for k, v in module.state_dict().items()}
    if name == "vq":
        state.pop("quantize.codebook_used", None)
    if name in HALF_PARTS:
        state = {k: v.to(STORAGE_DTYPE) if v.is_floating_point() else v for k, v in state.items()}
    return state


def round_trip_(module: nn.Module, name: str) -> nn.Module:
    """Round `module`'s weights through the storage dtype in place, so metrics measured
    afterwards are those of the shipped weights."""
    if name in HALF_PARTS:
        with torch.no_grad():
            for t in list(module.parameters()) + list(module.buffers()):
                if t.is_floating_point():
                    t.copy_(t.to(STORAGE_DTYPE).to(t.dtype))
    return module


def save_demo_bundle(out_dir: str | os.PathLike[str], *, gpt: Transformer, vq: VQModel, drafter: Drafter,
                     classifier: DemoClassifier, manifest: Mapping[str, Any], overwrite: bool = False) -> Path:
    """Write the bundle to `out_dir` atomically: everything goes to `<out_dir>.tmp` first,
    which is renamed into place only when complete. An existing `out_dir` is replaced only
    with `overwrite`."""
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise UserError(f"{out} already exists; choose another --out or pass --force to replace it")
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    parts = {
        "gpt": (storage_state(gpt, "gpt"), gpt.config.to_dict()),
        "vq": (storage_state(vq, "vq"), vq.config.to_dict()),
        "drafter": (storage_state(drafter, "drafter"), drafter.config.to_dict()),
        "classifier": (storage_state(classifier, "classifier"), classifier.config.to_dict()),
    }
    storage = {name: ("float16" if name in HALF_PARTS else "float32") for name in PART_NAMES}
    try:
        save_bundle(tmp, parts, {**dict(manifest), "storage_dtypes": storage})
        if out.exists():
            old = out.with_name(out.name + ".old")
            if old.exists():
                shutil.rmtree(old)
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


class Recommended(BaseModel):
    """``recommended``: the settings a run uses unless a flag or the profile sets them (absent: code
    defaults); bounds as in a profile's ``[method]``."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    method: Text | None = None
    tree: Text | None = None
    temperature: Annotated[float, Field(gt=0, strict=True)] | None = None
    top_k: Count | None = None
    top_p: Annotated[Unit, Field(gt=0)] | None = None
    cfg: NonNegative | None = None
    cfg_interval: Annotated[int, Field(ge=-1, strict=True)] | None = None
    greedy: Bool | None = None
    lantern_k: PositiveInt | None = None
    lantern_lambda: Annotated[float, Field(ge=1, strict=True)] | None = None
    lantern_delta: Unit | None = None


class Manifest(BaseModel):
    """What `load_demo_bundle` reads from ``manifest.json`` besides the parts (other keys are records)."""

    model_config = ConfigDict(extra="allow")
    image_size: PositiveInt
    downsample: PositiveInt
    num_classes: PositiveInt
    class_names: list[Text]
    recommended: Recommended

    @model_validator(mode="after")
    def _one_name_per_class(self) -> Manifest:
        if len(self.class_names) != self.num_classes:
            raise ValueError(f"class_names must hold one name per class ({self.num_classes}), got {len(self.class_names)}")
        return self


def load_demo_bundle(path: str | os.PathLike[str] | None = None, device: str | torch.device = "cpu",
                     dtype: torch.dtype = torch.float32) -> DemoBundle:
    """Load a demo bundle (default: the packaged one).

    The target and drafter are cast to `dtype`; the VQ and classifier stay fp32. All models are
    moved to `device` and put in eval mode.
    """
    folder = Path(path) if path is not None else default_bundle_path()
    if path is None and not (folder / "manifest.json").is_file():
        raise UserError(f"the packaged demo bundle is missing ({folder}); rebuild it with "
                        f"'runtime train demo --out DIR' and pass --model DIR")
    raw = read_bundle(folder)
    try:
        Manifest.model_validate(raw.manifest)
    except ValidationError as err:
        raise UserError(f"{folder / 'manifest.json'}: {describe(err)}; fix the field in manifest.json or rebuild the "
                        "bundle with 'runtime train demo'") from None

    def config(cls: Any, name: str) -> Any:
        try:
            return cls.from_dict(raw.part(name).config)
        except (TypeError, ValueError) as err:
            raise UserError(f"{folder / 'manifest.json'}: parts.{name}.config is invalid ({err}); rebuild the "
                            "bundle with 'runtime train demo'") from None

    gpt_cfg, vq_cfg = config(GPTConfig, "gpt"), config(VQConfig, "vq")
    drafter_cfg, cls_cfg = config(DrafterConfig, "drafter"), config(ClassifierConfig, "classifier")

    def build(module: nn.Module, name: str) -> nn.Module:
        source = str(folder / f"{name}.safetensors")
        return load_state_dict_strict(module, raw.part(name).state, source)

    gpt = build(Transformer(gpt_cfg), "gpt")
    vq = build(VQModel(vq_cfg), "vq")
    drafter = build(Drafter(drafter_cfg), "drafter")
    classifier = build(DemoClassifier(cls_cfg), "classifier")
    return DemoBundle(
        path=folder,
        manifest=raw.manifest,
        gpt=gpt.to(device=device, dtype=dtype).eval(),
        vq=vq.to(device=device, dtype=torch.float32).eval(),
        drafter=drafter.to(device=device, dtype=dtype).eval(),
        classifier=classifier.to(device=device, dtype=torch.float32).eval(),
    )
