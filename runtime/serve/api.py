"""The HTTP API of `runtime serve`: OpenAI's images API on FastAPI, plus health, readiness and
Prometheus metrics.

    POST /v1/images/generations   {"prompt": "3" | "stripes", "n": 2, "seed": 7, ...}
        -> {"created": ..., "data": [{"b64_json": PNG, "index": 0, "seed": ..., "stats": {...}}]}
    GET  /health    200 while the process runs
    GET  /ready     200 once the steps are captured and warm, 503 before and while draining
    GET  /metrics   Prometheus text: queue depth, busy slots, images, tau, latency and queue time

Image i of a request with seed S uses the seed `derive_seed(S, i)`, as image i of `runtime run
--seed S` does, so the same request gives the same tokens (and, decoded alone, the same image) as
`runtime run --seed S --classes C --num-images 1`. Sampling settings are those the server's steps
were captured with; a request may restate them (`cfg`, `temperature`, `top_k`) but not change them.
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
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from runtime.serve.engine import Engine, Job, QueueFull
from runtime.serve.metrics import ServeMetrics

MAX_IMAGES_PER_REQUEST = 16


class ImageRequest(BaseModel):
    """OpenAI's images request, and this server's extensions (`seed`, `return_tokens`, ...)."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(..., min_length=1, description="Class-conditional models: a class id ('3') or class "
                        "name ('stripes'). Text-to-image models: the caption.")
    n: int = Field(1, ge=1, le=MAX_IMAGES_PER_REQUEST, description="Images to generate.")
    response_format: Literal["b64_json"] = Field("b64_json", description="Only b64_json: PNG bytes, base64.")
    model: str | None = Field(None, description="Ignored unless given: must name the model being served.")
    size: str | None = Field(None, description="Ignored unless given: must be the model's size, e.g. '256x256'.")
    seed: int | None = Field(None, ge=0, lt=2**63, description="Run seed; image i uses a seed derived from "
                             "(seed, i), as `runtime run --seed`. Default: a random one, returned.")
    cfg: float | None = Field(None, description="Must equal the server's guidance scale if given.")
    temperature: float | None = Field(None, description="Must equal the server's temperature if given.")
    top_k: int | None = Field(None, description="Must equal the server's top-k if given.")
    return_tokens: bool = Field(False, description="Also return each image's VQ tokens.")
    stream: bool = Field(False, description="Server-sent events: `image_generation.progress` (index, "
                         "tokens_done, tokens_total) while an image decodes, `image_generation.completed` (its "
                         "ImageData) as each is done, then `data: [DONE]`.")
    user: str | None = None


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
    class_id: int | None = None
    revised_prompt: str | None = None
    tokens: list[int] | None = None
    stats: ImageStats


class ImagesResponse(BaseModel):
    created: int
    data: list[ImageData]


class ErrorBody(BaseModel):
    error: dict[str, Any]


