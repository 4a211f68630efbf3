"""Loading a model for the core: the demo bundle, official LlamaGen checkpoints (c2i, t2i, HF
folders) and Chameleon-family folders, with their drafter and VQ tokenizer, onto a device; and the
workload's classes."""


from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from runtime.utils.errors import UserError

_log = logging.getLogger(__name__)

# Sampling settings of official LlamaGen checkpoints, by model kind: the argparse defaults of
# LlamaGen's sampling scripts (FoundationVision/LlamaGen autoregressive/sample/sample_c2i.py:
# cfg 4.0, top-k 2000; sample_t2i.py: cfg 7.5, top-k 1000; both temperature 1.0, top-p 1.0).
# Applied as the model's recommendation, so a profile or a flag overrides them.
LLAMAGEN_SAMPLING: dict[str, dict[str, Any]] = {
    "c2i": {"cfg": 4.0, "top_k": 2000, "temperature": 1.0, "top_p": 1.0},
    "t2i": {"cfg": 7.5, "top_k": 1000, "temperature": 1.0, "top_p": 1.0},
}

# LlamaGen's demo labels (sample_c2i.py), used when an official c2i model runs without --classes.
LLAMAGEN_DEMO_CLASSES = [207, 360, 387, 974, 88, 979, 417, 279]


LLAMAGEN_SAMPLING_SOURCE = {"c2i": "model default (LlamaGen sample_c2i.py)",
                            "t2i": "model default (LlamaGen sample_t2i.py)"}


@dataclass
class LoadedModel:
    """A target (+ drafter, VQ) ready on the backend's device."""

    name: str
    target: Any
    drafter: Any
    vq: Any
    image_size: int
    class_names: list[str] | None = None
    recommended: dict[str, Any] = field(default_factory=dict)
    bundle: Any = None  # the DemoBundle when the model is the demo (classifier for quality)
    recommended_source: str = "model recommendation"  # how result files name `recommended`
    files: list[Path] = field(default_factory=list)  # every weights file read (result files hash them)
    prompt_encoder: Any = None  # texts -> (prompt ids, masks), for targets conditioned on token prompts
    kind: str | None = None  # the family where the target's type does not name it: "janus", "emu3", "chameleon"

    @property
    def family(self) -> str:
        """What result files and the server's /info call the model: c2i, t2i (LlamaGen and the demo),
        chameleon (Anole, Lumina-mGPT), janus or emu3."""
        return self.kind or self.config.model_type

    @property
    def config(self):
        return self.target.config

    @property
    def params(self) -> int:
        return sum(p.numel() for p in self.target.parameters())

    @property
    def num_classes(self) -> int:
        return self.target.config.num_classes


def load_model(**kwargs: Any) -> LoadedModel:
    """The demo bundle (`model` None/"demo"/a bundle dir) or official checkpoints (`gpt_ckpt`);
    keyword arguments as `_load_model`'s. Logs what was loaded (info level)."""
    loaded = _load_model(**kwargs)
    _log.info("model %s: %s parameters, %d px (%d tokens per image), drafter %s, on %s %s", loaded.name,
              f"{loaded.params:,}", loaded.image_size, loaded.config.block_size,
              "loaded" if loaded.drafter is not None else "none", kwargs["device"],
              str(kwargs["dtype"]).replace("torch.", ""))
    return loaded


