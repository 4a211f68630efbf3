"""`runtime serve`: one model and method on one device behind OpenAI's images API (runtime/serve).

SIGTERM drains (runtime/serve/drain.py): the server keeps listening, /ready answers 503 and new
requests 503 with Retry-After while the requests in flight finish, within --shutdown-timeout;
then it exits 0. A first Ctrl-C drains the same way and exits 130 (interrupted, as every command
does); a second gives up the requests in flight (503) and exits at once.
"""

from __future__ import annotations

import re
import signal
import sys
from typing import Annotated, Any, List, Optional

import typer

from runtime.cli import options as opt
from runtime.cli.app import app
from runtime.utils.errors import UserError


Host = Annotated[str, typer.Option("--host", help="Address to listen on (0.0.0.0: every interface).")]
Port = Annotated[int, typer.Option("--port", help="TCP port.")]
MaxQueue = Annotated[int, typer.Option("--max-queue", help="Images waiting for a slot before requests get 429.")]
Timeout = Annotated[float, typer.Option("--timeout", help="Seconds a request may take before it gets 504 (its "
                                        "images are dropped).")]
ShutdownTimeout = Annotated[float, typer.Option(
    "--shutdown-timeout", help="Seconds from SIGTERM / SIGINT to exit: the requests in flight finish "
    "meanwhile (still listening: /ready 503, new requests 503); 2 s before the end those left are given up "
    "(503). Keep it under the pod's terminationGracePeriodSeconds (Kubernetes' default 30).")]
MaxRequestBytes = Annotated[int, typer.Option("--max-request-bytes", help="Largest request body; a larger one gets "
                                              "413.")]
ServedModelName = Annotated[Optional[List[str]], typer.Option(
    "--served-model-name", help="The model's name in the API (GET /v1/models, a request's 'model'); "
    "repeat it or separate by commas for aliases (default: the model's own name).")]
ApiKey = Annotated[Optional[str], typer.Option(
    "--api-key", envvar="LANTERN_API_KEY", show_envvar=True, help="Require 'Authorization: Bearer KEY' on /v1/* "
    "(401 otherwise); /health, /ready and /metrics stay open. Prefer the environment variable: a flag shows in the "
    "process list.")]
AllowedOrigins = Annotated[Optional[List[str]], typer.Option(
    "--allowed-origins", help="Browser origins allowed by CORS (https://app.example.com, or *); repeat "
    "it or separate by commas. Default: none (no CORS headers).")]
RootPath = Annotated[str, typer.Option("--root-path", help="The path prefix a proxy serves this under (e.g. "
                                       "/lantern), for the docs' links.")]
DisableDocs = Annotated[bool, typer.Option("--disable-docs", help="Serve no /docs, /redoc or /openapi.json.")]
DisableUi = Annotated[bool, typer.Option("--disable-ui", help="Serve no web page at / (the API only).")]


@app.command("serve")
@opt.with_method_options()
@opt.with_model_options
def serve(
    host: Host = "127.0.0.1",
    port: Port = 8000,
    max_queue: MaxQueue = 64,
    timeout: Timeout = 600.0,
    shutdown_timeout: ShutdownTimeout = 25.0,
    max_request_bytes: MaxRequestBytes = 1 << 20,
    served_model_name: ServedModelName = None,
    api_key: ApiKey = None,
    allowed_origins: AllowedOrigins = None,
    root_path: RootPath = "",
    disable_docs: DisableDocs = False,
    disable_ui: DisableUi = False,
    source: opt.ModelSource = None,  # every model option (opt.MODEL_OPTIONS)
    t5_path: opt.T5Path = None,
    prompt_length: opt.PromptLength = None,
    device: opt.Device = "auto",
    profile_name: opt.ProfileName = None,
    graph: opt.Graph = None,
    dtype: opt.Dtype = None,
    method: opt.Method = None,
    flags: opt.MethodFlags = None,  # every method option (runtime.config.method_options)
    attention: opt.Attention = "auto",
    batch_size: opt.BatchSize = None,
) -> None:
    """Serve image generation over HTTP (OpenAI images API, continuous batching, /metrics)."""
    from runtime.generation.generator import ImageGenerator
    from runtime.models.layers import set_attention_kernel

    if not 0 < port < 65536:
        raise UserError(f"--port must be in [1, 65535], got {port}")
    if max_queue < 1:
        raise UserError(f"--max-queue must be >= 1, got {max_queue}")
    if not timeout > 0:
        raise UserError(f"--timeout must be > 0 seconds, got {timeout}")
    http = _http_options(shutdown_timeout, max_request_bytes, api_key, allowed_origins, root_path, disable_docs,
                         disable_ui)
    names = _check_listening(host, port, http.api_key is None, served_model_name)
    gen = ImageGenerator.from_source(source, flags.as_dict(), device=device, profile=profile_name, dtype=dtype,
                                     graph=graph, method=method, attention=attention, batch_size=batch_size,
                                     t5_path=t5_path)
    set_attention_kernel(attention)  # the engine thread decodes with it for the server's life
    web, engine, served = _build(gen, prompt_length, max_queue, timeout, names, http)
    _say_where(host, port, root_path, served, gen, http)
    _listen(web, engine, served, host, port, root_path, shutdown_timeout)


