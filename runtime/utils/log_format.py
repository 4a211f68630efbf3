"""How log records reach stderr: `rich` on a terminal, one line per record elsewhere.

A log collector reads a pipe or a container's stderr line by line, so off a terminal every record
is exactly one line (a newline inside a message or a traceback is written as the two characters
`\\n`), and starts with its UTC time:

    plain   2026-11-28T06:31:07.123Z WARNING runtime.serve: SIGTERM: draining (...)
    json    {"time": "2026-11-28T06:31:07.123Z", "level": "WARNING", "logger": "runtime.serve",
             "message": "...", "request_id": ..., "status": ...}   (one object per line)

A record's structured fields (`FIELDS`: the access log's request id, client, status, images,
decoding method, seconds, ...) given as `extra=` become keys of its JSON object.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any, TextIO

LOG_FORMATS = ("auto", "rich", "plain", "json")
# the structured fields a record may carry (logging's `extra=`), written as keys in json
FIELDS = ("request_id", "client", "http_method", "path", "status", "images", "method", "seconds")


def utc_time(record: logging.LogRecord) -> str:
    """The record's creation time, ISO 8601 in UTC with milliseconds."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"


class PlainFormatter(logging.Formatter):
    """`TIME LEVEL LOGGER: message`, one line whatever the message holds."""

    def format(self, record: logging.LogRecord) -> str:
        text = f"{utc_time(record)} {record.levelname} {record.name}: {record.getMessage()}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text.replace("\r", "\\r").replace("\n", "\\n")


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, the declared `FIELDS` the record
    carries, and `error` (the traceback) where there is one. json.dumps escapes every newline."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {"time": utc_time(record), "level": record.levelname, "logger": record.name,
                               "message": record.getMessage()}
        out.update({k: getattr(record, k) for k in FIELDS if hasattr(record, k)})
        if record.exc_info:
            out["error"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A stream handler on whatever `sys.stderr` is when a record is written (a test's capture,
    a redirected stream), not the one there when it was made."""

    def __init__(self) -> None:
        logging.Handler.__init__(self)

    @property
    def stream(self) -> TextIO:  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, _: TextIO) -> None:  # StreamHandler.setStream; the stream is always sys.stderr
        pass


def make_handler(log_format: str, verbosity: int) -> logging.Handler:
    """The handler for `--log-format`: auto = rich when stderr is a terminal, else plain."""
    if log_format == "auto":
        log_format = "rich" if sys.stderr.isatty() else "plain"
    if log_format == "rich":
        from rich.console import Console
        from rich.logging import RichHandler

        return RichHandler(console=Console(stderr=True), show_path=verbosity > 1, show_time=verbosity > 0,
                           markup=False, rich_tracebacks=False)
    handler = StderrHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else PlainFormatter())
    return handler