def _load_model(*, model: str | None, gpt_model: str | None, gpt_ckpt: str | None, vq_ckpt: str | None,
                image_size: int | None, drafter: str | None, gpt_type: str, trust: bool,
                device: torch.device, dtype: torch.dtype, revision: str | None = None,
                device_free: int | None = None) -> LoadedModel:
    from runtime.models.hub import looks_like_repo_id, resolve_file, resolve_model

    for flag, value in (("--model", model), ("--drafter", drafter), ("--gpt-ckpt", gpt_ckpt), ("--vq-ckpt", vq_ckpt)):
        if value is not None and not str(value).strip():
            raise UserError(f"{flag} is empty; give a path{' or a Hub id' if flag in ('--model', '--drafter') else ''} "
                            f"(or drop {flag})")
    hub_id = model if model is not None and looks_like_repo_id(model) else None
    if model not in (None, "demo") and gpt_ckpt is None:
        model = resolve_model(model, revision)
    elif revision is not None:
        raise UserError("--model-revision applies to a model named by its Hub id (--model OWNER/NAME); drop it")
    gpt_ckpt, vq_ckpt = (resolve_file(p) if p else p for p in (gpt_ckpt, vq_ckpt))
    if drafter:
        drafter = resolve_model(drafter, flag="--drafter") if looks_like_repo_id(drafter) else resolve_file(drafter)
    family = _folder_family(model) if gpt_ckpt is None and model not in (None, "demo") else None
    if family == "chameleon":
        return _load_chameleon(model, vq_ckpt=vq_ckpt, drafter=drafter, image_size=image_size, trust=trust,
                               gpt_model=gpt_model, gpt_type=gpt_type, device=device, dtype=dtype, name=hub_id,
                               device_free=device_free)
    if family in ("janus", "emu3"):
        return _load_hf_family(family, model, vq_ckpt=vq_ckpt, drafter=drafter, image_size=image_size,
                               trust=trust, gpt_model=gpt_model, gpt_type=gpt_type, device=device, dtype=dtype,
                               name=hub_id, device_free=device_free)
    if gpt_ckpt is None:
        given = [flag for flag, value in (("--gpt-model", gpt_model), ("--vq-ckpt", vq_ckpt),
                                          ("--drafter", drafter), ("--trust-checkpoint", trust or None))
                 if value is not None]
        if given or gpt_type != "c2i":
            flag = given[0] if given else "--gpt-type"
            raise UserError(f"{flag} applies to official checkpoints only: add --gpt-ckpt FILE (with --gpt-model "
                            f"and --vq-ckpt), or drop {flag} to run the demo bundle (or --model DIR)")
    if gpt_ckpt is not None:
        if model not in (None, "demo"):
            raise UserError("give either --model or --gpt-ckpt, not both")
        if vq_ckpt is None:
            raise UserError("--gpt-ckpt needs --vq-ckpt (the VQ tokenizer checkpoint, e.g. vq_ds16_c2i.pt)")
        from runtime.models.configs import check_gpt_model
        from runtime.models.loading import build_drafter, build_gpt, build_vq

        if gpt_model is not None:
            check_gpt_model(gpt_model)  # before reading gigabytes of weights

        target = build_gpt(gpt_model, gpt_ckpt, image_size, gpt_type, trust)
        vq = build_vq(vq_ckpt, trust=trust)
        size = int(round(target.config.block_size ** 0.5)) * vq.downsample
        draft = build_drafter(drafter, target.config) if drafter else None
        check_vocab_fits_codebook(target.config.vocab_size, vq.config.codebook_size, f"{gpt_ckpt} and {vq_ckpt}")
        kind = target.config.model_type
        target, draft, vq = _place(target, draft, vq, device, dtype, device_free, gpt_ckpt)
        return LoadedModel(gpt_model or Path(gpt_ckpt).stem, target, draft, vq, size, recommended=dict(LLAMAGEN_SAMPLING[kind]),
                           recommended_source=LLAMAGEN_SAMPLING_SOURCE[kind],
                           files=weight_files(gpt_ckpt, vq_ckpt, drafter))
    from runtime.demo.bundle import load_demo_bundle

    path = None if model in (None, "demo") else model
    if path is not None and Path(path).is_dir() and not (Path(path) / "manifest.json").is_file():
        _not_a_model(Path(path))
    if path is not None and not Path(path).is_dir():
        raise UserError(f"--model {path}: not a directory; give 'demo', a bundle directory from "
                        "'runtime train demo', or official checkpoints with --gpt-ckpt/--vq-ckpt")
    bundle = load_demo_bundle(path, device=device, dtype=dtype)
    if image_size is not None and image_size != bundle.image_size:
        raise UserError(f"--image-size {image_size}: the model bundle generates {bundle.image_size} px images "
                        "(its size is fixed); drop --image-size, which is for --gpt-ckpt checkpoints")
    check_vocab_fits_codebook(bundle.gpt.config.vocab_size, bundle.vq.config.codebook_size,
                              f"model bundle {bundle.path}")
    name = bundle.manifest.get("name", "demo")
    return LoadedModel(name, bundle.gpt, bundle.drafter, bundle.vq, bundle.image_size,
                       bundle.class_names, bundle.recommended, bundle,
                       recommended_source="model bundle recommendation (manifest.json)",
                       files=weight_files(bundle.path))


def _not_a_model(folder: Path) -> None:
    """A --model folder that is neither a prompted model (config.json with a model_type) nor a
    bundle (manifest.json), refused with what it lacks."""
    from runtime.models.chameleon_folder import read_model_config

    config = read_model_config(folder)
    if config is not None:  # it has a config.json, and read_family found no model_type in it
        raise UserError(f"{folder / 'config.json'} names no model_type, and the folder has no manifest.json: not a "
                        "Chameleon, Janus or Emu3 folder nor a bundle (an HF LlamaGen folder goes in --gpt-ckpt); "
                        "re-download the model or give the right flag")
    if not any(folder.iterdir()):
        raise UserError(f"--model {folder}: an empty folder (a damaged download?); give the model's folder, its "
                        "Hub id, or 'demo'")
    raise UserError(f"--model {folder}: neither a model folder (config.json) nor a model bundle (manifest.json); "
                    "give the model's folder, its Hub id, or 'demo'")


