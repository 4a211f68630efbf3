"""Stopping `runtime serve` so that callers and load balancers can see it stop.

uvicorn closes its listener at the first SIGTERM, so a probe or a new request during the drain
meets a refused connection, which a load balancer cannot tell from a crash. `DrainingServer`
keeps listening instead. With T = --shutdown-timeout, from the first SIGTERM or SIGINT:

    t = 0          draining: /health 200, /ready 503, a new generation request 503 with
                   Retry-After (and Connection: close); the requests in flight go on
    t <= T - 2 s   once none is in flight the server closes (listener, connections, engine)
    t = T - 2 s    still some in flight: they are given up (their images dropped, each answered
                   503 "shut down before these images were done"), and the server closes
    t <= T         the process is gone (the engine thread, even one still capturing its steps
                   during a --graph warm-up, is not waited for past T, and the command ends the
                   process without the interpreter's slow teardown)

A second Ctrl-C gives up the requests in flight at once (each answers 503) and exits within a
second or so. The exit status is 0 after SIGTERM and 130 after SIGINT (the
command raises SIGINT again once the server is down, as every command reports one).
"""

from __future__ import annotations

import logging
import signal
import time
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn
from starlette.types import ASGIApp

if TYPE_CHECKING:
    from runtime.serve.api import Served

DEFAULT_SHUTDOWN_TIMEOUT_S = 25.0  # under Kubernetes' default 30 s grace period
CLOSE_S = 2.0  # of the shutdown timeout, kept to answer the requests given up and close

_log = logging.getLogger("runtime.serve")


class DrainingServer(uvicorn.Server):
    """uvicorn's server, draining `served`'s API requests before it closes (module docstring).
    `signals`: the stop signals received, in order (the command re-raises a SIGINT)."""

    def __init__(self, config: uvicorn.Config, served: Served, shutdown_timeout_s: float) -> None:
        super().__init__(config)
        self.served = served
        self.shutdown_timeout_s = shutdown_timeout_s
        self.signals: list[int] = []
        self._drain_since: float | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:  # noqa: ARG002 - signal handler
        self.signals.append(sig)
        if self._drain_since is None:
            self._drain_since = time.monotonic()
            self.served.exit_by = self._drain_since + self.shutdown_timeout_s
            self.served.draining = True
            _log.warning("%s: draining (%d API requests in flight; /ready answers 503; at most %g s)",
                         signal.Signals(sig).name, self.served.in_flight, self.shutdown_timeout_s)
            return
        if sig == signal.SIGINT:  # a second Ctrl-C: now (the requests in flight answer 503 first)
            self.served.abandoned_why = "a second Ctrl-C"
            self.served.abandoned = True
            self.served.exit_by = time.monotonic()
            self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        if await super().on_tick(counter):
            return True
        if self._drain_since is None:
            return False
        if self.served.in_flight == 0:
            return True
        elapsed = time.monotonic() - self._drain_since
        give_up_at = max(0.0, self.shutdown_timeout_s - CLOSE_S)
        if elapsed >= give_up_at and not self.served.abandoned:
            _log.warning("drain: %d API requests still in flight after %g s; giving them up",
                         self.served.in_flight, elapsed)
            self.served.abandoned_why = f"--shutdown-timeout {self.shutdown_timeout_s:g} s passed"
            self.served.abandoned = True  # each answers 503 within a quarter second
        return elapsed >= give_up_at + CLOSE_S / 2


def server_config(app: ASGIApp, *, host: str, port: int, root_path: str = "") -> uvicorn.Config:
    """uvicorn's settings for `runtime serve`: its own access log off (RequestContext logs each
    request with its id), its logging left as the command line set it (one format for every
    line: `runtime.cli.app.configure_logging`), lifespan on, and a short graceful shutdown (the drain has already
    waited for the requests in flight)."""
    # timeout_graceful_shutdown: uvicorn annotates it int but awaits it as a timeout, seconds as a float
    return uvicorn.Config(app, host=host, port=port, root_path=root_path, log_level="warning", access_log=False,
                          log_config=None, lifespan="on", timeout_graceful_shutdown=CLOSE_S / 2)  # type: ignore[arg-type]
