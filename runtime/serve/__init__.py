"""`runtime serve`: speculative image generation as an HTTP service (engine.py: continuous
batching over the captured decoder; api.py: OpenAI's images API, health, readiness, metrics)."""

from __future__ import annotations

from typing import Any


def build_server(loaded: Any, spec: Any, backend: Any, *, batch_size: int, max_queue: int, timeout_s: float,
                 warm_up: bool = True, auto: Any = None) -> tuple[Any, Any, Any]:
    """(FastAPI app, engine, served) for a loaded model and a resolved method; the engine thread
    is started, and captures its steps on one thrown-away image first when `warm_up`. `auto`:
    {method: spec} and a profile `[auto]` table (`--method auto`): one decoder per method, the
    engine picks by occupancy."""
    from runtime import __version__
    from runtime.pipeline import make_decoder
    from runtime.serve.api import Served, create_app
    from runtime.serve.engine import Engine, Job

    if loaded.config.model_type != "c2i" or loaded.prompt_encoder is not None:
        from runtime.errors import UserError

        raise UserError("runtime serve serves class-conditional models for now (the demo, LlamaGen c2i); "
                        "generate from text prompts with runtime run --prompts")
    if auto is None:
        engine = Engine({spec.method: make_decoder(loaded, spec, backend, batch_size=batch_size)}, backend.device,
                        max_queue=max_queue, capture_count=backend.capture_count)
    else:
        specs, table = auto
        engine = Engine({m: make_decoder(loaded, s, backend, batch_size=batch_size) for m, s in specs.items()},
                        backend.device, max_queue=max_queue, choose=table.method_for,
                        capture_count=backend.capture_count)
    served = Served(loaded, spec, batch_size=batch_size, timeout_s=timeout_s, version=__version__,
                    method="auto" if auto is not None else spec.method)
    app = create_app(engine, served)
    engine.start(warm_up=Job("warm-up", 0, 0, 0) if warm_up else None)
    return app, engine, served
