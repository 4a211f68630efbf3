"""Real-shape cost projection: the speedup a method would reach on a model's shape on this device.

Trained weights of a large model cannot always be shared or run here, but a decoding iteration
costs the same with any weights of the same shape: every step has fixed shapes by design, so
its time depends on the shape, the tree and the device, never on the values. So the step costs
are measured on the real shape with random weights, and the acceptance length tau comes from a
trained model (a bench result file, or given):

    projected speedup = tau x (AR step time) / (draft + verify + accept time per iteration)

Both inputs are named wherever the number is shown; it is a projection, not a measurement of
the trained model. `ddd` and `--dynamic-depth` draft to a depth decided by the weights, so
their iteration cost with random weights is not theirs; they are refused here.
"""

from __future__ import annotations

from pathlib import Path
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
import torch

from runtime.core import Decoder, MethodSpec
from runtime.utils.errors import UserError, did_you_mean
from runtime.config.method_options import METHOD_TABLE
from runtime.models.configs import GPTConfig, gpt_config
from runtime.tools.step_timing import StepTimes, random_models, random_neighbours, time_interleaved

if TYPE_CHECKING:
    from backends import Backend



@dataclass(frozen=True)
class ModelShape:
    """A model's decoding shape: a LlamaGen config name, image size (token grid) and vocabulary."""

    name: str
    gpt: str
    image_size: int
    vocab_size: int
    description: str
    # the model family's reference sampling settings (a `--tau` projection runs under them unless
    # flags or the profile say otherwise): LlamaGen sample_c2i.py; Lumina-mGPT / Anole scripts
    sampling: tuple[tuple[str, Any], ...] = (("cfg", 4.0), ("top_k", 2000), ("temperature", 1.0), ("top_p", 1.0))
    # changes to the named config (layers, heads, KV heads, FFN multiplier) and the VQ's pixels per token
    overrides: tuple[tuple[str, Any], ...] = ()
    downsample: int = 16

    def config(self) -> GPTConfig:
        return gpt_config(self.gpt, image_size=self.image_size, vocab_size=self.vocab_size,
                          downsample=self.downsample, **dict(self.overrides))


