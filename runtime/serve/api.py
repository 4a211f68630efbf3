"""The HTTP API of `runtime serve`: OpenAI's images and models API on FastAPI, plus health,
readiness, version and Prometheus metrics.

    POST /v1/images/generations   {"prompt": "3" | "stripes", "n": 2, "seed": 7, ...}
        -> {"created": ..., "data": [{"b64_json": PNG, "index": 0, "seed": ..., "stats": {...}}]}
    GET  /v1/models    the served model's names (--served-model-name), as OpenAI lists models
    GET  /health       200 while the process runs (draining included)
    GET  /ready        200 once the steps are captured and warm, 503 before and while draining
    GET  /version      the package version, the model and the method
    GET  /info         what a client needs to build a request: class names or text, size, limits
    GET  /metrics      Prometheus text: queue depth, busy slots, images, tau, latency and queue time
    GET  /             the web page (runtime/serve/static/: a form, the streamed previews; --disable-ui)

Image i of a request with seed S uses the seed `derive_seed(S, i)`, as image i of `runtime run
--seed S` does, so the same request gives the same tokens (and, decoded alone, the same image) as
`runtime run --seed S --classes C --num-images 1`. Sampling settings are those the server's steps
were captured with; a request may restate them (`cfg`, `temperature`, `top_k`) but not change them.
Every error is OpenAI's `{"error": {"message", "type", "param", "code"}}` (runtime/serve/edge.py).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import secrets
import time
import uuid
from dataclasses import dataclass
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
import torch
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from runtime.core import MethodSpec
from runtime.generation.loading import LoadedModel
from runtime.serve.conditions import Conditioner
from runtime.serve.edge import (DEFAULT_MAX_REQUEST_BYTES, BearerAuth, BodyLimit, JsonCors, RequestContext, cut,
                                error_body, error_response, route_path)
from runtime.serve.engine import Done, DoneInfo, Engine, Job, QueueFull
from runtime.serve.metrics import ServeMetrics
from runtime.serve.page import add_page

MAX_IMAGES_PER_REQUEST = 16
MAX_PARTIAL_IMAGES = 3  # previews per image a streamed request may ask for (OpenAI's limit)
RETRY_AFTER_S = 5  # what a request refused while warming up or draining is told to wait


@dataclass(frozen=True)
class HttpOptions:
    """How the API is exposed (`runtime serve`'s HTTP flags). `api_key`: /v1/* needs it as a
    bearer token (None: open); `allowed_origins`: CORS origins (empty: no CORS headers); `docs`:
    serve /docs, /redoc and /openapi.json; `ui`: serve the web page at / (and its files at /ui/);
    `max_request_bytes`: larger bodies get 413."""

    api_key: str | None = None
    allowed_origins: tuple[str, ...] = ()
    docs: bool = True
    ui: bool = True
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES


class ImageRequest(BaseModel):
    """OpenAI's images request, and this server's extensions (`seed`, `return_tokens`, ...).
    Strict: `"n": "2"` or `"n": true` is refused, as OpenAI refuses it."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    prompt: str = Field(..., min_length=1, description="Class-conditional models: a class id ('3') or class "
                        "name ('stripes'). Text-to-image models: the caption.")
    n: int = Field(1, ge=1, le=MAX_IMAGES_PER_REQUEST, description="Images to generate.")
    response_format: Literal["b64_json"] = Field("b64_json", description="Only b64_json: the image bytes, "
                                                 "base64 (this server keeps no files to link to).")
    model: str | None = Field(None, description="Optional: one of the names GET /v1/models lists (another "
                              "answers 404 model_not_found).")
    size: str | None = Field(None, description="Optional: the model's size, e.g. '256x256', or 'auto'.")
    output_format: Literal["png", "jpeg", "webp"] = Field("png", description="The images' encoding.")
    output_compression: int | None = Field(None, ge=0, le=100, description="jpeg / webp quality, 0-100 "
                                           "(default 100); nothing for png, which is lossless.")
    quality: Literal["auto", "standard", "hd", "low", "medium", "high", "xhigh", "max"] | None = Field(
        None, description="Accepted and ignored: a model has one quality here (the captured method and "
        "settings decide it).")
    style: Literal["vivid", "natural"] | None = Field(None, description="Accepted and ignored (DALL-E 3's).")
    background: Literal["auto", "opaque", "transparent"] | None = Field(
        None, description="auto or opaque (what every image is); transparent is refused.")
    moderation: Literal["auto", "low"] | None = Field(None, description="Accepted and ignored: this server "
                                                      "does no moderation.")
    user: str | None = Field(None, description="Accepted and ignored.")
    safety_identifier: str | None = Field(None, description="Accepted and ignored.")
    partial_images: int | None = Field(None, ge=0, le=MAX_PARTIAL_IMAGES, description="With stream=true: "
                                       "previews of each image while it decodes, as `image_generation.partial_image` "
                                       "events (the VQ decode of the tokens committed so far, the rest gray), at "
                                       "1/(P+1), 2/(P+1), ... of its tokens.")
    seed: int | None = Field(None, ge=0, lt=2**63, description="Run seed; image i uses a seed derived from "
                             "(seed, i), as `runtime run --seed`. Default: a random one, returned.")
    cfg: float | None = Field(None, description="Must equal the server's guidance scale if given.")
    temperature: float | None = Field(None, description="Must equal the server's temperature if given.")
    top_k: int | None = Field(None, description="Must equal the server's top-k if given.")
    return_tokens: bool = Field(False, description="Also return each image's VQ tokens.")
    stream: bool = Field(False, description="Server-sent events: `image_generation.progress` (index, "
                         "tokens_done, tokens_total) while an image decodes, `image_generation.partial_image` "
                         "previews when `partial_images` asks, `image_generation.completed` (its ImageData and "
                         "OpenAI's created_at, size, output_format, usage) as each is done, then `data: [DONE]`.")