def _folder_family(path: str) -> str | None:
    """chameleon / janus / emu3 from a folder's config.json `model_type`; None for anything else
    (a demo bundle, a LlamaGen folder)."""
    from runtime.models.hf_folders import read_family

    return read_family(Path(path)) if Path(path).is_dir() else None


def _refuse_llamagen_flags(folder: str, kind: str, gpt_model: str | None, gpt_type: str) -> None:
    for flag, value in (("--gpt-model", gpt_model), ("--gpt-type", None if gpt_type == "c2i" else gpt_type)):
        if value is not None:
            raise UserError(f"{flag} is for LlamaGen checkpoints; {folder} is a {kind} folder (its config.json "
                            f"defines the model): drop {flag}")


def _prompted_drafter(drafter: str | None, target: Any) -> Any:
    """A drafter folder for a prompted target: LANTERN's Chameleon layout or the runtime's own."""
    if not drafter:
        return None
    from runtime.models.chameleon_drafter import is_lantern_chameleon_drafter, load_chameleon_drafter
    from runtime.models.loading import build_drafter, read_json

    config_path = Path(drafter) / "config.json"
    lantern = config_path.is_file() and is_lantern_chameleon_drafter(read_json(config_path))
    return load_chameleon_drafter(drafter, target) if lantern else build_drafter(drafter, target.config)


def _load_hf_family(family: str, folder: str, *, vq_ckpt: str | None, drafter: str | None, image_size: int | None,
                    trust: bool, gpt_model: str | None, gpt_type: str, device: torch.device, dtype: torch.dtype,
                    name: str | None = None, device_free: int | None = None) -> LoadedModel:
    """A Janus / Emu3 folder in transformers' layout (target, its own VQ, its own tokenizer)."""
    from runtime.models.hf_folders import (
        EMU3_SAMPLING,
        EMU3_SAMPLING_SOURCE,
        JANUS_SAMPLING,
        JANUS_SAMPLING_SOURCE,
        load_emu3_folder,
        load_janus_folder,
    )

    kind = "Janus" if family == "janus" else "Emu3"
    _refuse_llamagen_flags(folder, kind, gpt_model, gpt_type)
    for flag, value in (("--vq-ckpt", vq_ckpt), ("--trust-checkpoint", trust or None)):
        if value is not None:
            raise UserError(f"{flag} does nothing for a {kind} folder (its VQ model and weights are in the folder): "
                            f"drop {flag}")
    load = load_janus_folder if family == "janus" else load_emu3_folder
    target, vq, encoder, files = load(Path(folder), image_size=image_size)
    rows = vq.rows
    draft = _prompted_drafter(drafter, target)
    sampling, source = (JANUS_SAMPLING, JANUS_SAMPLING_SOURCE) if family == "janus" else (EMU3_SAMPLING,
                                                                                          EMU3_SAMPLING_SOURCE)
    target, draft, vq = _place(target, draft, vq, device, dtype, device_free, folder)
    return LoadedModel(name or Path(folder).name, target, draft, vq, rows * vq.downsample, recommended=dict(sampling), recommended_source=source,
                       files=files + weight_files(drafter), prompt_encoder=encoder, kind=family)


def _load_chameleon(folder: str, *, vq_ckpt: str | None, drafter: str | None, image_size: int | None, trust: bool,
                    gpt_model: str | None, gpt_type: str, device: torch.device, dtype: torch.dtype,
                    name: str | None = None, device_free: int | None = None) -> LoadedModel:
    """A Chameleon-family folder (Anole, Lumina-mGPT), with Meta's vqgan.ckpt where the folder has no VQ decoder."""
    from runtime.models.chameleon_folder import (
        ANOLE_SAMPLING,
        ANOLE_SAMPLING_SOURCE,
        LUMINA_SAMPLING,
        LUMINA_SAMPLING_SOURCE,
        load_chameleon_folder,
    )
    _refuse_llamagen_flags(folder, "Chameleon", gpt_model, gpt_type)
    target, vq, encoder, files = load_chameleon_folder(folder, vq_ckpt, trust=trust, image_size=image_size)
    cfg = target.config
    size = ((cfg.row_width - 1) if cfg.row_width else int(round(cfg.block_size ** 0.5))) * vq.downsample
    draft = _prompted_drafter(drafter, target)
    target, draft, vq = _place(target, draft, vq, device, dtype, device_free, folder)
    return LoadedModel(name or Path(folder).name, target, draft, vq, size,
                       recommended=dict(LUMINA_SAMPLING if cfg.row_width else ANOLE_SAMPLING),
                       recommended_source=LUMINA_SAMPLING_SOURCE if cfg.row_width else ANOLE_SAMPLING_SOURCE,
                       files=files + weight_files(drafter), prompt_encoder=encoder)