SHAPES: dict[str, ModelShape] = {s.name: s for s in (
    # the packaged demo's target (runtime/assets/demo): 16 layers of width 128 (SwiGLU 384), 4
    # heads, 64 px = 16x16 tokens of a 512-code VQ with 4 px per token
    ModelShape("demo", "GPT-B", 64, 512, "the packaged demo's shape: 16 layers, width 128, 16x16 tokens, 512 codes",
               (("cfg", 3.0), ("top_k", 0), ("temperature", 1.0), ("top_p", 1.0)),
               overrides=(("n_layer", 16), ("n_head", 4), ("dim", 128), ("multiple_of", 64), ("num_classes", 12)),
               downsample=4),
    ModelShape("llamagen-b", "GPT-B", 256, 16384, "LlamaGen GPT-B c2i, 256 px (16x16 tokens), 111M"),
    ModelShape("llamagen-l", "GPT-L", 256, 16384, "LlamaGen GPT-L c2i, 256 px (16x16 tokens), 343M"),
    ModelShape("llamagen-xl", "GPT-XL", 256, 16384, "LlamaGen GPT-XL c2i, 256 px (16x16 tokens), 775M"),
    ModelShape("llamagen-xxl", "GPT-XXL", 256, 16384, "LlamaGen GPT-XXL c2i, 256 px (16x16 tokens), 1.4B"),
    # Anole / Lumina-mGPT 7B: Chameleon's 32 layers of width 4096 (SwiGLU 11008) and 65,536
    # tokens, 512 px = 32x32 image tokens; built from LlamaGen blocks (Chameleon's q/k norms
    # are a few more small kernels per layer, so this is a slight underestimate of its step)
    ModelShape("chameleon-7b", "GPT-7B", 512, 65536,
               "Chameleon-7B-shaped (Anole, Lumina-mGPT): 32 layers, width 4096, 65,536 tokens, 32x32 image "
               "tokens; LlamaGen blocks", (("cfg", 3.0), ("top_k", 2000), ("temperature", 1.0), ("top_p", 1.0))),
    # Janus-Pro's language models (Llama: 1B 24 x 2048, 16 heads; 7B 30 x 4096, 32 heads; SwiGLU
    # 5632 / 11008, which LlamaGen's FFN rule gives), 384 px = 24x24 codes of VQ-16, 16,384 codes; its
    # image head is an MLP (width x width more per token than LlamaGen's linear head: under 1 %)
    ModelShape("janus-pro-1b", "GPT-1B", 384, 16384,
               "Janus-Pro-1B-shaped: 24 Llama layers, width 2048, 24x24 image tokens, 16,384 codes; LlamaGen "
               "blocks", (("cfg", 5.0), ("top_k", 0), ("temperature", 1.0), ("top_p", 1.0)),
               overrides=(("n_layer", 24), ("n_head", 16))),
    ModelShape("janus-pro-7b", "GPT-7B", 384, 16384,
               "Janus-Pro-7B-shaped: 30 Llama layers, width 4096, 24x24 image tokens, 16,384 codes; LlamaGen "
               "blocks", (("cfg", 5.0), ("top_k", 0), ("temperature", 1.0), ("top_p", 1.0)),
               overrides=(("n_layer", 30),)),
    # Emu3-Gen: 32 Llama layers of width 4096, 8 KV heads, SwiGLU 14336; 720 px = 90x90 codes
    # (8 px each) of a 32,768-code VQ; its 90 row-end tokens (1 % of the steps) are left out
    ModelShape("emu3-8b", "GPT-7B", 720, 32768,
               "Emu3-Gen-shaped: 32 Llama layers, width 4096, 8 KV heads, 90x90 image tokens (row ends left out), "
               "32,768 codes; LlamaGen blocks", (("cfg", 3.0), ("top_k", 2048), ("temperature", 1.0), ("top_p", 1.0)),
               overrides=(("n_kv_head", 8), ("ffn_dim_multiplier", 1.3125)), downsample=8),
    # the same with 6 of its 32 layers: its fp32 weights (32 GB) and their packed copy do not fit
    # a 24 GB host, and every layer costs the same, so the layers' share of a step is measured on
    # 6 (the head and embedding weigh more in its total than in the full model's)
    ModelShape("emu3-8b-6l", "GPT-7B", 720, 32768,
               "Emu3-Gen-shaped with 6 of its 32 layers (width 4096, 8 KV heads, 90x90 image tokens, 32,768 "
               "codes); LlamaGen blocks", (("cfg", 3.0), ("top_k", 2048), ("temperature", 1.0), ("top_p", 1.0)),
               overrides=(("n_layer", 6), ("n_kv_head", 8), ("ffn_dim_multiplier", 1.3125)), downsample=8),
)}


def model_shape(name: str) -> ModelShape:
    if name not in SHAPES:
        raise UserError(f"unknown --shape {name!r}{did_you_mean(name, SHAPES)}; choose one of {', '.join(SHAPES)}")
    return SHAPES[name]


def check_projectable(spec: MethodSpec) -> None:
    if spec.decl.checks or spec.dynamic_depth is not None:
        raise UserError(f"{spec.method}{' with --dynamic-depth' if spec.dynamic_depth is not None else ''} drafts "
                        "to a depth the trained weights decide, so random weights cannot stand in for its cost; "
                        "project a fixed-depth method")


def projected_speedup(tau: float, ar_step_s: float, iteration_s: float) -> float:
    """tau x AR step / iteration: tokens per iteration over iterations' cost in AR steps."""
    if tau <= 0 or ar_step_s <= 0 or iteration_s <= 0:
        raise ValueError(f"tau, AR step and iteration time must be > 0, got {tau}, {ar_step_s}, {iteration_s}")
    return tau * ar_step_s / iteration_s