class ImageStats(BaseModel):
    tau: float = Field(description="Tokens per target forward for this image.")
    latency_s: float = Field(description="Seconds from queued to done.")
    queue_s: float = Field(description="Seconds waiting for a slot.")


class ImageData(BaseModel):
    b64_json: str
    index: int
    seed: int = Field(description="The request's run seed (the one given, or the one drawn for an unseeded "
                      "request): the same request with this seed makes the same images, image `index` from "
                      "`image_seed`.")
    image_seed: int = Field(description="This image's own stream, derived from (seed, index).")
    method: str = Field(description="The method that made this image (with --method auto, chosen by load).")
    reproduce: str = Field(description="The `runtime run` command that makes this image's tokens again offline "
                           "(image `index` of its run), to be given the server's model, device and profile flags "
                           "too: it pins the method and every setting the image was made with.")
    class_id: int | None = None
    revised_prompt: str | None = None
    tokens: list[int] | None = None
    stats: ImageStats


class ImagesResponse(BaseModel):
    created: int
    data: list[ImageData]
    output_format: str = Field(description="png, jpeg or webp, as asked.")
    size: str = Field(description="The images' size, e.g. '256x256'.")


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "lantern-runtime"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ServerInfo(BaseModel):
    """What a client (the web page) needs to build a request and show what answers it."""

    model: str = Field(description="The model's own name (`GET /v1/models` lists every name a request may give).")
    names: list[str] = Field(description="The names a request's `model` may give (--served-model-name).")
    method: str = Field(description="The decoding method (`auto`: chosen by load; each image names its own).")
    version: str = Field(description="The package version.")
    family: str = Field(description="The model's family: c2i or t2i (LlamaGen, the demo), chameleon (Anole, "
                        "Lumina-mGPT), janus or emu3.")
    prompt: Literal["class", "text"] = Field(description="`class`: the prompt is a class id or name; `text`: "
                                             "a caption or prompt.")
    num_classes: int | None = Field(description="Class ids 0..num_classes-1 (class models; null for text).")
    class_names: list[str] | None = Field(description="The classes' names, by id (null: the model names none).")
    size: str = Field(description="The images' size, e.g. '64x64'.")
    tokens_per_image: int = Field(description="VQ tokens per image (what `tokens_total` counts).")
    max_images: int = Field(description="The most images (`n`) one request may ask for.")
    max_partial_images: int = Field(description="The most previews (`partial_images`) per image.")
    api_key_required: bool = Field(description="Whether /v1/* needs `Authorization: Bearer KEY` (--api-key).")


@dataclass(frozen=True)
class Refusal:
    """Why a request cannot be served: its HTTP status, the field at fault and one line."""

    status: int
    param: str | None
    message: str
    code: str | None = None

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return error_response(self.status, self.message, param=self.param, code=self.code, headers=headers)


