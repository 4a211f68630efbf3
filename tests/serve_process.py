"""`runtime serve` in its own process for the end-to-end tests: a free port, the wait for
`/ready`, SIGTERM at the end (what an operator's supervisor does)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest


def free_port() -> int:
    """A TCP port on the loopback that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def status_of(url: str, timeout: float = 5) -> int:
    """The HTTP status of a GET on the loopback (never through an HTTP proxy)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as err:
        return err.code


@contextlib.contextmanager
def serving(flags: list[str], log: Path, *, env: dict[str, str] | None = None, within: float = 180,
            verbose: bool = False) -> Iterator[int]:
    """`python -m runtime [-v] serve --device cpu --port P *flags` (stderr to `log`; `verbose`: the
    access log too) until it answers `/ready` 200 within `within` seconds; yields P, then sends
    SIGTERM and waits for the exit."""
    port = free_port()
    with open(log, "w") as err:
        command = [sys.executable, "-m", "runtime", *(["-v"] if verbose else []), "serve", "--device", "cpu",
                   "--port", str(port), *flags]
        proc = subprocess.Popen(command, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                                stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.time() + within
        while time.time() < deadline and proc.poll() is None:
            try:
                if status_of(f"http://127.0.0.1:{port}/ready") == 200:
                    break
            except OSError:
                pass
            time.sleep(0.3)
        else:
            pytest.fail("the server did not become ready: " + log.read_text()[-2000:])
        yield port
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