def projection_interval(tau: float, ar_steps: Sequence[float], iterations: Sequence[float], *,
                        draws: int = 2000, seed: int = 0, paired: bool = False) -> tuple[float, float, float]:
    """(point, low, high): the projected speedup from the median AR step and median iteration,
    with a 95 % bootstrap interval over the timing samples (tau taken as given). `paired`: the
    samples were taken in turn (sample i of each in the same round), so rounds are resampled
    together, keeping what the machine's drift did to both."""
    ar, it = np.asarray(ar_steps, dtype=float), np.asarray(iterations, dtype=float)
    point = projected_speedup(tau, float(np.median(ar)), float(np.median(it)))
    rng = np.random.default_rng(seed)
    if paired and ar.size == it.size:
        rounds = rng.integers(0, ar.size, size=(draws, ar.size))
        ar_med, it_med = np.median(ar[rounds], axis=1), np.median(it[rounds], axis=1)
    else:
        ar_med = np.median(rng.choice(ar, size=(draws, ar.size)), axis=1)
        it_med = np.median(rng.choice(it, size=(draws, it.size)), axis=1)
    low, high = np.quantile(tau * ar_med / it_med, [0.025, 0.975])
    return point, float(min(low, point)), float(max(high, point))


# -- whole projections --------------------------------------------------------------------------

@dataclass(frozen=True)
class Target:
    """One method setting to project: its spec, a label, and the tau it reached on a trained
    model with where that tau came from."""

    label: str
    spec: MethodSpec
    tau: float
    tau_source: str


def spec_from_run(run: Any, sampling: Any) -> MethodSpec:
    """The MethodSpec of a bench result file's run (its `params`) under the workload's sampling."""
    from runtime.core.sampling import SamplingParams

    from runtime.config.method_options import OPTION_TYPES

    p = run.params
    # the recorded method settings (a file's `params` fields named as the options), proactive and
    # the dynamic tree's "tree" label aside; relax_rule is read as recorded
    given = {k: getattr(p, k) for k in OPTION_TYPES if k in type(p).model_fields and k != "proactive"
             and getattr(p, k) is not None}
    if given.get("tree") == "dynamic":
        del given["tree"]
    if p.proactive:
        given["proactive"] = tuple(int(x) for x in p.proactive.split("x"))
    if METHOD_TABLE[run.method].chooses_relaxation:
        given["relax"] = "lambda" if p.lantern_lambda is not None else "delta" if p.lantern_delta is not None else "none"
    return MethodSpec(method=run.method, sampling=SamplingParams(
        greedy=sampling.greedy, temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
        cfg=sampling.cfg), **given)


