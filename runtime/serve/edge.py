"""The HTTP edge of `runtime serve`, below the routes: OpenAI's error body for every answer that
is not a success, the request id, the access log, the request-size limit and bearer auth.

Every error, the framework's included (404, 405, 413, a body that is no JSON, an unexpected
500), is `{"error": {"message", "type", "param", "code"}}` with one line naming the problem and
the fix, and never repeats more than `ECHO_CHARS` of what the client sent.

The middlewares are plain ASGI (no per-request thread, nothing buffered but a request body of
unknown length, and that only up to the limit), outermost first:

    RequestContext   X-Request-ID on every answer (the client's, or a new one), the access log
                     line at -v, requests counted by status, generation requests in flight (the
                     drain waits for them), and a 500 in OpenAI's shape for an unexpected error
    CORS             Starlette's CORSMiddleware (`JsonCors`: a refused preflight in OpenAI's error
                     body too), only with --allowed-origins
    BearerAuth       /v1/* needs `Authorization: Bearer KEY` with --api-key; probes and /metrics open
    BodyLimit        413 past --max-request-bytes (Content-Length, or counted as it arrives)
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import time
import uuid
from typing import Awaitable, Callable, Mapping, Protocol, TypedDict

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

ECHO_CHARS = 60  # the most of anything a client sent that an error message repeats
DEFAULT_MAX_REQUEST_BYTES = 1 << 20  # a request body past this gets 413 (--max-request-bytes)
REQUEST_ID_HEADER = "x-request-id"
_CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._:/+=-]{1,128}")  # a client's id is kept only if it is this tame

_access = logging.getLogger("runtime.serve.access")
_log = logging.getLogger("runtime.serve")

# OpenAI's error `type` for each status this server answers
ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
               405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
               500: "server_error", 503: "server_error", 504: "server_error"}


def cut(text: str) -> str:
    """`text` shortened for an error message (at most ECHO_CHARS of it, and its length)."""
    return text if len(text) <= ECHO_CHARS else text[:ECHO_CHARS] + f"... ({len(text)} characters)"


class ErrorFields(TypedDict):
    """The fields of OpenAI's error object."""

    message: str
    type: str
    param: str | None
    code: str | None


