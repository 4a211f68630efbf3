"""What `runtime run` and `runtime bench` share: load a model, resolve settings, generate, decode.

Settings precedence (highest first): command-line flag, hardware profile, the model's
recommended settings (the demo bundle's manifest; for official LlamaGen checkpoints the
defaults of LlamaGen's own sampling scripts, by model kind), the code default.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from runtime.core import Decoder, MethodSpec, SamplingParams, generate, neighbours_for
from runtime.core.tree import load_tree
from runtime.errors import UserError
from runtime.method_options import FLAG_METHODS, OPTION_TYPES, SAMPLING_KEYS

_log = logging.getLogger(__name__)

# LlamaGen's demo labels (sample_c2i.py), used when an official c2i model runs without --classes.
LLAMAGEN_DEMO_CLASSES = [207, 360, 387, 974, 88, 979, 417, 279]

# Sampling settings of official LlamaGen checkpoints, by model kind: the argparse defaults of
# LlamaGen's sampling scripts (FoundationVision/LlamaGen autoregressive/sample/sample_c2i.py:
# cfg 4.0, top-k 2000; sample_t2i.py: cfg 7.5, top-k 1000; both temperature 1.0, top-p 1.0).
# Applied as the model's recommendation, so a profile or a flag overrides them.
LLAMAGEN_SAMPLING: dict[str, dict[str, Any]] = {
    "c2i": {"cfg": 4.0, "top_k": 2000, "temperature": 1.0, "top_p": 1.0},
    "t2i": {"cfg": 7.5, "top_k": 1000, "temperature": 1.0, "top_p": 1.0},
}
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
                device: torch.device, dtype: torch.dtype) -> LoadedModel:
    if gpt_ckpt is None and model not in (None, "demo") and _is_chameleon_folder(model):
        return _load_chameleon(model, vq_ckpt=vq_ckpt, drafter=drafter, image_size=image_size, trust=trust,
                               gpt_model=gpt_model, gpt_type=gpt_type, device=device, dtype=dtype)
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
        return LoadedModel(gpt_model or Path(gpt_ckpt).stem, target.to(device, dtype).eval(),
                           draft.to(device, dtype).eval() if draft is not None else None,
                           vq.to(device).eval(), size, recommended=dict(LLAMAGEN_SAMPLING[kind]),
                           recommended_source=LLAMAGEN_SAMPLING_SOURCE[kind],
                           files=weight_files(gpt_ckpt, vq_ckpt, drafter))
    from runtime.demo.bundle import load_demo_bundle

    path = None if model in (None, "demo") else model
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


def _is_chameleon_folder(path: str) -> bool:
    from runtime.models.chameleon_folder import read_config

    return Path(path).is_dir() and read_config(Path(path)) is not None


def _load_chameleon(folder: str, *, vq_ckpt: str | None, drafter: str | None, image_size: int | None, trust: bool,
                    gpt_model: str | None, gpt_type: str, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    """A Chameleon-family folder (Anole, Lumina-mGPT), with Meta's vqgan.ckpt where the folder has no VQ decoder."""
    from runtime.models.chameleon_folder import (ANOLE_SAMPLING, ANOLE_SAMPLING_SOURCE, LUMINA_SAMPLING,
                                                 LUMINA_SAMPLING_SOURCE, load_chameleon_folder)
    from runtime.models.loading import build_drafter

    for flag, value in (("--gpt-model", gpt_model), ("--gpt-type", None if gpt_type == "c2i" else gpt_type)):
        if value is not None:
            raise UserError(f"{flag} is for LlamaGen checkpoints; {folder} is a Chameleon folder (its config.json "
                            f"defines the model): drop {flag}")
    target, vq, encoder, files = load_chameleon_folder(folder, vq_ckpt, trust=trust, image_size=image_size)
    cfg = target.config
    size = ((cfg.row_width - 1) if cfg.row_width else int(round(cfg.block_size ** 0.5))) * vq.downsample
    draft = None
    if drafter:
        from runtime.models.chameleon_drafter import is_lantern_chameleon_drafter, load_chameleon_drafter
        from runtime.models.loading import read_json

        config_path = Path(drafter) / "config.json"
        lantern = config_path.is_file() and is_lantern_chameleon_drafter(read_json(config_path))
        draft = load_chameleon_drafter(drafter, target) if lantern else build_drafter(drafter, target.config)
    return LoadedModel(Path(folder).name, target.to(device, dtype).eval(),
                       draft.to(device, dtype).eval() if draft is not None else None, vq.to(device).eval(), size,
                       recommended=dict(LUMINA_SAMPLING if cfg.row_width else ANOLE_SAMPLING),
                       recommended_source=LUMINA_SAMPLING_SOURCE if cfg.row_width else ANOLE_SAMPLING_SOURCE,
                       files=files + weight_files(drafter), prompt_encoder=encoder)


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