def _place(target: torch.nn.Module, draft: torch.nn.Module | None, vq: torch.nn.Module, device: torch.device,
           dtype: torch.dtype, device_free: int | None, source: str) -> tuple[Any, Any, Any]:
    """(target, drafter, VQ) on the device, in eval mode: the target and drafter in `dtype`, the VQ
    in its own. Refused first, in one line, where their bytes exceed what the device has free
    (`device_free`, None where unknown: the host was checked when the config was read)."""
    if device_free is not None:
        need = sum(t.numel() for m in (target, draft) if m is not None
                   for t in (*m.parameters(), *m.buffers()) if t.is_floating_point()) * dtype.itemsize
        need += sum(t.numel() * t.element_size() for t in (*vq.parameters(), *vq.buffers()))
        if need > device_free:
            raise UserError(f"{source}: the model takes about {need / 2**30:,.1f} GiB in "
                            f"{str(dtype).replace('torch.', '')} and {device} has {device_free / 2**30:,.1f} GiB "
                            "free; free the device (other processes), use a lower-precision --dtype, or a larger "
                            "device")
    return (target.to(device, dtype).eval(), draft.to(device, dtype).eval() if draft is not None else None,
            vq.to(device).eval())


def weight_files(*paths: str | Path | None) -> list[Path]:
    """The files behind checkpoint paths: a file itself, a folder's files (sorted), None skipped."""
    out: list[Path] = []
    for path in paths:
        if path is None:
            continue
        path = Path(path)
        out.extend(sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path])
    return out


def check_vocab_fits_codebook(vocab: int, codebook: int, source: str) -> None:
    """A GPT token indexes the VQ codebook: a vocabulary larger than the codebook would decode
    out of range."""
    if vocab > codebook:
        raise UserError(f"{source}: the GPT has {vocab} tokens but the VQ codebook has {codebook} entries; "
                        "use the VQ tokenizer the GPT was trained with")


def parse_classes(text: str | None, num_images: int | None, loaded: LoadedModel) -> list[int]:
    """Class of each image: `--classes 0,3,7` cycled to `--num-images`, else every class once."""
    n_classes = loaded.num_classes
    if text is not None:
        try:
            classes = [int(c) for c in text.split(",") if c.strip() != ""]
        except ValueError:
            raise UserError(f"--classes {text!r}: expected comma-separated class ids like 0,3,7") from None
        if not classes:
            raise UserError("--classes is empty; give class ids like 0,3,7")
        bad = [c for c in classes if not 0 <= c < n_classes]
        if bad:
            raise UserError(f"--classes: class {bad[0]} is out of range; this model has classes 0..{n_classes - 1}")
    elif loaded.class_names is not None:
        classes = list(range(n_classes))
    else:
        classes = [c for c in LLAMAGEN_DEMO_CLASSES if c < n_classes] or [0]
    if num_images is None:
        num_images = len(classes)
    if num_images < 1:
        raise UserError(f"--num-images must be >= 1, got {num_images}")
    return [classes[i % len(classes)] for i in range(num_images)]


def load_target(*, family: str | None, model: str | None, gpt_model: str | None, gpt_ckpt: str | None,
                image_size: int | None, trust: bool) -> tuple[Any, Any]:
    """A target alone, on the host in its file's dtype, without its VQ decoder or a drafter (what
    training a drafter for it needs): (target, prompt encoder) for a prompted folder of `family`
    ("chameleon", "janus", "emu3"), (target, None) for a LlamaGen checkpoint (`gpt_ckpt`)."""
    if family is None:
        from runtime.models.loading import build_gpt

        return build_gpt(gpt_model, gpt_ckpt, image_size, "c2i", trust), None
    if family == "chameleon":
        from runtime.models.chameleon_folder import load_chameleon_folder

        target, _, encoder, _ = load_chameleon_folder(model, None, trust=trust, with_vq=False)
        return target, encoder
    from runtime.models.hf_folders import load_emu3_folder, load_janus_folder

    load = load_janus_folder if family == "janus" else load_emu3_folder
    target, _, encoder, _ = load(Path(str(model)), image_size=image_size, with_vq=False)
    return target, encoder