def project(shape: ModelShape, backend: Backend, targets: Sequence[Target], *, warmup: int = 3, iterations: int = 20,
            batch_size: int = 1, progress: Callable[[str], None] | None = None,
            roof: Callable[[], Any] | None = None) -> dict[str, Any]:
    """Measure the AR step and each target's iteration on `shape` (random weights) and project
    each target's speedup. Returns the JSON-ready body of a projection file: the shape, the
    per-phase samples, and per target tau (with its source), the medians and the projected
    speedup with its interval; with `roof` (returning a `runtime.tools.roofline.Roof`, asked once
    the models are prepared: on a CPU that sets the threads it is measured on), each phase's floor and
    its measured time over it."""
    from runtime.tools.roofline import ReadProbe, decoder_phases, floors

    say = progress or (lambda _: None)
    for t in targets:
        check_projectable(t.spec)
    target_model, drafter = random_models(shape.config(), backend)
    for model in (target_model, drafter):
        backend.prepare_inference(model)
    peaks = None if roof is None else roof()
    sampling = targets[0].spec.sampling if targets else None
    ar_spec = MethodSpec(method="ar", sampling=sampling) if sampling is not None else MethodSpec(method="ar")
    cfg = shape.config()
    context = cfg.cls_token_num + cfg.block_size // 2  # the mean committed length over an image

    specs = [(ar_spec, "ar")] + [(t.spec, t.label) for t in targets]
    say(f"{shape.name}: {', '.join(label for _, label in specs)} (iterations taken in turn)")
    decoders = [Decoder(target_model, drafter, spec, neighbours=random_neighbours(shape.vocab_size, spec),
                        backend=backend, batch_size=batch_size) for spec, _ in specs]
    probe = ReadProbe() if peaks is not None and backend.name == "cpu" else None
    measured = time_interleaved(decoders, backend, warmup=warmup, iterations=iterations, between=probe)
    if probe is not None:
        peaks = probe.applied(peaks)

    def floor_of(decoder: Decoder, times: StepTimes) -> dict[str, Any] | None:
        return None if peaks is None else floors(decoder_phases(decoder, context), times.medians(), peaks, backend.dtype)

    ar, ar_floor = measured[0], floor_of(decoders[0], measured[0])
    ar_steps = ar.iterations()
    runs = []
    for t, decoder, times in zip(targets, decoders[1:], measured[1:]):
        floor = floor_of(decoder, times)
        point, low, high = projection_interval(t.tau, ar_steps, times.iterations(), paired=True)
        runs.append({"label": t.label, "method": t.spec.method, "params": t.spec.describe(), "tau": t.tau,
                     "tau_source": t.tau_source, "seconds": times.to_dict(),
                     "iteration_s": float(np.median(times.iterations())),
                     "iteration_over_ar_step": float(np.median(times.iterations()) / np.median(ar_steps)),
                     "projected_speedup": {"point": point, "low": low, "high": high},
                     **({"floor": floor} if floor is not None else {})})
    body = {"shape": {"name": shape.name, "description": shape.description, "layers": cfg.n_layer,
                      "width": cfg.dim, "vocab_size": cfg.vocab_size, "image_tokens": cfg.block_size,
                      "weights": "random (LlamaGen init)"},
            "batch_size": batch_size, "warmup": warmup, "iterations": iterations,
            "ar_step": {"seconds": ar.to_dict(), "median_s": float(np.median(ar_steps)),
                        **({"floor": ar_floor} if ar_floor is not None else {})},
            "runs": runs}
    if peaks is not None:
        body["roof"] = {**peaks.to_dict(), "context": context}
    return body


# -- the projection file ------------------------------------------------------------------------

def _file_models():
    """The projection file's pydantic models (built on first use: `runtime --help` imports no pydantic)."""
    from pydantic import BaseModel, ConfigDict, Field, model_validator

    class Strict(BaseModel):
        model_config = ConfigDict(extra="forbid")

    class Span(Strict):
        point: float = Field(gt=0)
        low: float = Field(gt=0)
        high: float = Field(gt=0)

        @model_validator(mode="after")
        def ordered(self) -> "Span":
            if not self.low <= self.point <= self.high:
                raise ValueError("must satisfy low <= point <= high")
            return self

    class Seconds(Strict):
        draft: list[float] = Field(default_factory=list)
        verify: list[float] = Field(min_length=1)
        accept: list[float] = Field(min_length=1)

    class Run(Strict):
        floor: dict[str, dict[str, float]] | None = None
        label: str
        method: str
        params: dict[str, Any]
        tau: float = Field(gt=0)
        tau_source: str
        seconds: Seconds
        iteration_s: float = Field(gt=0)
        iteration_over_ar_step: float = Field(gt=0)
        projected_speedup: Span

    class Shape(Strict):
        name: str
        description: str
        layers: int = Field(ge=1)
        width: int = Field(ge=1)
        vocab_size: int = Field(ge=2)
        image_tokens: int = Field(ge=1)
        weights: str

    class ArStep(Strict):
        seconds: Seconds
        median_s: float = Field(gt=0)
        floor: dict[str, dict[str, float]] | None = None

    class ProjectionFile(Strict):
        schema_version: int = Field(ge=1, le=PROJECTION_SCHEMA_VERSION)
        kind: str = Field(pattern="^projection$")
        device: dict[str, Any]
        env: dict[str, Any]
        shape: Shape
        batch_size: int = Field(ge=1)
        warmup: int = Field(ge=0)
        iterations: int = Field(ge=1)
        ar_step: ArStep
        runs: list[Run]
        roof: dict[str, Any] | None = None  # the device's peaks the floors were computed with

    return ProjectionFile