# OpenAI's image parameters of other models this server refuses by name (not as unknown fields)
OPENAI_UNSUPPORTED = {"complexity", "frame_count", "frame_duration_ms", "svg"}


def _validation_refusal(exc: RequestValidationError) -> Refusal:
    """The first of pydantic's complaints as one line naming the field (400, as OpenAI answers)."""
    first = exc.errors()[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    kind = first.get("type", "")
    if kind == "json_invalid":
        why = (first.get("ctx") or {}).get("error", "not JSON")
        return Refusal(400, None, f"the request body is not valid JSON ({why}); send a JSON object of the "
                       "request's fields with Content-Type: application/json")
    if not loc or (loc and loc[0].isdigit() and kind != "extra_forbidden"):
        if kind == "missing":
            return Refusal(400, None, "the request has no body; send a JSON object of the request's fields "
                           "(at least \"prompt\") with Content-Type: application/json")
        return Refusal(400, None, "the request body must be a JSON object of the request's fields (at least "
                       "\"prompt\") with Content-Type: application/json")
    where = ".".join(loc)
    if kind == "extra_forbidden" and where in OPENAI_UNSUPPORTED:
        return Refusal(400, where, f"{where}: an OpenAI parameter this server does not support (it makes one "
                       "still image from a prompt); drop it")
    message = f"{where}: {first.get('msg', 'invalid')}"
    given = first.get("input")
    if kind not in ("missing", "extra_forbidden") and isinstance(given, (str, int, float, bool)):
        message += f" (got {cut(json.dumps(given))})"
    return Refusal(400, loc[0], message)


def create_app(engine: Engine, served: "Served", http: HttpOptions | None = None) -> FastAPI:
    """The FastAPI application over a started `engine` and what it serves: its middlewares
    (runtime/serve/edge.py), error handlers, probes and metrics, the models, the page and the
    images route."""
    http = http or HttpOptions()
    app = FastAPI(title="lantern-runtime", version=served.version, lifespan=_lifespan(engine, served),
                  description="Speculative visual autoregressive image generation (OpenAI images API).",
                  docs_url="/docs" if http.docs else None, redoc_url="/redoc" if http.docs else None,
                  openapi_url="/openapi.json" if http.docs else None)
    metrics = ServeMetrics(engine, served.method)
    app.state.metrics = metrics
    _add_middleware(app, served, http, metrics)
    _add_error_handlers(app, http)
    _add_probes(app, engine, served, http, metrics)
    if http.ui:
        add_page(app)
    _add_models(app, served)
    _add_generation(app, engine, served, metrics)
    return app


def _lifespan(engine: Engine, served: "Served") -> Callable[[FastAPI], contextlib.AbstractAsyncContextManager[None]]:
    """The app's lifespan: at shutdown (the drain, runtime/serve/drain.py, has answered the
    requests in flight) the engine stops."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        served.draining = True
        # a warm-up (minutes of capture under --graph) is not waited for: the engine thread is a daemon
        wait = served.time_left() if engine.ready.is_set() else min(served.time_left() or 0.5, 0.5)
        await asyncio.get_running_loop().run_in_executor(
            None, lambda: engine.stop(drain=not served.abandoned, timeout=wait))

    return lifespan


def _add_middleware(app: FastAPI, served: "Served", http: HttpOptions, metrics: ServeMetrics) -> None:
    """Outermost last: RequestContext, CORS, auth, the body limit (runtime/serve/edge.py)."""
    app.add_middleware(BodyLimit, limit=http.max_request_bytes)
    if http.api_key:
        app.add_middleware(BearerAuth, api_key=http.api_key)
    if http.allowed_origins:
        app.add_middleware(JsonCors, allow_origins=list(http.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["X-Request-ID", "Retry-After"])
    app.add_middleware(RequestContext, served=served, count=metrics.count_request)


def _add_error_handlers(app: FastAPI, http: HttpOptions) -> None:
    """Every error in OpenAI's body: a request that does not validate (400, not FastAPI's 422),
    the framework's 404 and 405."""

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_refusal(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        where = f"{request.method} {cut(route_path(request.scope))}"
        if exc.status_code == 404:
            message = (f"no route {where}; this server answers POST /v1/images/generations, GET /v1/models, "
                       "/health, /ready, /version, /info and /metrics" + (" (and its page at /)" if http.ui else ""))
        elif exc.status_code == 405:
            allowed = (exc.headers or {}).get("Allow", "")
            message = f"{where} is not allowed; use {allowed or 'another method'}"
        else:
            message = str(exc.detail)
        return error_response(exc.status_code, message, headers=exc.headers)


def _add_probes(app: FastAPI, engine: Engine, served: "Served", http: HttpOptions, metrics: ServeMetrics) -> None:
    """/health, /ready, /version, /info and /metrics: open without the API key."""

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "draining" if served.draining else "ok"}

    @app.get("/ready", response_model=None, responses={503: {"model": ErrorBody}})
    async def ready() -> JSONResponse | dict[str, object]:
        if not engine.ready.is_set() or served.draining:
            state = "draining" if served.draining else "warming_up"
            return error_response(503, f"not ready: {state.replace('_', ' ')}", code=state,
                                  headers={"Retry-After": str(RETRY_AFTER_S)})
        return {"status": "ready", "method": served.method, "in_use": engine.current, "model": served.model,
                "batch_size": served.batch_size, "settings": served.public_settings(),
                "compile_keys": {m: d.compile_key for m, d in engine.decoders.items()},
                "bound_warnings": dict(engine.stats.bound_warnings)}

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": served.version, "model": served.model, "method": served.method}

    @app.get("/info", response_model=ServerInfo)
    async def info() -> ServerInfo:
        classes = not served.text
        return ServerInfo(model=served.model, names=served.names, method=served.method, version=served.version,
                          family=served.loaded.family, prompt="class" if classes else "text",
                          num_classes=served.loaded.num_classes if classes else None,
                          class_names=served.loaded.class_names if classes else None,
                          size=served.size, tokens_per_image=engine.decoder.config.num_tokens,
                          max_images=min(MAX_IMAGES_PER_REQUEST, served.max_queue or MAX_IMAGES_PER_REQUEST),
                          max_partial_images=MAX_PARTIAL_IMAGES, api_key_required=http.api_key is not None)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus() -> PlainTextResponse:
        body, content_type = metrics.render()
        return PlainTextResponse(body, media_type=content_type)


