"""The library face: `ImageGenerator`, one object that opens a model on a device with its settings
resolved once, and generates images from Python; `runtime run`, `runtime sample` and `runtime
serve` open their model through it.

    from runtime import ImageGenerator
    with ImageGenerator() as g:                  # the embedded demo, LANTERN++ sampling
        out = g.generate(classes=[0, 3], seed=0)
    out.images[0].save("0.png"); out.tau; out.command

Construction takes what the CLI takes as keyword arguments (the model options, `device`,
`profile`, `dtype`, `graph`, `method`, and every method and sampling option of
`runtime.config.method_options` by its name), checked by the same declarations with the same
one-line `UserError`s. A call takes the workload and returns data; it never prints or exits.
"""

from __future__ import annotations

import gc
import shlex
import threading
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from runtime.config.method_options import OPTIONS_BY_NAME
from runtime.generation import workload as wl
from runtime.generation.source import ModelSource
from runtime.utils.errors import UserError, did_you_mean

if TYPE_CHECKING:
    import numpy as np
    import torch
    from PIL import Image

    from runtime.core import MethodSpec, SlotDecoder
    from runtime.generation.pipeline import RunOutput


@dataclass
class GeneratedImage:
    """One image as `ImageGenerator.stream` yields it, as soon as it is done."""

    index: int  # its place in the workload (0..n-1)
    image: Image.Image
    tokens: torch.Tensor  # (tokens_per_image,) long, on the host
    seed: int  # its own random stream: derive_seed(run seed, index)
    label: Any  # its class id or prompt text
    target_forwards: int
    accepted_tokens: int  # tau of this image = tokens / target_forwards

    @property
    def tau(self) -> float:
        return self.tokens.numel() / max(self.target_forwards, 1)


@dataclass
class Generation:
    """What `ImageGenerator.generate` made: images and tokens in workload order, with what a result
    file records of them."""

    images: list[Image.Image]
    tokens: torch.Tensor  # (n, tokens_per_image) long, on the host
    seeds: list[int]  # image i's seed: derive_seed(seed, index i)
    labels: list[Any]  # each image's class id or prompt text
    method: str
    batch_size: int
    stats: dict[str, Any]  # mean_accepted_length (tau), target_forwards, tokens, per_depth_acceptance, step_tvd, ...
    timings: dict[str, Any]  # total_s, images_per_s, phases {name: {seconds, count}} (device-synchronised)
    settings: dict[str, Any]  # the resolved method and sampling settings, as result files record them
    sources: dict[str, str]  # where each setting came from: "flag (--cfg)", "profile cpu", "default", ...
    command: str  # the `runtime run` line that makes the same tokens
    bound_warning: str | None = None  # the measured step TVD clearly past the rule's stated bound
    arrays: np.ndarray | None = field(default=None, repr=False)  # (n, H, W, 3) uint8, the images' pixels
    indices: list[int] = field(default_factory=list)  # each image's index in the whole workload
    image_seconds: list[float] = field(default_factory=list, repr=False)

    @property
    def tau(self) -> float:
        """Mean tokens committed per target forward."""
        return float(self.stats["mean_accepted_length"])


def _option_value(name: str, value: Any) -> Any:
    """A method option given as a keyword, checked for its declared type as the CLI's parser does
    (an int is a float; a bool is neither); its range is checked where the settings are resolved."""
    option = OPTIONS_BY_NAME[name]
    kind, flag = option.kind, option.cli_flag.split("/")[0]
    if value is None:
        return None
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    else:
        ok = isinstance(value, kind) and not isinstance(value, bool)
    if not ok:
        noun = {bool: "true or false", float: "a valid float", int: "a valid integer", str: "a string"}[kind]
        raise UserError(f"Invalid value for '{flag}' ({name}=): {value!r} is not {noun}.")
    return value


def _graph_from_env() -> bool | None:
    """LANTERN_GRAPH read as the CLI's --graph / --no-graph reads it (click's boolean); None where unset."""
    import os

    import click

    text = os.environ.get("LANTERN_GRAPH", "").strip()
    if not text:
        return None
    try:
        return bool(click.BOOL.convert(text, None, None))
    except click.BadParameter:
        raise UserError(f"LANTERN_GRAPH={text!r} is not a boolean; set it to 1 or 0 (or unset it)") from None