_SPEC_KEYS = tuple(OPTION_TYPES)  # the MethodSpec fields a flag, profile or model can set


def parse_proactive(text: str | None) -> tuple[int, int] | None:
    """`--proactive K,D` (or KxD; "off"/"none" = no tree) -> (K, D)."""
    if text is None or text.strip().lower() in ("off", "none", ""):
        return None
    parts = text.replace("x", ",").split(",")
    try:
        k, d = (int(p) for p in parts)
    except ValueError:
        raise UserError(f"--proactive {text!r}: expected K,D such as 3,2 (K children per node, D levels)") from None
    return k, d


_FLAG_NAMES = {"greedy": "--greedy/--sample"}


def _layers(flags: dict[str, Any], profile: Any, recommended: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(source kind, settings) from highest to lowest precedence: "flag", "profile", "model"."""
    pinned = profile.method.pinned() if profile is not None else {}
    if profile is not None:
        pinned.setdefault("tree", profile.tree.name)
    return [("flag", flags), ("profile", pinned), ("model", recommended)]


def _source_of(key: str, layers: list[tuple[str, dict[str, Any]]]) -> str:
    """"flag", "profile", "model" or "default": where the setting `key` comes from."""
    return next((kind for kind, values in layers if values.get(key) is not None), "default")


AUTO = "auto"


def auto_method(profile: Any, occupancy: int, flags: dict[str, Any]) -> str:
    """`--method auto`: the lossless method the profile's `[auto]` table names for `occupancy`
    images decoding together (what `runtime tune` measured fastest there)."""
    table = getattr(profile, "auto", None)
    if table is None:
        raise UserError(f"--method auto needs a profile with an [auto] table (profile {getattr(profile, 'name', '?')} "
                        "has none); write one with runtime tune --out profiles/NAME.toml, then --profile-name NAME")
    for key in ("lantern_delta", "lantern_lambda", "relax_rule"):
        if flags.get(key) is not None:
            raise UserError(f"--{key.replace('_', '-')} relaxes acceptance, and --method auto picks lossless methods "
                            "only; drop it or name the method")
    return table.method_for(occupancy)


def resolve_spec(method: str | None, flags: dict[str, Any], profile: Any, recommended: dict[str, Any],
                 run_methods: Sequence[str] | None = None, lossless: bool = False) -> MethodSpec:
    """MethodSpec from flag > profile > model recommendation > default. `flags` None = unset.

    A cfg_interval >= 0 without guidance (cfg <= 1) would do nothing and is refused, and so
    is a method flag that none of `run_methods` (default: this method) reads. `lossless`: the
    relaxation is turned off (what `--method auto` runs). sjd is exact
    unless --lantern-delta or --lantern-lambda is given as a flag (the model's recommended
    relaxation is for its drafter methods).
    """
    layers = _layers(flags, profile, recommended)

    def pick(key: str, default: Any) -> Any:
        return next((values[key] for _, values in layers if values.get(key) is not None), default)

    name = method or (profile.method.name if profile is not None else None) or recommended.get("method") or "lantern++"
    users = set(run_methods or [name])
    for key, readers in FLAG_METHODS.items():
        if flags.get(key) is not None and not users & readers:
            raise UserError(f"--{key.replace('_', '-')} does nothing for --method {'/'.join(sorted(users))} "
                            f"(it is read by {', '.join(sorted(readers))}); drop it")
    base = MethodSpec()
    sampling = SamplingParams(**{k: pick(k, getattr(SamplingParams(), k)) for k in SAMPLING_KEYS})
    values = {k: pick(k, getattr(base, k)) for k in _SPEC_KEYS}
    values["proactive"] = parse_proactive(values["proactive"]) if isinstance(values["proactive"], str) else values["proactive"]
    if name == "sjd":
        given = [k for k in ("lantern_delta", "lantern_lambda") if flags.get(k) is not None]
        if len(given) == 2:
            raise UserError("sjd takes one relaxation: --lantern-delta (additive) or --lantern-lambda "
                            "(multiplicative), not both")
        values["relax"] = {"lantern_delta": "delta", "lantern_lambda": "lambda"}[given[0]] if given else "none"
        if not given and flags.get("relax_rule") is not None:
            raise UserError("--relax-rule does nothing for exact sjd; give --lantern-delta or --lantern-lambda "
                            "too, or drop it")
        if values["accept"] != "grouped":
            for key in ("group_window", "group_gap", "group_dist"):
                if flags.get(key) is not None:
                    raise UserError(f"--{key.replace('_', '-')} does nothing without --accept grouped; drop it")
    if lossless:  # --method auto: the method's exact rule (lantern++ over its tree at lambda 1)
        values.update(lantern_lambda=1.0, lantern_delta=0.0)
        if name == "sjd":
            values["relax"] = "none"
    spec = MethodSpec(method=name, sampling=sampling, **values)
    if sampling.cfg_interval >= 0 and not sampling.uses_cfg:
        where = {"flag": "--cfg-interval", "profile": f"profile {getattr(profile, 'name', '?')} cfg_interval",
                 "model": "the model's recommended cfg_interval"}[_source_of("cfg_interval", layers)]
        raise UserError(f"{where} {sampling.cfg_interval} does nothing without classifier-free guidance "
                        f"(cfg {sampling.cfg:g}); give --cfg above 1 or drop the cfg interval")
    if spec.drafting == "static":
        load_tree(spec.tree_spec)  # unknown tree or malformed file: fail before any work
    _log.debug("method %s resolved: %s", name, spec)
    return spec


def sampling_sources(flags: dict[str, Any], profile: Any, loaded: LoadedModel,
                     spec: MethodSpec | None = None) -> dict[str, str]:
    """Where each sampling setting `resolve_spec` picks comes from, for result files:
    {"cfg": "flag (--cfg)", "top_k": "model default (LlamaGen sample_c2i.py)", ...}; with `spec`,
    also every method setting the method records (tree, lantern_k, lantern_lambda, depth, ...)."""
    layers = _layers(flags, profile, loaded.recommended)

    def label(key: str) -> str:
        kind = _source_of(key, layers)
        if kind == "flag":
            return f"flag ({_FLAG_NAMES.get(key, '--' + key.replace('_', '-'))})"
        if kind == "profile":
            return f"profile {profile.name}"
        return loaded.recommended_source if kind == "model" else "default"

    keys = SAMPLING_KEYS + (tuple(k for k in _SPEC_KEYS if k in spec.describe()) if spec is not None else ())
    return {key: label(key) for key in keys}


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


def decode_tokens(vq: Any, tokens: torch.Tensor, batch: int = 16) -> np.ndarray:
    """(n, block_size) tokens -> uint8 images (n, H, W, 3), as LlamaGen post-processes."""
    device = next(vq.parameters()).device
    images = []
    with torch.no_grad():
        for start in range(0, tokens.size(0), batch):
            x = vq.decode_code(tokens[start:start + batch].to(device))
            images.append(torch.clamp(127.5 * x + 128.0, 0, 255).to(torch.uint8).permute(0, 2, 3, 1).cpu())
    return torch.cat(images).numpy()


def image_grid(images: np.ndarray) -> np.ndarray:
    """(n, H, W, 3) uint8 images -> one near-square uint8 grid, white 2-px gutters."""
    n, h, w, _ = images.shape
    cols = int(np.ceil(np.sqrt(n)))
    rows = int(np.ceil(n / cols))
    canvas = np.full((rows * (h + 2) + 2, cols * (w + 2) + 2, 3), 255, dtype=np.uint8)
    for i in range(n):
        r, c = divmod(i, cols)
        canvas[2 + r * (h + 2): 2 + r * (h + 2) + h, 2 + c * (w + 2): 2 + c * (w + 2) + w] = images[i]
    return canvas


@dataclass
class RunOutput:
    tokens: torch.Tensor
    images: np.ndarray
    stats: dict[str, Any]
    seeds: list[int]
    total_s: float
    phases: dict[str, dict[str, float]]
    # image j's share of total_s (workload order): the time from the previous image's completion
    # to its own, plus an equal share of the batched VQ decode; they sum to total_s
    image_seconds: list[float] = field(default_factory=list)
    image_counts: list[tuple[int, int]] = field(default_factory=list)  # (tokens accepted, target forwards)


def run_generation(loaded: LoadedModel, spec: MethodSpec, conditions: Sequence[int] | torch.Tensor, *,
                   seed: int, backend: Any, indices: Sequence[int] | None = None,
                   cond_masks: torch.Tensor | None = None, decoder: Decoder | None = None,
                   on_image: Callable[[int, torch.Tensor], None] | None = None) -> RunOutput:
    """Generate and decode, timing the phases prefill/draft/verify/accept/decode on the device."""
    if decoder is None:
        decoder = make_decoder(loaded, spec, backend)
    timer = backend.timer()
    decoder.timer = timer
    done_at: dict[int, float] = {}

    def image_done(j: int, tokens: torch.Tensor) -> None:
        done_at[j] = time.perf_counter()  # the loop has just read the device: its work so far is done
        if on_image is not None:
            on_image(j, tokens)

    backend.synchronize()
    start = time.perf_counter()
    with out_of_memory_as_user_error(decoder, backend):
        result = generate(loaded.target, loaded.drafter, spec, conditions, cond_masks=cond_masks, seed=seed,
                          indices=indices, decoder=decoder, on_image=image_done)
    with timer.phase("decode"):
        images = decode_tokens(loaded.vq, result.tokens)
    backend.synchronize()
    end = time.perf_counter()
    decoder.timer = None
    return RunOutput(result.tokens, images, result.stats, result.seeds, end - start, timer.summary(),
                     image_seconds=image_shares(done_at, start, end),
                     image_counts=result.image_counts)


def image_shares(done_at: dict[int, float], start: float, end: float) -> list[float]:
    """Each image's share of a run's wall time, in workload order (keys of `done_at`, 0..n-1):
    the gap since the image completed before it (or since `start`), plus 1/n of the time from
    the last completion to `end` (the batched VQ decode). The shares sum to end - start."""
    if not done_at:
        return []
    order = sorted(done_at, key=done_at.__getitem__)
    tail = (end - max(done_at.values())) / len(order)
    shares: dict[int, float] = {}
    previous = start
    for j in order:
        shares[j] = done_at[j] - previous + tail
        previous = done_at[j]
    return [shares[j] for j in sorted(shares)]


def make_decoder(loaded: LoadedModel, spec: MethodSpec, backend: Any, batch_size: int = 1) -> Decoder:
    if spec.needs_drafter and loaded.drafter is None:
        raise UserError(f"method {spec.method} needs a drafter: pass --drafter DIR (a LANTERN drafter "
                        "folder), use --method sjd (no drafter needed) or --method ar")
    neighbours = neighbours_for(loaded.vq, spec, loaded.config.vocab_size)
    with out_of_memory_as_user_error(None, backend, batch_size):
        return Decoder(loaded.target, loaded.drafter, spec, neighbours=neighbours, backend=backend,
                       batch_size=batch_size)


@contextlib.contextmanager
def out_of_memory_as_user_error(decoder: Decoder | None, backend: Any, batch_size: int | None = None):
    """Turn the device's out-of-memory error into one line naming a batch size that should fit.

    The decode state (KV caches, p/q buffers) grows linearly with the batch; the suggestion is
    the largest batch whose state, counted twice for activations and workspace, fits in the
    memory the device reports free once this attempt's buffers are released.
    """
    try:
        yield
    except torch.OutOfMemoryError:
        b = decoder.batch if decoder is not None else batch_size or 1
        per_image = decoder.state_bytes() / b if decoder is not None else None
        decoder = None
        free = backend.free_memory() if backend is not None else None
        hint = ""
        if per_image and free:
            fits = int(free // (2 * per_image))
            hint = (f"; its decode state takes about {per_image / 2**20:.0f} MiB per image and "
                    f"{free / 2**30:.1f} GiB are free, so --batch-size {max(fits, 1)} should fit")
            if fits < 1:
                hint += " (if even 1 does not: a smaller tree, --dtype bf16, or a larger device)"
        elif b > 1:
            hint = f"; try --batch-size {b // 2}"
        raise UserError(f"batch size {b} does not fit in {backend.name} memory (out of memory){hint}") from None