def _check_listening(host: str, port: int, open_api: bool, served_model_name: List[str] | None) -> list[str]:
    """Before minutes of loading and capture: the address is this host's and free, the serve
    extra is installed, the served names are sound (returned); a warning for an open API off
    loopback."""
    import logging

    _check_address(host, port)
    if open_api and host not in ("127.0.0.1", "localhost", "::1"):
        logging.getLogger("runtime.serve").warning(
            "serving on %s without an API key: whoever reaches this address can generate; set LANTERN_API_KEY "
            "(or put the server behind a proxy that authenticates)", host)
    names = _split(served_model_name)
    if any(not n.strip() or len(n) > 256 for n in names):
        raise UserError("--served-model-name: each name must be 1 to 256 characters (no empty name between commas)")
    try:
        import uvicorn  # noqa: F401 - is the serve extra installed? (runtime.serve.drain uses it)
    except ImportError:
        raise UserError("runtime serve needs the serve extra: pip install 'lantern-runtime[serve]' "
                        "(FastAPI, uvicorn, prometheus-client)") from None
    return names


def _build(gen: Any, prompt_length: int | None, max_queue: int, timeout: float, names: list[str], http: Any) -> Any:
    """(app, engine, served) over the generator's model and resolved method (each method of the
    profile's [auto] table for --method auto)."""
    from runtime.serve import AutoMethods, build_server

    batch = gen.default_batch
    auto = AutoMethods(gen.auto_specs(), gen.auto_table) if gen.auto else None
    spec = next(iter(auto.specs.values())) if auto is not None else gen.spec_for(batch)
    return build_server(gen.loaded, spec, gen.backend, batch_size=batch, max_queue=max_queue, timeout_s=timeout,
                        auto=auto, names=names or None, http=http, conditioner=_conditioner(gen, prompt_length))


def _say_where(host: str, port: int, root_path: str, served: Any, gen: Any, http: Any) -> None:
    """The one line naming the address, model, method and device (unless -q)."""
    import logging

    if logging.getLogger("runtime.serve").isEnabledFor(logging.WARNING):
        where = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
        proxied = f" behind a proxy at {root_path}" if root_path else ""
        print(f"runtime serve: {where}{proxied} (OpenAI images API at /v1), model {', '.join(served.names)}, method "
              f"{served.method}, device {gen.backend.device}, batch {gen.default_batch}"
              f"{', API key required' if http.api_key else ''}; /ready answers 200 once the steps are captured",
              file=sys.stderr, flush=True)


def _listen(web: Any, engine: Any, served: Any, host: str, port: int, root_path: str, shutdown_timeout: float) -> None:
    """Serve until SIGTERM / SIGINT, drain, and exit with the signal's code."""
    from runtime.serve.drain import DrainingServer, server_config

    server = DrainingServer(server_config(web, host=host, port=port, root_path=root_path), served,
                            shutdown_timeout)
    try:
        server.run()
    except SystemExit as failed:  # uvicorn could not start (it logged why): no teardown with the engine running
        engine.stop(drain=False, timeout=0.1)
        _exit_now(failed.code if isinstance(failed.code, int) else 1)
    finally:
        # a warm-up still capturing is not waited for (the engine thread is a daemon)
        engine.stop(drain=False, timeout=(served.time_left() or 1.0) if engine.ready.is_set() else 0.1)
    if server.signals:  # drained: 0 after SIGTERM, 130 (interrupted, as every command) after Ctrl-C
        if signal.SIGINT in server.signals:
            print("interrupted by SIGINT: " + ("stopped; the requests in flight were answered 503" if served.abandoned
                                               else "drained and stopped"), file=sys.stderr)
        _exit_now(130 if signal.SIGINT in server.signals else 0)