class ImageGenerator:
    """A model opened on a device, its settings resolved once, generating images.

    `model`: None or "demo" (the embedded demo), a Hub id or model folder (`revision`), or use
    `gpt_model` / `gpt_ckpt` / `vq_ckpt` / `image_size` for official LlamaGen files; `drafter`: a
    LANTERN drafter folder or Hub id. `device` ("auto", "cpu", "cuda", "hpu"), `profile` (a
    profile name or TOML file), `dtype`, `graph` (None: LANTERN_GRAPH where set, else the profile's), `method` (a name or
    "auto": the profile's fastest lossless method at each call's occupancy), `batch_size`
    (default: the profile's), `attention`, `t5_path` (LlamaGen t2i), `prompt_length` (the
    Chameleon family), and every method and sampling option by name (`temperature=`, `cfg=`,
    `lantern_lambda=`, `tree=`, ...; unset: the profile's, then the model's, then the code's).

    One `ImageGenerator` is used by one thread at a time (a second thread calling while one is
    busy gets a RuntimeError); several generators in one process are fine. `close()` (or a `with`
    block) releases the model, decoders and compiled steps.
    """

    def __init__(self, model: str | None = None, *, revision: str | None = None, gpt_model: str | None = None,
                 gpt_ckpt: str | None = None, gpt_type: str = "c2i", vq_ckpt: str | None = None,
                 image_size: int | None = None, drafter: str | None = None, trust_checkpoint: bool = False,
                 device: str = "auto", profile: str | None = None, dtype: str | None = None,
                 graph: bool | None = None, method: str | None = None, attention: str = "auto",
                 batch_size: int | None = None, t5_path: str | None = None, prompt_length: int | None = None,
                 device_index: int | None = None, **options: Any) -> None:
        source = ModelSource(model=model, model_revision=revision, gpt_model=gpt_model, gpt_ckpt=gpt_ckpt,
                             gpt_type=gpt_type, vq_ckpt=vq_ckpt, image_size=image_size, drafter=drafter,
                             trust_checkpoint=trust_checkpoint)
        self._open(source, options, device=device, profile=profile, dtype=dtype, graph=graph, method=method,
                   attention=attention, batch_size=batch_size, t5_path=t5_path, prompt_length=prompt_length,
                   device_index=device_index)

    @classmethod
    def from_source(cls, source: ModelSource, options: dict[str, Any], **settings: Any) -> "ImageGenerator":
        """The commands' door: the model options as one `ModelSource`, the method options as a
        dict (None = not given), the other settings as `__init__`'s keywords."""
        self = cls.__new__(cls)
        self._open(source, options, **settings)
        return self

    def _open(self, source: ModelSource, options: dict[str, Any], *, device: str = "auto",
              profile: str | None = None, dtype: str | None = None, graph: bool | None = None,
              method: str | None = None, attention: str = "auto", batch_size: int | None = None,
              t5_path: str | None = None, prompt_length: int | None = None, device_index: int | None = None) -> None:
        from runtime.generation.device_setup import open_model
        from runtime.generation.settings import AUTO, auto_method
        from runtime.models.layers import check_attention_kernel

        self._lock = threading.Lock()
        self._closed = False
        graph = _graph_from_env() if graph is None else graph
        unknown = [k for k in options if k not in OPTIONS_BY_NAME]
        if unknown:
            raise UserError(f"ImageGenerator() got an unknown option {unknown[0]!r}"
                            f"{did_you_mean(unknown[0], OPTIONS_BY_NAME)}; the options are runtime run's flags "
                            "with underscores (temperature=, cfg=, lantern_lambda=, tree=, ...)")
        self.flags = {name: _option_value(name, options.get(name)) for name in OPTIONS_BY_NAME}
        check_attention_kernel(attention)  # before any work
        self.attention, self.source, self.method = attention, source, method
        self._given = {"device": device, "profile": profile, "dtype": dtype, "graph": graph, "t5_path": t5_path,
                       "prompt_length": prompt_length}
        self.backend, self.profile, self.loaded = open_model(source, device, profile, graph, dtype, index=device_index)
        self.default_batch = wl.batch_size(batch_size, self.profile)
        self.auto = method == AUTO
        import torch

        target = self.loaded.target
        self.memory_bound = isinstance(target, torch.nn.Module) and self.backend.memory_bound(target)
        self._spec = None if self.auto else self._resolve(method)
        if self.auto:
            # a profile without [auto], relaxation flags
            auto_method(self.profile, self.default_batch, self.flags, self.memory_bound)
        self.prompt_length = wl.resolve_prompt_length(prompt_length, self.loaded.config.model_type)
        wl.check_t5_path(self.loaded, t5_path)
        self._t5_path, self._captions = t5_path, None
        self._decoders: dict[tuple[Any, ...], SlotDecoder] = {}

    def _resolve(self, method: str | None, lossless: bool = False) -> MethodSpec:
        from runtime.generation.settings import resolve_spec

        return resolve_spec(method, self.flags, self.profile, self.loaded.recommended, lossless=lossless)

    # -- settings ---------------------------------------------------------------------------

    def spec_for(self, occupancy: int) -> MethodSpec:
        """The resolved method at `occupancy` images decoding together (it differs only for
        method "auto", whose profile table names a method per occupancy)."""
        from runtime.generation.settings import auto_method

        if self._spec is not None:
            return self._spec
        return self._resolve(auto_method(self.profile, occupancy, self.flags, self.memory_bound), lossless=True)

    @property
    def auto_table(self) -> Any:
        """Method "auto": the profile's [auto] table for this model (`AutoSettings.for_model`)."""
        return self.profile.auto.for_model(self.memory_bound)

    @property
    def captions(self) -> Any:
        """LlamaGen t2i: the T5 encoder of --t5-path, opened on first use (None where not given)."""
        if self._captions is None and self._t5_path is not None:
            self._captions = wl.caption_encoder(self.loaded, self.backend, self._t5_path)
        return self._captions

    def auto_specs(self) -> dict[str, MethodSpec]:
        """Method "auto": every method the profile's [auto] table names, resolved lossless (the
        server keeps a decoder of each and picks by occupancy), in the table's order."""
        from runtime.generation.settings import resolve_spec

        methods = self.auto_table.methods
        return {m: resolve_spec(m, self.flags, self.profile, self.loaded.recommended, run_methods=methods,
                                lossless=True) for m in methods}

    def sources(self, spec: MethodSpec, occupancy: int) -> dict[str, str]:
        """Where each of `spec`'s settings came from (flag, profile, model, default)."""
        from runtime.generation.settings import sampling_sources

        sources = sampling_sources(self.flags, self.profile, self.loaded, spec)
        if self.auto:
            table = "[auto] memory_bound" if self.auto_table is not self.profile.auto else "[auto]"
            sources["method"] = f"--method auto: profile {self.profile.name} {table} at occupancy {occupancy}"
        return sources

    def decoder(self, spec: MethodSpec, batch: int) -> SlotDecoder:
        """The decoder of `spec` at `batch` slots, built once and kept (its captured steps too)."""
        from runtime.generation.pipeline import make_decoder

        key = (repr(spec), batch, int(self.loaded.config.cls_token_num))
        if key not in self._decoders:
            self._decoders[key] = make_decoder(self.loaded, spec, self.backend, batch_size=batch)
        return self._decoders[key]

    # -- workloads ----------------------------------------------------------------------------

    def workload(self, *, prompts: Sequence[str] | str | None = None, classes: Sequence[int] | str | None = None,
                 num_images: int | None = None, limit: int = wl.IN_MEMORY_IMAGES) -> wl.Workload:
        """The conditions of `num_images` images (default: one per class or prompt): `classes` for a
        class-conditional model (ids, cycled), `prompts` (texts, cycled) for the others."""
        wl.check_num_images(num_images, limit)
        with self._busy():
            return wl.build_workload(self.loaded, self.backend, classes=classes, prompts=prompts,
                                     num_images=num_images, captions=lambda: self.captions,
                                     prompt_length=self.prompt_length)

    def generate(self, prompts: Sequence[str] | str | None = None, *, classes: Sequence[int] | str | None = None,
                 num_images: int | None = None, seed: int = 0, batch_size: int | None = None) -> Generation:
        """Generate `num_images` images (default: one per class or prompt) and decode them; image i
        uses seed derive_seed(`seed`, i), so its tokens do not depend on `batch_size`."""
        work = self.workload(prompts=prompts, classes=classes, num_images=num_images)
        out = self.run(work, seed=seed, batch_size=batch_size)
        if out.bound_warning:
            warnings.warn(out.bound_warning, stacklevel=2)
        return out

    def run(self, work: wl.Workload, *, seed: int = 0, batch_size: int | None = None,
            indices: Sequence[int] | None = None, on_image: Callable[[int, Any], None] | None = None,
            slots: int | None = None) -> Generation:
        """Generate `work` (its images at global `indices`, default 0..n-1: a rank's or a chunk's
        share keeps its seeds), timing the phases; `on_image(j, tokens)` as image j is done.
        `slots`: the decoder's width as given, not narrowed to the work (a chunked run keeps one
        decoder for a last, smaller chunk)."""
        from runtime.core.law import bound_warning
        from runtime.generation.pipeline import run_generation
        from runtime.models.layers import use_attention_kernel

        idx = list(range(len(work))) if indices is None else list(indices)
        batch = slots if slots is not None else self._batch(batch_size, len(idx))
        spec = self.spec_for(batch)
        with self._busy(), use_attention_kernel(self.attention):
            decoder = self.decoder(spec, batch)
            out = run_generation(self.loaded, spec, work.conditions, seed=seed, backend=self.backend, indices=idx,
                                 cond_masks=work.masks, decoder=decoder, on_image=on_image)
        warning = bound_warning(spec, out.stats["step_tvd"], out.stats["step_tvd_bound"], out.stats["law_steps"])
        return self._generation(out, work, idx, spec, batch, seed, warning)

    def stream(self, prompts: Sequence[str] | str | None = None, *, classes: Sequence[int] | str | None = None,
               num_images: int | None = None, seed: int = 0, batch_size: int | None = None,
               progress: Callable[[int, int], None] | None = None) -> Iterator[GeneratedImage]:
        """Yield each image as soon as it is done (the order images finish in, not necessarily
        the workload's), decoded to pixels; `progress(done, total)` after each. The same tokens
        as `generate` with the same arguments. Run the iterator to its end (or close it) before
        the next call."""
        from runtime.core.generate import workload_items
        from runtime.core.rng import derive_seed
        from runtime.generation.pipeline import decode_tokens, out_of_memory_as_user_error
        from runtime.models.layers import use_attention_kernel
        from PIL import Image

        work = self.workload(prompts=prompts, classes=classes, num_images=num_images)
        n = len(work)
        batch = self._batch(batch_size, n)
        spec = self.spec_for(batch)
        seeds = [derive_seed(seed, i) for i in range(n)]
        with self._busy(), use_attention_kernel(self.attention):
            decoder = self.decoder(spec, batch)
            items = workload_items(work.conditions, work.masks, seeds, self.backend.device)
            finished = decoder.iter_finished(items)
            for count in range(1, n + 1):
                with out_of_memory_as_user_error(decoder, self.backend):
                    done = next(finished)
                tokens = done.tokens.detach().to("cpu").long()
                pixels = decode_tokens(self.loaded.vq, tokens[None])[0]
                if progress is not None:
                    progress(count, n)
                yield GeneratedImage(done.key, Image.fromarray(pixels), tokens, seeds[done.key],
                                     work.labels[done.key], done.stats.target_forwards, done.stats.accepted_tokens)
            for _ in finished:  # the loop's own end: frees the slots
                pass

    # -- lifetime -----------------------------------------------------------------------------

    def close(self) -> None:
        """Release the model, its decoders and their captured steps (device memory returns to the
        device's allocator); the generator cannot be used after. Idempotent."""
        if self._closed:
            return
        with self._busy():
            for module in (self.loaded.target, self.loaded.drafter):
                if module is not None:
                    self.backend.release_inference(module)
            self._decoders.clear()
            self.loaded = None  # type: ignore[assignment]
            self._captions = None
            self._spec = None
            self._closed = True
        gc.collect()
        self.backend.free_memory()  # CUDA: hands the allocator's cached blocks back

    def __enter__(self) -> "ImageGenerator":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        if self._closed:
            return "ImageGenerator(closed)"
        return (f"ImageGenerator(model={self.loaded.name!r}, method={self.method or self.spec_for(1).method!r}, "
                f"device={self.backend.name!r})")

    # -- inside -------------------------------------------------------------------------------

    def _batch(self, given: int | None, images: int) -> int:
        """Images decoded together: the call's or the generator's batch size, no wider than the work."""
        batch = wl.batch_size(given, self.profile) if given is not None else self.default_batch
        return min(batch, max(images, 1))

    @contextmanager
    def _busy(self) -> Iterator[None]:
        """Hold the generator for one call (or one stream, until it ends)."""
        if self._closed:
            raise UserError("this ImageGenerator is closed; make a new one")
        if not self._lock.acquire(blocking=False):
            raise RuntimeError("this ImageGenerator is in use by another thread (or an unfinished stream); "
                               "one generator serves one thread at a time: give each thread its own")
        try:
            yield
        finally:
            self._lock.release()

    def _generation(self, out: RunOutput, work: wl.Workload, idx: list[int], spec: MethodSpec, batch: int,
                    seed: int, warning: str | None) -> Generation:
        from PIL import Image

        timings = {"total_s": out.total_s, "images_per_s": len(idx) / out.total_s if out.total_s > 0 else None,
                   "phases": out.phases}
        return Generation(
            images=[Image.fromarray(a) for a in out.images], tokens=out.tokens, seeds=list(out.seeds),
            labels=list(work.labels), method=spec.method, batch_size=batch, stats=dict(out.stats), timings=timings,
            settings=spec.describe(), sources=self.sources(spec, batch),
            command=self.command_line(spec, work.labels, seed, batch), bound_warning=warning, arrays=out.images,
            indices=idx, image_seconds=out.image_seconds)

    def command_line(self, spec: MethodSpec, labels: Sequence[Any], seed: int, batch: int,
                     prompts_file: str = "prompts.txt") -> str:
        """The `runtime run` line that makes the same tokens: the model and device as given, the
        resolved method pinned by `spec.cli_args()` (a tree file as given), the workload (prompts:
        written one per line to `prompts_file`)."""
        s, g = self.source, self._given
        pairs: list[tuple[str, Any]] = [
            ("--model", s.model), ("--model-revision", s.model_revision), ("--gpt-model", s.gpt_model),
            ("--gpt-ckpt", s.gpt_ckpt), ("--gpt-type", s.gpt_type if s.gpt_type != "c2i" else None),
            ("--vq-ckpt", s.vq_ckpt), ("--image-size", s.image_size), ("--drafter", s.drafter),
            ("--device", g["device"] if g["device"] != "auto" else None), ("--profile-name", g["profile"]),
            ("--dtype", g["dtype"]), ("--attention", self.attention if self.attention != "auto" else None),
            ("--t5-path", g["t5_path"]), ("--prompt-length", g["prompt_length"]),
            ("--tree", self.flags["tree"] if spec.tree_is_file else None)]
        parts = ["runtime", "run", *(word for flag, value in pairs if value is not None for word in (flag, str(value)))]
        parts += ["--trust-checkpoint"] * bool(s.trust_checkpoint)
        parts += [] if g["graph"] is None else ["--graph" if g["graph"] else "--no-graph"]
        parts += spec.cli_args()
        if labels and isinstance(labels[0], str):
            parts += ["--prompts", prompts_file, "--num-images", str(len(labels))]
        else:
            parts += ["--classes", ",".join(str(c) for c in labels)]
        return shlex.join(parts + ["--seed", str(seed), "--batch-size", str(batch)])
