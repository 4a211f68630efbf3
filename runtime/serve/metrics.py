"""Prometheus metrics of `runtime serve` (its own registry, so several servers in one process,
as in the tests, do not collide)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterator

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

    from runtime.serve.engine import DoneInfo, Engine, Job

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300)
TAU_BUCKETS = (1, 1.25, 1.5, 2, 2.5, 3, 4, 5, 6, 8)


class _EngineCounters:
    """Counters the engine thread keeps (it counts without knowing of Prometheus), exposed as
    counters (`_total`) at scrape time."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import CounterMetricFamily

        yield CounterMetricFamily("lantern_images_failed", "Images an engine error failed (since start).",
                                  value=self.engine.stats.images_failed)
        yield CounterMetricFamily("lantern_method_switches", "Times --method auto switched methods.",
                                  value=self.engine.scheduler.switches)


class ServeMetrics:
    """Gauges read from the engine at scrape time, counters and histograms fed as requests are
    answered and images done, and the process's own (`process_*`: CPU, memory, open files)."""

    def __init__(self, engine: Engine, method: str) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, ProcessCollector

        self.registry = registry = CollectorRegistry()
        self.engine = engine
        ProcessCollector(registry=registry)
        registry.register(_EngineCounters(engine))
        self.requests = Counter("lantern_requests", "API requests (/v1/...) answered, by HTTP status.", ["code"],
                                registry=registry)
        Info("lantern_method", "The decoding method the server was started with (auto: chosen by occupancy).",
             registry=registry).info({"method": method})
        in_use = Gauge("lantern_method_in_use", "1 for the method decoding now.", ["method"], registry=registry)

        def in_use_of(name: str) -> Callable[[], float]:
            return lambda: float(engine.current == name)

        def step_tvd_of(name: str, part: int) -> Callable[[], float]:
            return lambda: engine.stats.step_tvd(name)[part] or 0.0

        for name in getattr(engine, "decoders", None) or {}:
            in_use.labels(method=name).set_function(in_use_of(name))
        Gauge("lantern_steps_recompiled", "Step compilations or captures after warm-up (0 in a steady state; "
              "more means a shape or guard changed and a step was compiled again).", registry=registry).set_function(
            lambda: engine.recompiles)
        Gauge("lantern_queue_depth", "Images waiting for a slot.", registry=registry).set_function(
            lambda: engine.queue_depth)
        Gauge("lantern_slots_busy", "Decoder slots holding an image.", registry=registry).set_function(
            lambda: engine.stats.busy_slots)
        Gauge("lantern_slots", "Decoder slots (the batch size).", registry=registry).set_function(
            lambda: engine.decoder.config.batch)
        Gauge("lantern_tau", "Tokens per target forward over every image served.", registry=registry).set_function(
            lambda: engine.stats.accepted_tokens / max(engine.stats.target_forwards, 1))
        tvd = Gauge("lantern_step_tvd", "Measured total variation of a step's output law from the target's "
                    "(one iteration in several measured; relaxed methods under sampling).", ["method"],
                    registry=registry)
        bound = Gauge("lantern_step_tvd_bound", "The relaxation's stated bound at the same steps.", ["method"],
                      registry=registry)
        for name in getattr(engine, "decoders", None) or {}:
            tvd.labels(method=name).set_function(step_tvd_of(name, 0))
            bound.labels(method=name).set_function(step_tvd_of(name, 1))
        self.images = Counter("lantern_images", "Images generated.", registry=registry)
        self.rejected = Counter("lantern_requests_rejected", "Requests refused with 429 (queue full).",
                                registry=registry)
        self.latency = Histogram("lantern_image_latency_seconds", "Seconds from queued to done, per image.",
                                 buckets=LATENCY_BUCKETS, registry=registry)
        self.queue_time = Histogram("lantern_image_queue_seconds", "Seconds waiting for a slot, per image.",
                                    buckets=LATENCY_BUCKETS, registry=registry)
        self.tau = Histogram("lantern_image_tau", "Tokens per target forward, per image.", buckets=TAU_BUCKETS,
                             registry=registry)
        engine.on_done = self.observe

    def count_request(self, status: int) -> None:
        """One API request answered with `status` (0: the client went away before any answer)."""
        self.requests.labels(code=str(status)).inc()

    def observe(self, job: Job, info: DoneInfo) -> None:
        self.images.inc()
        self.latency.observe(info["latency_s"])
        self.queue_time.observe(info["queue_s"])
        self.tau.observe(info["tau"])

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