PROJECTION_SCHEMA_VERSION = 1


def projection_file(body: dict[str, Any], device: dict[str, Any], env: dict[str, Any]) -> dict[str, Any]:
    """The whole file: `project()`'s body with the device and environment, validated."""
    data = {"schema_version": PROJECTION_SCHEMA_VERSION, "kind": "projection", "device": device, "env": env, **body}
    validate_projection(data, "<projection>")
    return data


def is_projection(data: Any) -> bool:
    return isinstance(data, dict) and data.get("kind") == "projection"


def validate_projection(data: Any, source: str) -> Any:
    """The parsed projection file, or one UserError naming `source` and the first bad field's path."""
    from pydantic import ValidationError

    from runtime.bench.schema import describe

    try:
        return _file_models().model_validate(data)
    except ValidationError as err:
        raise UserError(f"{source}: {describe(err)}") from None


def save_random_checkpoints(shape: ModelShape, folder: str | Path, seed: int = 0) -> dict[str, Path]:
    """Write `shape`'s random target (LlamaGen's c2i layout, `c2i_<size>_<px>.pt`), a random VQ-16
    (`vq_ds16_c2i.pt`) and a random LANTERN drafter folder (`drafter/`) into `folder`: a model
    of the real shape that `runtime run / bench / serve` load like an official checkpoint
    (`--gpt-model`, `--gpt-ckpt`, `--vq-ckpt`, `--drafter`), for timing a served model of that
    size where its trained weights are not at hand. The same seed writes the same files."""
    from runtime.models.configs import VQ_CONFIGS
    from runtime.models.loading import save_drafter_folder
    from runtime.models.vq import VQModel

    class _OnCpu:  # random_models places the weights on a backend's device: here the CPU, fp32
        device, dtype = torch.device("cpu"), torch.float32

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    target, drafter = random_models(shape.config(), _OnCpu(), seed)
    files = {"gpt_ckpt": out / f"c2i_{shape.gpt.split('-', 1)[1]}_{shape.image_size}.pt",
             "vq_ckpt": out / "vq_ds16_c2i.pt", "drafter": out / "drafter"}
    torch.save({"model": target.state_dict()}, files["gpt_ckpt"])
    torch.manual_seed(seed)
    torch.save({"model": VQModel(VQ_CONFIGS["VQ-16"]).state_dict()}, files["vq_ckpt"])
    save_drafter_folder(files["drafter"], drafter.config, drafter)
    return files


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m runtime.bench.projection --shape llamagen-xl --out DIR`: write the random
    checkpoints of a shape (see save_random_checkpoints) and print the flags that load them."""
    import argparse

    parser = argparse.ArgumentParser(description=save_random_checkpoints.__doc__.splitlines()[0])
    parser.add_argument("--shape", required=True, choices=sorted(SHAPES))
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    shape = model_shape(args.shape)
    files = save_random_checkpoints(shape, args.out, args.seed)
    print(f"--gpt-model {shape.gpt} --gpt-ckpt {files['gpt_ckpt']} --vq-ckpt {files['vq_ckpt']} "
          f"--drafter {files['drafter']} --image-size {shape.image_size}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
