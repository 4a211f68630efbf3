"""`runtime serve`: speculative image generation as an HTTP service (engine.py: continuous
batching over the captured decoder; api.py: OpenAI's images API, health, readiness, metrics; page.py:
the web page at /)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fastapi import FastAPI

    from backends import Backend
    from runtime.core import MethodSpec
    from runtime.generation.loading import LoadedModel
    from runtime.config.profiles import AutoSettings
    from runtime.serve.api import HttpOptions, Served
    from runtime.serve.conditions import Conditioner
    from runtime.serve.engine import Engine


@dataclass(frozen=True)
class AutoMethods:
    """`--method auto`: the spec of each method of a profile's `[auto]` table (lossless), and
    the table, which names the method for an occupancy (`AutoSettings.method_for`)."""

    specs: dict[str, MethodSpec]
    table: AutoSettings


def build_server(loaded: LoadedModel, spec: MethodSpec, backend: Backend, *, batch_size: int, max_queue: int,
                 timeout_s: float, warm_up: bool = True, auto: AutoMethods | None = None,
                 conditioner: Conditioner | None = None, names: list[str] | None = None,
                 http: HttpOptions | None = None) -> tuple[FastAPI, Engine, Served]:
    """(FastAPI app, engine, served) for a loaded model and a resolved method; the engine thread
    is started, and captures its steps on one thrown-away image first when `warm_up`. `auto`:
    one decoder per method of the table (`--method auto`), the engine picks by occupancy.
    `conditioner`: how a text-conditioned model reads a prompt
    (`runtime.serve.conditions`: T5 captions for LlamaGen t2i, padded token prompts for
    Chameleon; a Chameleon target must have been set to the conditioner's prompt length). `names`:
    the model names the API lists and accepts (--served-model-name; default the model's own);
    `http`: `runtime.serve.api.HttpOptions` (auth, CORS, docs, the request-size limit)."""
    from runtime import __version__
    from runtime.utils.errors import UserError
    from runtime.generation.pipeline import make_decoder
    from runtime.serve.api import Served, create_app
    from runtime.serve.engine import Engine, Job

    kind = loaded.config.model_type
    if kind == "t2i" and conditioner is None:
        raise UserError("serving a text-to-image model needs its caption encoder: --t5-path DIR (a local "
                        "flan-t5-xl for LlamaGen)")
    if kind == "chameleon" and conditioner is None:
        raise UserError("serving a Chameleon model needs its prompt length (runtime serve sets it from "
                        "--prompt-length)")
    methods = {spec.method: spec} if auto is None else auto.specs
    engine = Engine({m: make_decoder(loaded, s, backend, batch_size=batch_size) for m, s in methods.items()},
                    backend.device, max_queue=max_queue, choose=None if auto is None else auto.table.method_for,
                    capture_count=backend.capture_count)
    served = Served(loaded, spec, batch_size=batch_size, timeout_s=timeout_s, version=__version__,
                    method="auto" if auto is not None else spec.method, conditioner=conditioner, max_queue=max_queue,
                    names=names, specs=methods)
    app = create_app(engine, served, http)
    first = None
    if warm_up:
        cond, mask = conditioner("a photo") if conditioner is not None else (None, None)
        first = Job("warm-up", 0, 0, 0, cond=cond, mask=mask)
    engine.start(warm_up=first)
    return app, engine, served