def _exit_now(code: int) -> None:
    """End the process with `code` once the drain is done, skipping the interpreter's teardown:
    collecting a captured model's objects takes seconds on a busy CPU, and an engine thread
    still capturing its steps (a SIGTERM during a --graph warm-up) would hold the exit past
    --shutdown-timeout. Nothing is left to write: every answer has been sent."""
    import logging
    import os

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _check_address(host: str, port: int) -> None:
    """Refuse, with one line, an address this process cannot listen on (taken, or not this host's)."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        raise UserError(f"--host {host!r}: {err.strerror}; give an address of this machine (0.0.0.0: every "
                        "interface)") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind(address)
        except OSError as err:
            raise UserError(f"cannot listen on {host}:{port}: {err.strerror}; choose another --port or stop what "
                            "listens there") from None


def _split(values: List[str] | None) -> list[str]:
    """Repeated options, each possibly comma-separated, as one list."""
    return [part.strip() for value in values or () for part in value.split(",")]


ORIGIN = re.compile(r"https?://[^/\s,]+")


def _http_options(shutdown_timeout: float, max_request_bytes: int, api_key: str | None,
                  allowed_origins: List[str] | None, root_path: str, disable_docs: bool,
                  disable_ui: bool) -> Any:
    """The HTTP flags checked (one line naming the flag and the fix) and gathered."""
    import os

    from runtime.serve.api import HttpOptions

    if not 0 < shutdown_timeout <= 3600:
        raise UserError(f"--shutdown-timeout must be in (0, 3600] seconds, got {shutdown_timeout:g}")
    if max_request_bytes < 1024:
        raise UserError(f"--max-request-bytes must be at least 1024, got {max_request_bytes}")
    if api_key is None and os.environ.get("LANTERN_API_KEY") is not None:  # set but empty: click reads no value
        raise UserError("LANTERN_API_KEY is set but empty (a Secret mounted empty?), which would serve the API "
                        "to anyone; put the key in it, or unset it to serve without a key")
    if api_key is not None and (not api_key.strip() or api_key != api_key.strip()):
        raise UserError("--api-key / LANTERN_API_KEY is empty or has surrounding spaces; give the key itself")
    origins = _split(allowed_origins)
    for origin in origins:
        if origin != "*" and not ORIGIN.fullmatch(origin):
            raise UserError(f"--allowed-origins: {origin!r} is no origin; give scheme://host[:port] "
                            "(https://app.example.com, no path) or *")
    if root_path and (not root_path.startswith("/") or root_path.endswith("/")):
        raise UserError(f"--root-path {root_path!r}: start it with / and end it without one (e.g. /lantern)")
    return HttpOptions(api_key=api_key, allowed_origins=tuple(origins), docs=not disable_docs, ui=not disable_ui,
                       max_request_bytes=max_request_bytes)


DEFAULT_PROMPT_LENGTH = 64  # Chameleon prompts: tokens every captured step is built for


def _conditioner(gen: Any, prompt_length: int | None) -> Any:
    """How the served model reads a text prompt (None: class ids and names). Sets a Chameleon
    target's prompt length before its decoders are built."""
    from runtime.generation.workload import resolve_prompt_length
    from runtime.serve.conditions import Captions, TokenPrompts

    loaded, backend = gen.loaded, gen.backend
    kind = loaded.config.model_type
    length = resolve_prompt_length(prompt_length, kind, DEFAULT_PROMPT_LENGTH if kind == "chameleon" else None)
    if kind == "t2i" and gen.captions is not None:
        return Captions(gen.captions, backend.device, backend.dtype)
    if kind == "chameleon":
        if prompt_length is None:  # the unconditional prompt must fit (Emu3's negative prompt)
            length = max(length, getattr(loaded.prompt_encoder, "min_length", 2))
        loaded.target.for_prompts(length)
        return TokenPrompts(loaded.prompt_encoder, length, backend.device)
    return None