def create_app(engine: Engine, served: "Served") -> Any:
    """The FastAPI application over a started `engine` and what it serves."""
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):  # type: ignore[no-untyped-def]
        yield
        # shutdown: the ASGI server has stopped admitting and finished the requests in flight
        served.draining = True
        await asyncio.get_running_loop().run_in_executor(None, engine.stop)

    app = FastAPI(title="lantern-runtime", version=served.version, lifespan=lifespan,
                  description="Speculative visual autoregressive image generation (OpenAI images API).")
    metrics = ServeMetrics(engine, served.method)
    app.state.metrics = metrics

    def error(status: int, message: str, kind: str, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": kind}}, status_code=status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return error(422, f"{where}: {first.get('msg', 'invalid')}" if where else first.get("msg", "invalid"),
                     "invalid_request_error")

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready", responses={503: {"model": ErrorBody}})
    async def ready() -> Any:
        if not engine.ready.is_set() or served.draining:
            return error(503, "warming up" if not engine.ready.is_set() else "draining", "unavailable")
        return {"status": "ready", "method": served.method, "in_use": engine.current, "model": served.model,
                "batch_size": served.batch_size, "settings": served.spec.describe(),
                "compile_keys": {m: d.compile_key for m, d in engine.decoders.items()},
                "bound_warnings": dict(engine.stats.bound_warnings)}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus() -> PlainTextResponse:
        body, content_type = metrics.render()
        return PlainTextResponse(body, media_type=content_type)

    @app.post("/v1/images/generations", response_model=ImagesResponse, response_model_exclude_none=True,
              responses={422: {"model": ErrorBody}, 429: {"model": ErrorBody}, 503: {"model": ErrorBody},
                         504: {"model": ErrorBody}})
    async def generate(body: ImageRequest, request: Request) -> Any:
        problem = served.check(body)
        if problem is not None:
            return error(422, problem, "invalid_request_error")
        if served.draining or not engine.ready.is_set():
            return error(503, "the server is not ready (warming up or draining)", "unavailable",
                         {"Retry-After": "5"})
        seed = body.seed if body.seed is not None else secrets.randbelow(2**31)
        rid = uuid.uuid4().hex
        if served.text:  # the prompt's condition, shared by the request's images
            cond, mask = await asyncio.get_running_loop().run_in_executor(None, served.conditioner, body.prompt)
            jobs = [Job(rid, i, None, served.image_seed(seed, i), cond=cond, mask=mask) for i in range(body.n)]
        else:
            jobs = [Job(rid, i, served.label(body.prompt), served.image_seed(seed, i)) for i in range(body.n)]
        try:
            engine.submit(jobs)
        except QueueFull as full:
            metrics.rejected.inc()
            return error(429, str(full), "rate_limit_error", {"Retry-After": str(int(full.retry_after + 0.999))})
        except RuntimeError as stopping:
            return error(503, str(stopping), "unavailable")
        waiting = [asyncio.wrap_future(job.future) for job in jobs]
        if body.stream:
            return StreamingResponse(_events(jobs, waiting, body, served, engine, seed),
                                     media_type="text/event-stream")
        try:
            done = await _until_done(waiting, request, served.timeout_s)
        except asyncio.TimeoutError:
            engine.cancel(jobs)
            return error(504, f"the images were not done within {served.timeout_s:g} s", "timeout")
        except _Disconnected:
            engine.cancel(jobs)
            return error(499, "client closed the request", "cancelled")
        except Exception as err:  # an engine error: this request fails, the server goes on
            engine.cancel(jobs)
            return error(500, f"generation failed: {err}", "server_error")
        tokens = [t for t, _ in done]
        pngs = await asyncio.get_running_loop().run_in_executor(None, served.encode, tokens)
        data = [_image_data(job, tok, info, png, body, served, seed)
                for job, (tok, info), png in zip(jobs, done, pngs)]
        return ImagesResponse(created=int(time.time()), data=data).model_dump(exclude_none=True)

    return app


class _Disconnected(Exception):
    pass


def _image_data(job: Job, tokens: Any, info: dict[str, Any], png: str, body: ImageRequest,
                served: "Served", seed: int) -> ImageData:
    revised = served.class_name(job.label) if job.label is not None else served.conditioner.revised(body.prompt)
    return ImageData(b64_json=png, index=job.index, seed=seed, image_seed=job.seed, method=info.get("method", "?"),
                     class_id=job.label, revised_prompt=revised,
                     tokens=tokens.tolist() if body.return_tokens else None,
                     stats=ImageStats(tau=info["tau"], latency_s=info["latency_s"], queue_s=info["queue_s"]))


PROGRESS_EVERY_S = 0.5  # a streamed request hears of its images' progress at most this often


def _event(kind: str, body: dict[str, Any]) -> str:
    """One server-sent event, named as OpenAI names its image streaming events."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **body})}\n\n"


async def _events(jobs: list[Job], waiting: list[asyncio.Future], body: ImageRequest, served: "Served",
                  engine: Engine, seed: int):  # type: ignore[no-untyped-def]
    """Server-sent events: `image_generation.progress` (index, tokens_done, tokens_total) while an
    image decodes, at most every PROGRESS_EVERY_S; `image_generation.completed` (its ImageData)
    as each is done, in any order (`index` says which); then `data: [DONE]`. An `error` event
    ends the stream early. A client that goes away cancels the request (the generator is closed)."""
    loop = asyncio.get_running_loop()
    total = engine.decoder.num_tokens
    pending = dict(zip(waiting, jobs))
    told = {job.index: 0 for job in jobs}
    deadline = time.monotonic() + served.timeout_s
    try:
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                yield _event("error", {"error": {"message": f"the images were not done within {served.timeout_s:g} s",
                                                 "type": "timeout"}})
                return
            done, _ = await asyncio.wait(set(pending), timeout=min(PROGRESS_EVERY_S, left),
                                         return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                job = pending.pop(future)
                try:
                    tokens, info = future.result()
                except Exception as err:  # noqa: BLE001 - an engine error ends this stream only
                    yield _event("error", {"error": {"message": f"generation failed: {err}", "type": "server_error"}})
                    return
                (png,) = await loop.run_in_executor(None, served.encode, [tokens])
                data = _image_data(job, tokens, info, png, body, served, seed).model_dump(exclude_none=True)
                yield _event("image_generation.completed", data)
            for job in pending.values():
                if job.tokens_done > told[job.index]:
                    told[job.index] = job.tokens_done
                    yield _event("image_generation.progress",
                                 {"index": job.index, "tokens_done": job.tokens_done, "tokens_total": total})
        yield "data: [DONE]\n\n"
    finally:
        if not all(f.done() for f in waiting):
            engine.cancel(jobs)


async def _until_done(waiting: list[asyncio.Future], request: Any, timeout_s: float) -> list[Any]:
    """The futures' results, checking every 0.25 s whether the client went away."""
    gathered = asyncio.gather(*waiting)
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            gathered.cancel()
            raise asyncio.TimeoutError
        try:
            return await asyncio.wait_for(asyncio.shield(gathered), timeout=min(0.25, left))
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                gathered.cancel()
                raise _Disconnected from None