def _add_models(app: FastAPI, served: "Served") -> None:
    """OpenAI's model list and model card: the served names (--served-model-name)."""

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=name, created=served.created) for name in served.names])

    @app.get("/v1/models/{model:path}", response_model=ModelCard, responses={404: {"model": ErrorBody}})
    async def model_card(model: str) -> JSONResponse | ModelCard:
        if model not in served.names:
            return served.unknown_model(model).response()
        return ModelCard(id=model, created=served.created)


def _add_generation(app: FastAPI, engine: Engine, served: "Served", metrics: ServeMetrics) -> None:
    """POST /v1/images/generations: OpenAI's images request, answered whole or streamed."""

    @app.post("/v1/images/generations", response_model=ImagesResponse, response_model_exclude_none=True,
              responses={400: {"model": ErrorBody}, 401: {"model": ErrorBody}, 404: {"model": ErrorBody},
                         413: {"model": ErrorBody}, 429: {"model": ErrorBody}, 500: {"model": ErrorBody},
                         503: {"model": ErrorBody}, 504: {"model": ErrorBody}})
    async def generate(body: ImageRequest, request: Request) -> Response | dict[str, object]:
        refusal = served.check(body)
        if refusal is not None:
            return refusal.response()
        if served.draining or not engine.ready.is_set():
            state = "draining" if served.draining else "warming_up"
            return error_response(503, f"the server is {state.replace('_', ' ')}; retry in {RETRY_AFTER_S} s "
                                  "(another replica may answer sooner)", code=state,
                                  headers={"Retry-After": str(RETRY_AFTER_S), "Connection": "close"}
                                  if served.draining else {"Retry-After": str(RETRY_AFTER_S)})
        seed = body.seed if body.seed is not None else secrets.randbelow(2**31)
        rid = request.state.request_id if hasattr(request.state, "request_id") else uuid.uuid4().hex
        if served.conditioner is not None:  # the prompt's condition, shared by the request's images
            cond, mask = await asyncio.get_running_loop().run_in_executor(None, served.conditioner, body.prompt)
            jobs = [Job(rid, i, None, served.image_seed(seed, i), cond=cond, mask=mask) for i in range(body.n)]
        else:
            jobs = [Job(rid, i, served.label(body.prompt), served.image_seed(seed, i)) for i in range(body.n)]
        for job in jobs:
            job.partial_images = body.partial_images or 0
        try:
            engine.submit(jobs)
        except QueueFull as full:
            metrics.rejected.inc()
            return error_response(429, f"{full}; the queue holds at most {engine.scheduler.max_queue} images (--max-queue)",
                                  code="rate_limit_exceeded",
                                  headers={"Retry-After": str(int(full.retry_after + 0.999))})
        except RuntimeError as stopping:
            return error_response(503, f"{stopping}; retry in {RETRY_AFTER_S} s", code="draining",
                                  headers={"Retry-After": str(RETRY_AFTER_S)})
        waiting = [asyncio.wrap_future(job.future) for job in jobs]
        if body.stream:
            request.state.images = body.n
            request.state.method = served.method
            return StreamingResponse(_events(jobs, waiting, body, served, engine, seed),
                                     media_type="text/event-stream")
        try:
            done = await _until_done(waiting, request, served)
        except asyncio.TimeoutError:
            engine.cancel(jobs)
            return error_response(504, f"the images were not done within {served.timeout_s:g} s (--timeout); ask "
                                  "for fewer images or retry when the server is less busy", code="timeout")
        except _Abandoned:
            engine.cancel(jobs)
            return error_response(503, served.abandoned_message(), code="shutdown",
                                  headers={"Retry-After": str(RETRY_AFTER_S), "Connection": "close"})
        except _Disconnected:
            engine.cancel(jobs)
            return error_response(499, "client closed the request", code="cancelled")
        except Exception as err:  # an engine error: this request fails, the server goes on
            engine.cancel(jobs)
            return error_response(500, f"generation failed: {cut(str(err))}", code="generation_failed")
        tokens = [t for t, _ in done]
        encoded = await asyncio.get_running_loop().run_in_executor(
            None, served.encode, tokens, body.output_format, body.output_compression)
        data = [_image_data(job, tok, info, b64, body, served, seed)
                for job, (tok, info), b64 in zip(jobs, done, encoded)]
        request.state.images = len(data)
        request.state.method = ",".join(sorted({d.method for d in data}))
        return ImagesResponse(created=int(time.time()), data=data, output_format=body.output_format,
                              size=served.size).model_dump(exclude_none=True)


