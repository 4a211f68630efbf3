"""`runtime selfcheck`: the device checks that make a backend trustworthy, in one command.

Checks (each a named entry in `selfcheck.json`; a failed one makes the command exit 1):

    graph_equals_eager     captured steps give the eager tokens (fp32, greedy, demo model)
    greedy_exact           every method reproduces AR greedy token for token (fp32, demo)
    no_zero_probability    10^5 categorical draws from distributions with zeros hit none
    no_hidden_host_sync    replayed steps never sync with the host (CUDA: sync debug mode
                           "error" around each replay; HPU: no graph compilation after
                           warm-up, from Habana's metrics; CPU: not applicable, skipped)
    steady_state_no_recompile  a second image compiles and captures nothing: no step's
                           compile/capture count rises after warm-up (every backend in graph
                           mode; HPU also Habana's graph-compilation count)

Measurements (not pass/fail): per-phase seconds, ops per iteration and compiler kernels for
`ar` and `lantern++` on the demo, peak memory, and the AR step / verify / draft-level costs of
a LlamaGen-XL-shaped model with random weights (the projection input for real models).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from runtime.core import Decoder, MethodSpec, SamplingParams, neighbours_for
from runtime.core.opcount import phase_ops
from runtime.core.sampling import sample
from runtime.config.method_options import BASELINE, METHOD_TABLE, METHODS, Drafting

if TYPE_CHECKING:
    from backends import Backend


# every method but AR, each checked against AR greedy (relaxation off)
CHECKED = tuple(m for m in METHODS if m != BASELINE)


@dataclass
class Check:
    name: str
    passed: bool | None  # None = skipped (not applicable on this device)
    detail: str


@dataclass
class SelfcheckReport:
    device: dict[str, Any]
    checks: list[Check] = field(default_factory=list)
    phases: dict[str, Any] = field(default_factory=dict)
    xl_shape: dict[str, Any] | None = None
    seconds: float = 0.0

    @property
    def failed(self) -> list[str]:
        return [c.name for c in self.checks if c.passed is False]

    def to_dict(self) -> dict[str, Any]:
        return {"device": self.device, "passed": not self.failed, "failed": self.failed,
                "checks": [{"name": c.name, "passed": c.passed, "detail": c.detail} for c in self.checks],
                "phases": self.phases, "xl_shape": self.xl_shape, "seconds": self.seconds}


def _spec(method: str, greedy: bool, **kw: Any) -> MethodSpec:
    params = SamplingParams(greedy=greedy, cfg=3.0)
    return MethodSpec(method, params, tree=kw.pop("tree", "chain3"), lantern_k=32, **kw)


def _decode(bundle: Any, spec: MethodSpec, backend: Backend, cls: int = 3, seed: int = 5) -> tuple[torch.Tensor, Decoder]:
    nb = neighbours_for(bundle.vq, spec, bundle.gpt.config.vocab_size)
    dec = Decoder(bundle.gpt, bundle.drafter, spec, neighbours=nb, backend=backend)
    tokens, _ = dec.generate_one(torch.tensor([cls], device=bundle.gpt.tok_embeddings.weight.device), None, seed)
    return tokens.cpu(), dec


def _no_sync(backend: Backend, replay: Callable[[], None]) -> Callable[[], None]:
    """`replay` that raises on a host sync inside it (CUDA sync debug mode); as is elsewhere."""
    if backend.name != "cuda":
        return replay

    def guarded() -> None:
        torch.cuda.set_sync_debug_mode("error")
        try:
            replay()
        finally:
            torch.cuda.set_sync_debug_mode("default")

    return guarded


def _hpu_compilations() -> int | None:
    try:
        from habana_frameworks.torch.hpu.metrics import metric_global  # type: ignore[import-not-found]
    except ImportError:
        return None
    stats = dict(metric_global("graph_compilation").stats())
    return int(stats.get("TotalNumber", 0))


def check_graph_and_sync(bundle: Any, backend: Backend) -> list[Check]:
    """Graph == eager (greedy, fp32) for ar and lantern++, and no host sync inside replays."""
    checks = []
    if not backend.graph_mode:
        return [Check(name, None, "graph mode off (--no-graph)")
                for name in ("graph_equals_eager", "no_hidden_host_sync", "steady_state_no_recompile")]
    mismatches, sync_error, recompiled = [], None, []
    for method in ("ar", "lantern++"):
        spec = _spec(method, greedy=True)
        eager, _ = _decode(bundle, spec, None)
        graph, dec = _decode(bundle, spec, backend)  # captures, then decodes with replays
        captured = dict(backend.capture_count)
        if not torch.equal(eager, graph):
            first = int((eager != graph).nonzero()[0, 0])
            mismatches.append(f"{method} differs from token {first}")
        # a second image through guarded replays: a sync inside a step raises on CUDA
        before = _hpu_compilations() if backend.name == "hpu" else None
        dec.draft_segments = [_no_sync(backend, step) for step in dec.draft_segments]
        if dec.draft_finish is not None:
            dec.draft_finish = _no_sync(backend, dec.draft_finish)
        dec.verify_at = {d: _no_sync(backend, step) for d, step in dec.verify_at.items()}
        dec.accept_at = {d: _no_sync(backend, step) for d, step in dec.accept_at.items()}
        try:
            dec.generate_one(torch.tensor([5], device=backend.device), None, 9)
        except RuntimeError as err:
            sync_error = f"{method}: {str(err).splitlines()[0]}"
        recompiled += [f"{name} compiled {count - captured.get(name, 0)} more time(s)"
                       for name, count in backend.capture_count.items() if count > captured.get(name, 0)]
        if before is not None and (_hpu_compilations() or 0) > before:
            sync_error = f"{method}: HPU graphs recompiled after warm-up"
            recompiled.append(f"{method}: {(_hpu_compilations() or 0) - before} HPU graph compilation(s)")
    checks.append(Check("graph_equals_eager", not mismatches,
                        "; ".join(mismatches) or "ar and lantern++ chain3: identical tokens"))
    if backend.name == "cpu":
        checks.append(Check("no_hidden_host_sync", None, "CPU: host and device are one"))
    else:
        checks.append(Check("no_hidden_host_sync", sync_error is None, sync_error or "no sync inside replays"))
    steps = ", ".join(f"{k} x{v}" for k, v in sorted(backend.capture_count.items()))
    checks.append(Check("steady_state_no_recompile", not recompiled,
                        "; ".join(recompiled) or f"a second image compiled nothing (captures: {steps})"))
    return checks


def check_greedy_exact(bundle: Any, backend: Backend) -> Check:
    """Every method with relaxation off equals AR greedy (eager steps on the device)."""
    ar, _ = _decode(bundle, _spec("ar", True), None)
    bad = []
    for method in CHECKED:
        spec = _spec(method, True, tree="naive_extend_57", lantern_lambda=1.0, lantern_delta=0.0, cool_delta=1.0,
                     cool_nu=0.0)
        tokens, _ = _decode(bundle, spec, None)
        if not torch.equal(tokens, ar):
            bad.append(f"{method} differs from token {int((tokens != ar).nonzero()[0, 0])}")
    dynamic = _spec("lantern++", True, tree="naive_extend_57", lantern_lambda=1.0, dynamic_depth=0.2)
    tokens, _ = _decode(bundle, dynamic, None)
    if not torch.equal(tokens, ar):
        bad.append(f"lantern++ --dynamic-depth differs from token {int((tokens != ar).nonzero()[0, 0])}")
    return Check("greedy_exact", not bad,
                 "; ".join(bad) or f"{', '.join(CHECKED)} and lantern++ --dynamic-depth equal AR greedy")


def check_batch_invariance(bundle: Any, backend: Backend) -> Check:
    """Sampled tokens of three images at batch size 3 equal those decoded one at a time
    (eager steps on the device, fp32), for a static tree (lantern++) and a dynamic one (eagle2)."""
    from runtime.core import generate

    bad = []
    for method in ("lantern++", "eagle2"):
        spec = _spec(method, greedy=False, **({"depth": 3, "top_k_draft": 4, "total_tokens": 16}
                                              if METHOD_TABLE[method].drafting == Drafting.DYNAMIC else {}))
        nb = neighbours_for(bundle.vq, spec, bundle.gpt.config.vocab_size)
        runs = [generate(bundle.gpt, bundle.drafter, spec, [3, 5, 7], seed=2, neighbours=nb, batch_size=b).tokens
                for b in (1, 3)]
        for i in range(3):
            if not torch.equal(runs[0][i], runs[1][i]):
                bad.append(f"{method} image {i} differs from token {int((runs[0][i] != runs[1][i]).nonzero()[0, 0])}")
    return Check("batch_invariance", not bad, "; ".join(bad) or "lantern++ and eagle2 sampling: B=3 == B=1")


def check_no_zero_probability(device: torch.device, draws: int = 100_000, vocab: int = 64) -> Check:
    """`draws` samples from distributions with about half their entries zero."""
    from runtime.core.rng import CounterRNG

    g = torch.Generator().manual_seed(0)
    p = torch.rand(draws, vocab, generator=g) * (torch.rand(draws, vocab, generator=g) < 0.5)
    p[:, 0] += (p.sum(-1) == 0).float()
    p = (p / p.sum(-1, keepdim=True)).to(device)
    x = sample(p, CounterRNG(device, seed=1))
    bad = int((p.gather(1, x[:, None]) == 0).sum())
    return Check("no_zero_probability", bad == 0, f"{bad} of {draws} draws had probability 0")


def measure_phases(bundle: Any, backend: Backend) -> dict[str, Any]:
    """Seconds per phase (one image), ops per iteration, kernels and peak memory."""
    out = {}
    for method, greedy in (("ar", False), ("lantern++", False), ("lantern++", True)):
        spec = _spec(method, greedy, tree="naive_extend_57")
        nb = neighbours_for(bundle.vq, spec, bundle.gpt.config.vocab_size)
        dec = Decoder(bundle.gpt, bundle.drafter, spec, neighbours=nb, backend=backend)
        cond = torch.tensor([3], device=backend.device)
        dec.generate_one(cond, None, 1)  # capture / warm up
        backend.reset_peak_memory()
        timer = backend.timer()
        dec.timer = timer
        dec.generate_one(cond, None, 2)
        phases = timer.summary()
        ops = phase_ops(dec, cond, seed=3)
        out[f"{method} {'greedy' if greedy else 'sampling'}"] = {
            "seconds": {k: v["seconds"] for k, v in phases.items()},
            "ops_per_iteration": ops,
            "kernels_per_step": dict(dec.kernels_per_step),
            "peak_bytes": backend.memory_stats().get("peak_bytes"),
        }
    return out


def measure_xl_shape(backends: dict[str, Any], repeats: int = 3, roof: Any = None, cfg: Any = None) -> dict[str, Any]:
    """AR step, and draft / verify / accept of LANTERN++ over naive_extend_57, on a LlamaGen-XL
    shape with random weights, batch 1 with CFG, in each of `backends` (mode name -> backend:
    "eager", and "captured" where the device captures steps), with each phase against its
    roofline floor when a `roof` is given. Median seconds per phase over `repeats` iterations.
    `cfg`: another GPT config to time the same way (tests use a tiny one)."""
    from backends.base import dtype_name
    from runtime.models.configs import gpt_config
    from runtime.tools.roofline import decoder_phases, floors
    from runtime.tools.step_timing import random_models, random_neighbours, time_steps

    cfg = cfg or gpt_config("GPT-XL", image_size=256)
    name = "GPT-XL c2i 256px" if cfg.n_layer == 36 and cfg.dim == 1280 else f"{cfg.n_layer} layers x {cfg.dim}"
    out: dict[str, Any] = {"model": f"{name} (random weights), batch 1 with CFG",
                           "roof": roof.to_dict() if roof is not None else None}
    models: dict[Any, Any] = {}
    for mode, backend in backends.items():
        key = (str(backend.device), backend.dtype)
        if key not in models:
            models[key] = random_models(cfg, backend)
        target, drafter = models[key]
        costs: dict[str, Any] = {"dtype": dtype_name(backend.dtype)}
        for label, spec in (("ar_step", _spec("ar", False)),
                            ("lantern++ naive_extend_57", _spec("lantern++", False, tree="naive_extend_57",
                                                                lantern_lambda=1.0))):
            dec = Decoder(target, drafter, spec, neighbours=random_neighbours(cfg.vocab_size, spec), backend=backend)
            times = time_steps(dec, backend, warmup=1, iterations=repeats)
            medians = times.medians()
            result: dict[str, Any] = {f"{phase}_s": medians[phase] for phase in ("draft", "verify", "accept")
                                      if phase in medians}
            result["ops_per_iteration"] = phase_ops(dec, torch.tensor([1], device=backend.device), seed=0,
                                                    iterations=1)
            if roof is not None:
                result["floor"] = floors(decoder_phases(dec), medians, roof, backend.dtype)
            costs[label] = result
        ar = costs["ar_step"]["verify_s"] + costs["ar_step"]["accept_s"]
        tree = costs["lantern++ naive_extend_57"]
        costs["verify_over_ar_step"] = tree["verify_s"] / ar
        costs["draft_over_ar_step"] = tree["draft_s"] / ar
        out[mode] = costs
    return out


def run_selfcheck(backend: Backend, *, xl: bool = True, progress: Callable[[str], None] | None = None,
                  xl_backends: dict[str, Any] | None = None, roof: Any = None) -> SelfcheckReport:
    """Every check on `backend` (fp32); with `xl`, the LlamaGen-XL step costs on `xl_backends`
    (mode -> backend in the device's own dtype; default: `backend`, eager or captured as it is)."""
    from runtime.demo.bundle import load_demo_bundle

    began = time.perf_counter()
    say = progress or (lambda _msg: None)
    report = SelfcheckReport(device=backend.info())
    bundle = load_demo_bundle(device=backend.device, dtype=torch.float32)
    say("graph == eager, host syncs")
    report.checks.extend(check_graph_and_sync(bundle, backend))
    say("greedy exactness of every method")
    report.checks.append(check_greedy_exact(bundle, backend))
    say("same tokens at every batch size")
    report.checks.append(check_batch_invariance(bundle, backend))
    say("no zero-probability samples")
    report.checks.append(check_no_zero_probability(backend.device))
    say("per-phase time, ops, kernels, memory")
    report.phases = measure_phases(bundle, backend)
    if xl:
        say("LlamaGen-XL-shaped step costs")
        report.xl_shape = measure_xl_shape(xl_backends or {"captured" if backend.graph_mode else "eager": backend},
                                           roof=roof)
    report.seconds = time.perf_counter() - began
    return report
