"""`runtime serve`: one model and method on one device behind OpenAI's images API (runtime/serve).

SIGTERM stops admitting, lets the requests in flight finish and exits 0. A first Ctrl-C drains
the same way and exits 130 (interrupted, as every command does); a second exits at once.
"""

from __future__ import annotations

import signal
from typing import Any

import typer

from runtime.cli import options as opt
from runtime.cli.app import app
from runtime.errors import UserError


@app.command("serve")
@opt.with_method_options()
@opt.with_model_options
def serve(
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0: every interface)."),
    port: int = typer.Option(8000, "--port", help="TCP port."),
    max_queue: int = typer.Option(64, "--max-queue", help="Images waiting for a slot before requests get 429."),
    timeout: float = typer.Option(600.0, "--timeout", help="Seconds a request may take before it gets 504 (its "
                                  "images are dropped)."),
    source: opt.ModelSource = None,  # every model option (opt.MODEL_OPTIONS)
    t5_path: opt.T5Path = None,
    prompt_length: opt.PromptLength = None,
    device: opt.Device = "auto",
    profile_name: opt.ProfileName = None,
    graph: opt.Graph = None,
    dtype: opt.Dtype = None,
    method: opt.Method = None,
    flags: opt.MethodFlags = None,  # every method option (runtime.method_options)
    attention: opt.Attention = "auto",
    batch_size: opt.BatchSize = None,
) -> None:
    """Serve image generation over HTTP (OpenAI images API, continuous batching, /metrics)."""
    import logging

    from runtime.models.layers import set_attention_kernel
    from runtime.settings import AUTO, auto_method, resolve_spec
    from runtime.serve import build_server

    if not 0 < port < 65536:
        raise UserError(f"--port must be in [1, 65535], got {port}")
    if max_queue < 1:
        raise UserError(f"--max-queue must be >= 1, got {max_queue}")
    if not timeout > 0:
        raise UserError(f"--timeout must be > 0 seconds, got {timeout}")
    try:
        import uvicorn
    except ImportError:
        raise UserError("runtime serve needs the serve extra: pip install 'lantern-runtime[serve]' "
                        "(FastAPI, uvicorn, prometheus-client)") from None
    set_attention_kernel(attention)
    backend, prof = opt.open_backend(device, profile_name, graph, dtype)
    loaded = source.load(backend)
    batch = opt.batch_size(batch_size, prof)
    given = flags.as_dict()
    auto = None
    if method == AUTO:  # one decoder per method of the profile's [auto] table, picked by occupancy
        auto_method(prof, batch, given)  # refuses a profile without the table, and relaxation flags
        names = prof.auto.methods
        specs = {m: resolve_spec(m, given, prof, loaded.recommended, run_methods=names, lossless=True) for m in names}
        spec, auto = specs[names[0]], (specs, prof.auto)
    else:
        spec = resolve_spec(method, given, prof, loaded.recommended)
    web, engine, served = build_server(loaded, spec, backend, batch_size=batch, max_queue=max_queue,
                                       timeout_s=timeout, auto=auto,
                                       conditioner=_conditioner(loaded, backend, t5_path, prompt_length))

    logging.getLogger("runtime").info("serving %s with %s on %s:%d (batch %d)", loaded.name, spec.method, host,
                                      port, batch)
    server = uvicorn.Server(uvicorn.Config(web, host=host, port=port, log_level="warning", lifespan="on",
                                           timeout_graceful_shutdown=max(timeout, 1.0)))
    # uvicorn handles SIGTERM / SIGINT itself (graceful, then forced on a second Ctrl-C) and
    # raises them again once done: a drained SIGTERM is a clean exit here
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        server.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
        engine.stop(drain=False, timeout=5)


DEFAULT_PROMPT_LENGTH = 64  # Chameleon prompts: tokens every captured step is built for


def _conditioner(loaded: Any, backend: Any, t5_path: str | None, prompt_length: int | None) -> Any:
    """How the served model reads a text prompt (None: class ids and names), refusing the flags
    that do nothing for it. Sets a Chameleon target's prompt length before its decoders are built."""
    from runtime.serve.conditions import Captions, TokenPrompts

    kind = loaded.config.model_type
    length = opt.prompt_length(prompt_length, kind, DEFAULT_PROMPT_LENGTH if kind == "chameleon" else None)
    if t5_path is not None and kind != "t2i":
        reads = "class ids or names" if kind == "c2i" else "read by its own tokenizer"
        raise UserError(f"--t5-path does nothing for a {'class-conditional' if kind == 'c2i' else 'Chameleon'} "
                        f"model (its prompts are {reads}); drop it")
    if kind == "t2i" and t5_path is not None:
        from runtime.models.t5 import T5Encoder

        encoder = T5Encoder(t5_path, device=backend.device, dtype=backend.dtype, max_length=loaded.config.cls_token_num)
        return Captions(encoder, backend.device, backend.dtype)
    if kind == "chameleon":
        loaded.target.for_prompts(length)
        return TokenPrompts(loaded.prompt_encoder, length, backend.device)
    return None