class _Abandoned(Exception):
    """The drain's time ran out before this request's images were done."""


class _Disconnected(Exception):
    pass


def _image_data(job: Job, tokens: torch.Tensor, info: DoneInfo, b64: str, body: ImageRequest,
                served: "Served", seed: int) -> ImageData:
    conditioner = served.conditioner
    revised = (served.class_name(job.label) if job.label is not None
               else conditioner.revised(body.prompt) if conditioner is not None else None)
    method = info.get("method", served.method)
    return ImageData(b64_json=b64, index=job.index, seed=seed, image_seed=job.seed, method=method,
                     reproduce=served.reproduce(method, body, seed), class_id=job.label, revised_prompt=revised,
                     tokens=tokens.tolist() if body.return_tokens else None,
                     stats=ImageStats(tau=info["tau"], latency_s=info["latency_s"], queue_s=info["queue_s"]))


PROGRESS_EVERY_S = 0.5  # a streamed request hears of its images' progress at most this often


def _event(kind: str, body: Mapping[str, object]) -> str:
    """One server-sent event, named as OpenAI names its image streaming events."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **body})}\n\n"


async def _events(jobs: list[Job], waiting: list[asyncio.Future[Done]], body: ImageRequest, served: "Served",
                  engine: Engine, seed: int) -> AsyncIterator[str]:
    """Server-sent events: `image_generation.progress` (index, tokens_done, tokens_total) while an
    image decodes, at most every PROGRESS_EVERY_S; with `partial_images` P, up to P
    `image_generation.partial_image` previews per image (OpenAI's fields, `partial_image_index`
    0..P-1, and `index`), the k-th once (k+1)/(P+1) of its tokens are known (an image that finishes
    between two progress reads may have fewer); `image_generation.completed` (its ImageData and
    OpenAI's created_at, size, output_format, background, usage) as each is done, in any order
    (`index` says which); then `data: [DONE]`. An `error` event
    ends the stream early. A client that goes away cancels the request (the generator is closed)."""
    loop = asyncio.get_running_loop()
    total = engine.decoder.config.num_tokens
    pending = dict(zip(waiting, jobs))
    told = {job.index: 0 for job in jobs}
    previews = {job.index: 0 for job in jobs}  # partial images sent per image
    deadline = time.monotonic() + served.timeout_s
    try:
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                yield _event("error", error_body(504, f"the images were not done within {served.timeout_s:g} s "
                                                 "(--timeout)", code="timeout"))
                return
            if served.abandoned:
                yield _event("error", error_body(503, served.abandoned_message(), code="shutdown"))
                return
            done, _ = await asyncio.wait(set(pending), timeout=min(PROGRESS_EVERY_S, left),
                                         return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                job = pending.pop(future)
                try:
                    tokens, info = future.result()
                except Exception as err:  # noqa: BLE001 - an engine error ends this stream only
                    yield _event("error", error_body(500, f"generation failed: {cut(str(err))}",
                                                     code="generation_failed"))
                    return
                (b64,) = await loop.run_in_executor(None, served.encode, [tokens], body.output_format,
                                                    body.output_compression)
                data = _image_data(job, tokens, info, b64, body, served, seed).model_dump(exclude_none=True)
                yield _event("image_generation.completed", {**data, **_openai_completed(job, body, served, total)})
            for job in pending.values():
                if job.tokens_done > told[job.index]:
                    told[job.index] = job.tokens_done
                    yield _event("image_generation.progress",
                                 {"index": job.index, "tokens_done": job.tokens_done, "tokens_total": total,
                                  "steps": job.steps_done})
                committed = job.committed
                shown = previews[job.index]
                if committed is not None and shown < job.partial_images \
                        and len(committed) >= (shown + 1) * total / (job.partial_images + 1):
                    previews[job.index] += 1
                    b64 = await loop.run_in_executor(None, served.preview, committed, total, body.output_format,
                                                     body.output_compression)
                    yield _event("image_generation.partial_image",
                                 {"b64_json": b64, "partial_image_index": shown, "index": job.index,
                                  "tokens_done": len(committed), "created_at": int(time.time()), "size": served.size,
                                  "output_format": body.output_format, "background": "opaque",
                                  "quality": _openai_quality(body)})
        yield "data: [DONE]\n\n"
    finally:
        if not all(f.done() for f in waiting):
            engine.cancel(jobs)


def _openai_quality(body: ImageRequest) -> str:
    """OpenAI's `quality` of an image event: the request's low / medium / high, else auto (one
    quality is made here whatever is asked: the captured method and settings fix it)."""
    return body.quality if body.quality in ("low", "medium", "high") else "auto"


def _openai_completed(job: Job, body: ImageRequest, served: "Served", image_tokens: int) -> dict[str, object]:
    """OpenAI's fields of an `image_generation.completed` event. `usage` counts model tokens: the
    input is the prompt as the model reads it (a class-conditional prompt is one class token; a
    caption or Chameleon prompt its unpadded tokens), the output the image's VQ tokens."""
    prompt_tokens = 1 if job.mask is None else int(job.mask.sum())
    return {"created_at": int(time.time()), "size": served.size, "output_format": body.output_format,
            "background": "opaque", "quality": _openai_quality(body),
            "usage": {"input_tokens": prompt_tokens, "output_tokens": image_tokens,
                      "total_tokens": prompt_tokens + image_tokens,
                      "input_tokens_details": {"text_tokens": prompt_tokens if served.text else 0, "image_tokens": 0}}}


async def _until_done(waiting: list[asyncio.Future[Done]], request: Request, served: "Served") -> list[Done]:
    """The futures' results, checking every 0.25 s whether the client went away or the drain
    gave up on the requests in flight (`_Abandoned`)."""
    gathered = asyncio.gather(*waiting)
    # a gather given up on (cancelled, or its images cancelled) has nobody to read its outcome
    gathered.add_done_callback(lambda f: f.cancelled() or f.exception())
    deadline = time.monotonic() + served.timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            gathered.cancel()
            raise asyncio.TimeoutError
        try:
            return await asyncio.wait_for(asyncio.shield(gathered), timeout=min(0.25, left))
        except asyncio.TimeoutError:
            if served.abandoned:
                gathered.cancel()
                raise _Abandoned from None
            if await request.is_disconnected():
                gathered.cancel()
                raise _Disconnected from None


class Served:
    """What the server serves, and how a request maps onto it."""

    def __init__(self, loaded: LoadedModel, spec: MethodSpec, *, batch_size: int, timeout_s: float, version: str,
                 method: str | None = None, conditioner: Conditioner | None = None, max_queue: int | None = None,
                 names: list[str] | None = None, specs: dict[str, MethodSpec] | None = None) -> None:
        self.loaded, self.spec = loaded, spec
        self.specs = dict(specs) if specs else {spec.method: spec}  # each method an image may come from
        self.names = list(names) if names else [loaded.name]  # what a request's `model` may say
        self.max_queue = max_queue  # a request of more images can never be queued whole
        # models conditioned on text: `conditioner` (runtime/serve/conditions.py) reads the prompt
        self.conditioner = conditioner
        self.model = loaded.name
        self.method = method or spec.method
        self.batch_size = batch_size
        self.timeout_s = timeout_s
        self.version = version
        self.created = int(time.time())
        size = loaded.image_size
        self.size = f"{size}x{size}"
        # the drain (runtime/serve/drain.py): API requests in flight (RequestContext counts them),
        # whether new ones are refused, whether the ones left were given up, and by when the
        # process must be gone (time.monotonic(); None: no drain started)
        self.in_flight = 0
        self.draining = False
        self.abandoned = False
        self.abandoned_why = ""  # why the drain gave up ("--shutdown-timeout 25 s passed", ...)
        self.exit_by: float | None = None

    def time_left(self) -> float | None:
        """Seconds until the drain's end (None: no drain under way, no bound)."""
        return None if self.exit_by is None else max(0.1, self.exit_by - time.monotonic())

    def abandoned_message(self) -> str:
        why = f" ({self.abandoned_why})" if self.abandoned_why else ""
        return f"the server shut down before these images were done{why}; retry (another replica may answer)"

    def unknown_model(self, model: str) -> Refusal:
        """OpenAI's 404 for a model this server does not serve."""
        served = ", ".join(repr(n) for n in self.names)
        return Refusal(404, "model", f"the model {cut(model)!r} does not exist on this server; it serves {served} "
                       "(GET /v1/models lists them)", code="model_not_found")

    def public_settings(self) -> dict[str, object]:
        """The served method's settings as /ready shows them: a tree file by its file name (a
        client learns no path of this machine)."""
        from pathlib import Path

        settings = self.spec.describe()
        if "tree" in settings and self.spec.tree_is_file:
            settings["tree"] = Path(str(settings["tree"])).name
        return settings

    def reproduce(self, method: str, body: ImageRequest, seed: int) -> str:
        """The `runtime run` line that makes a request's images again with `method`'s settings
        as served (under `--method auto`, lantern++ at lambda 1 even where the profile's own
        lantern++ relaxes), image `index` of it being the request's image `index`; a text
        prompt is read from PROMPT_FILE (the prompt on one line)."""
        import shlex

        conditioner = self.conditioner
        prompt = (["--prompts", "PROMPT_FILE", *conditioner.run_flags()] if conditioner is not None
                  else ["--classes", str(self.label(body.prompt))])
        return shlex.join(["runtime", "run", *self.specs[method].cli_args(), "--seed", str(seed), *prompt,
                           "--num-images", str(body.n)])

    def image_seed(self, seed: int, index: int) -> int:
        from runtime.core.rng import derive_seed

        return derive_seed(seed, index)

    def class_name(self, label: int) -> str | None:
        names = self.loaded.class_names
        return names[label] if names is not None and label < len(names) else None

    def label(self, prompt: str) -> int:
        """The class id of a prompt (`check` has accepted it)."""
        text = prompt.strip()
        class_id = _class_id(text)
        if class_id is not None:
            return class_id
        return [n.lower() for n in self.loaded.class_names or ()].index(text.lower())

    @property
    def text(self) -> bool:
        """Whether prompts are text (a conditioner reads them) rather than class ids or names."""
        return self.conditioner is not None

    def check(self, body: ImageRequest) -> Refusal | None:
        """Why a request that parsed cannot be served (an unknown model: 404; anything else: 400
        naming the field), or None."""
        if body.model is not None and body.model not in self.names:
            return self.unknown_model(body.model)
        text = body.prompt.strip()
        problem = self.conditioner.check(text) if self.conditioner is not None else self._check_class(text)
        if problem is None:
            problem = self._check_settings(body)
        if problem is None:
            return None
        field = problem.split(":", 1)[0]
        return Refusal(400, field if field in ImageRequest.model_fields else None, problem)

    def _check_class(self, text: str) -> str | None:
        n_classes = self.loaded.num_classes
        class_id = _class_id(text)
        if class_id is not None:
            if class_id >= n_classes:
                return f"prompt: class {class_id} is out of range; this model has classes 0..{n_classes - 1}"
        else:
            names = self.loaded.class_names
            if names is None or text.lower() not in [n.lower() for n in names]:
                known = f"one of {', '.join(names)}" if names else f"a class id 0..{n_classes - 1}"
                return f"prompt: {cut(text)!r} is no class of this model; give {known}"
        return None

    def _check_settings(self, body: ImageRequest) -> str | None:
        if self.max_queue is not None and body.n > self.max_queue:
            return (f"n: {body.n} images can never be queued together on this server (--max-queue "
                    f"{self.max_queue}); ask for at most {self.max_queue} per request")
        if body.size is not None and body.size not in (self.size, "auto"):
            return f"size: this model makes {self.size} images, not {cut(body.size)}; give {self.size!r} or 'auto'"
        if body.partial_images and not body.stream:
            return ("partial_images: previews are sent as events of a stream; give stream=true, or omit "
                    "partial_images")
        if body.background == "transparent":
            return ("background: this model draws opaque images, it cannot make a transparent background; "
                    "give 'opaque' or 'auto'")
        s = self.spec.sampling
        for name, given, actual in (("cfg", body.cfg, s.cfg), ("temperature", body.temperature, s.temperature),
                                    ("top_k", body.top_k, s.top_k)):
            if given is not None and given != actual:
                return (f"{name}: this server's steps were captured at {name} {actual:g}; omit it or restart "
                        f"the server with --{name.replace('_', '-')} {given:g}")
        return None

    def preview(self, known: torch.Tensor, total: int, output_format: str = "png", compression: int | None = None) -> str:
        """An image still decoding (base64): the VQ decode of its first tokens `known` (k,) with
        the rest set to code 0, and the pixels of the positions not yet known painted gray. An AR
        model draws in raster order, so the known part is the top rows (and part of the next)."""

        tokens = torch.zeros(total, dtype=torch.long)
        tokens[: len(known)] = torch.as_tensor(known)
        return self.encode([tokens], output_format, compression, unknown_from=len(known))[0]

    def encode(self, tokens: Sequence[torch.Tensor | Sequence[int]], output_format: str = "png", compression: int | None = None,
               unknown_from: int | None = None) -> list[str]:
        """The image file (base64) of each image's tokens, each decoded on its own (as `runtime
        run` decodes a one-image run): PNG (lossless, as `runtime run` writes), or JPEG / WebP at
        quality `compression` (0-100, default 100)."""
        from PIL import Image

        from runtime.generation.pipeline import decode_tokens

        out = []
        for t in tokens:
            image = decode_tokens(self.loaded.vq, torch.as_tensor(t)[None])[0]
            if unknown_from is not None:  # a preview: gray where the tokens are not known yet
                image = image.copy()
                grid = int(round(len(t) ** 0.5))
                patch = image.shape[0] // grid
                row, col = divmod(unknown_from, grid)
                image[(row + 1) * patch:] = 128
                image[row * patch:(row + 1) * patch, col * patch:] = 128
            buf = io.BytesIO()
            if output_format == "png":
                Image.fromarray(image).save(buf, format="PNG")
            else:
                quality = 100 if compression is None else compression
                Image.fromarray(image).save(buf, format="JPEG" if output_format == "jpeg" else "WEBP", quality=quality)
            out.append(base64.b64encode(buf.getvalue()).decode("ascii"))
        return out


CLASS_ID_DIGITS = 9  # a class id is ASCII digits, at most this many (ImageNet's ids have 3)


def _class_id(text: str) -> int | None:
    """The class id `text` spells (ASCII digits only: "٣" or "²" are no ids), or None."""
    if text.isascii() and text.isdigit() and len(text) <= CLASS_ID_DIGITS:
        return int(text)
    return None