class Served:
    """What the server serves, and how a request maps onto it."""

    def __init__(self, loaded: Any, spec: Any, *, batch_size: int, timeout_s: float, version: str,
                 method: str | None = None, conditioner: Any = None, max_queue: int | None = None) -> None:
        self.loaded, self.spec = loaded, spec
        self.max_queue = max_queue  # a request of more images can never be queued whole
        # models conditioned on text: `conditioner` (runtime/serve/conditions.py) reads the prompt
        self.conditioner = conditioner
        self.model = loaded.name
        self.method = method or spec.method
        self.batch_size = batch_size
        self.timeout_s = timeout_s
        self.version = version
        self.draining = False
        size = loaded.image_size
        self.size = f"{size}x{size}"

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
        return [n.lower() for n in self.loaded.class_names].index(text.lower())

    @property
    def text(self) -> bool:
        """Whether prompts are text (a conditioner reads them) rather than class ids or names."""
        return self.conditioner is not None

    def check(self, body: ImageRequest) -> str | None:
        """One line naming what a valid request cannot have, or None."""
        text = body.prompt.strip()
        problem = self.conditioner.check(text) if self.text else self._check_class(text)
        return problem if problem is not None else self._check_settings(body)

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
                return f"prompt: {_cut(text)!r} is no class of this model; give {known}"
        return None

    def _check_settings(self, body: ImageRequest) -> str | None:
        if self.max_queue is not None and body.n > self.max_queue:
            return (f"n: {body.n} images can never be queued together on this server (--max-queue "
                    f"{self.max_queue}); ask for at most {self.max_queue} per request")
        if body.model is not None and body.model != self.model:
            return f"model: this server serves {self.model!r}, not {body.model!r}"
        if body.size is not None and body.size != self.size:
            return f"size: this model makes {self.size} images, not {body.size}"
        s = self.spec.sampling
        for name, given, actual in (("cfg", body.cfg, s.cfg), ("temperature", body.temperature, s.temperature),
                                    ("top_k", body.top_k, s.top_k)):
            if given is not None and given != actual:
                return (f"{name}: this server's steps were captured at {name} {actual:g}; omit it or restart "
                        f"the server with --{name.replace('_', '-')} {given:g}")
        return None

    def encode(self, tokens: list[Any]) -> list[str]:
        """PNG bytes (base64) of each image's tokens, each decoded on its own (as `runtime run`
        decodes a one-image run)."""
        import torch
        from PIL import Image

        from runtime.pipeline import decode_tokens

        out = []
        for t in tokens:
            image = decode_tokens(self.loaded.vq, torch.as_tensor(t)[None])[0]
            buf = io.BytesIO()
            Image.fromarray(image).save(buf, format="PNG")
            out.append(base64.b64encode(buf.getvalue()).decode("ascii"))
        return out


CLASS_ID_DIGITS = 9  # a class id is ASCII digits, at most this many (ImageNet's ids have 3)
ECHO_CHARS = 60  # the most of a prompt an error message repeats


def _class_id(text: str) -> int | None:
    """The class id `text` spells (ASCII digits only: "٣" or "²" are no ids), or None."""
    if text.isascii() and text.isdigit() and len(text) <= CLASS_ID_DIGITS:
        return int(text)
    return None


def _cut(text: str) -> str:
    """`text` shortened for an error message."""
    return text if len(text) <= ECHO_CHARS else text[:ECHO_CHARS] + f"... ({len(text)} characters)"