class ErrorPayload(TypedDict):
    """OpenAI's error body: `{"error": ErrorFields}`."""

    error: ErrorFields


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> ErrorPayload:
    """OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def error_response(status: int, message: str, *, param: str | None = None, code: str | None = None,
                   headers: Mapping[str, str] | None = None) -> JSONResponse:
    """A JSONResponse carrying `error_body`."""
    return JSONResponse(error_body(status, message, param=param, code=code), status_code=status, headers=headers)


async def _send_error(send: Send, status: int, message: str, *,
                      code: str | None = None, headers: dict[str, str] | None = None) -> None:
    """Answer an error from a middleware (no Response object: plain ASGI messages)."""
    body = json.dumps(error_body(status, message, code=code)).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


def route_path(scope: Scope) -> str:
    """The path the routes see: without --root-path where the server put it in front."""
    path, root = str(scope.get("path", "")), str(scope.get("root_path", ""))
    return path[len(root):] if root and path.startswith(root) else path


def is_api(scope: Scope) -> bool:
    """Whether a request is to the OpenAI API (/v1/...), as opposed to probes, metrics and docs."""
    return route_path(scope).startswith("/v1/")


class InFlight(Protocol):
    """What `RequestContext` keeps count in (`api.Served`): the API requests in flight."""

    in_flight: int


class RequestContext:
    """The outermost middleware: a request id for every answer and log line, the access log
    (at -v, one record per request: id, client address, HTTP method, path, status, images made,
    the decoding method, seconds; as fields of a `--log-format json` line too),
    the request counter by status and the count of API requests in flight (`served.in_flight`:
    the drain waits for it to reach 0). An exception no route handled becomes OpenAI's 500 here
    (its traceback goes to the log, not to the client)."""

    def __init__(self, app: ASGIApp, served: InFlight, count: Callable[[int], None] | None = None) -> None:
        self.app, self.served, self.count = app, served, count

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers") or ()).get(REQUEST_ID_HEADER.encode(), b"").decode("latin-1")
        rid = given if _CLIENT_REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_id"], state["images"], state["method"] = rid, 0, "-"
        status = [0]
        api = is_api(scope)
        started = time.perf_counter()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message = {**message, "headers": [*message.get("headers", ()),
                                                  (REQUEST_ID_HEADER.encode(), rid.encode())]}
            await send(message)

        if api:
            self.served.in_flight += 1
        try:
            await self.app(scope, receive, send_with_id)
        except Exception:  # noqa: BLE001 - the client gets OpenAI's 500, the log the traceback
            _log.exception("request %s: unexpected error", rid)
            if status[0] == 0:
                status[0] = 500
                await _send_error(send, 500, f"internal server error (request id {rid}); the server's log "
                                  "has the details", headers={REQUEST_ID_HEADER: rid})
        finally:
            if api:
                self.served.in_flight -= 1
            if api and self.count is not None:
                self.count(status[0])
            client = scope.get("client")
            fields = {"request_id": rid, "client": f"{client[0]}:{client[1]}" if client else "-",
                      "http_method": scope.get("method", "?"), "path": cut(route_path(scope)), "status": status[0],
                      "images": state.get("images", 0), "method": state.get("method", "-"),
                      "seconds": round(time.perf_counter() - started, 3)}
            _access.info("%(request_id)s %(client)s %(http_method)s %(path)s %(status)d images=%(images)d "
                         "method=%(method)s %(seconds).3fs", fields, extra=fields)


class BearerAuth:
    """/v1/* needs `Authorization: Bearer <api_key>` (compared in constant time); anything else
    is open (probes must work without the key, Prometheus scrapes without it)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app, self.key = app, api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_api(scope) or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        header = dict(scope.get("headers") or ()).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer" or not token:
            await _send_error(send, 401, "no API key: send the header 'Authorization: Bearer KEY' (the server's "
                              "--api-key / LANTERN_API_KEY)", code="invalid_api_key",
                              headers={"WWW-Authenticate": "Bearer"})
            return
        if not secrets.compare_digest(token.strip(), self.key):
            await _send_error(send, 401, "incorrect API key: give the key the server was started with "
                              "(--api-key / LANTERN_API_KEY)", code="invalid_api_key",
                              headers={"WWW-Authenticate": "Bearer"})
            return
        await self.app(scope, receive, send)


class BodyLimit:
    """Request bodies of at most `limit` bytes: 413 at once for a larger Content-Length; a body of
    unknown length (chunked) is read up to the limit, then handed on whole or refused."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    def _refuse(self, send: Send, size: str) -> Awaitable[None]:
        return _send_error(send, 413, f"the request body is {size}, more than this server's limit of {self.limit} "
                           "bytes (--max-request-bytes); send a smaller request", code="request_too_large")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None:
            if length.isdigit() and int(length) > self.limit:
                await self._refuse(send, f"{int(length)} bytes")
                return
            await self.app(scope, receive, send)
            return
        if dict(scope.get("headers") or ()).get(b"transfer-encoding") is None:
            await self.app(scope, receive, send)  # no body
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                await self._refuse(send, "longer")
                return
            if not message.get("more_body", False):
                break
        replay: list[Message] = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def receive_again() -> Message:
            return replay.pop() if replay else await receive()

        await self.app(scope, receive_again, send)


_CORS_FAILURES = {"origin": "its Origin is not among the server's --allowed-origins",
                  "method": "the method it asks for is not allowed", "headers": "a header it asks for is not allowed",
                  "private-network": "it asks for private network access, which this server does not grant"}


class JsonCors(CORSMiddleware):
    """Starlette's CORS middleware, whose refused preflight (`Disallowed CORS origin`, text) is
    answered as every other error: 400 with OpenAI's error body naming what was refused."""

    def preflight_response(self, request_headers: Headers) -> Response:
        answer = super().preflight_response(request_headers)
        if answer.status_code == 200:
            return answer
        failures = bytes(answer.body).decode().removeprefix("Disallowed CORS ").split(", ")
        origin = cut(request_headers.get("origin", ""))
        why = "; ".join(_CORS_FAILURES.get(f, f) for f in failures)
        headers = {k: v for k, v in answer.headers.items() if k.lower() not in ("content-length", "content-type")}
        return error_response(400, f"CORS preflight from {origin} refused: {why}; start the server with that "
                              "origin in --allowed-origins, or call the API from an allowed page",
                              code="cors_refused", headers=headers)
