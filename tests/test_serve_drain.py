"""`runtime serve`'s drain, through a real process and real signals: from SIGTERM / SIGINT on the
server keeps listening (/health 200, /ready 503, a new request 503 with Retry-After) while the
request in flight finishes, then exits 0 (SIGTERM) or 130 (SIGINT); --shutdown-timeout bounds
the drain, a --graph warm-up included."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import pytest

from serve_process import free_port

pytest.importorskip("fastapi", reason="runtime serve needs the serve extra (in the test extra)")
pytest.importorskip("uvicorn", reason="runtime serve needs the serve extra (in the test extra)")


def _call(url: str, body: dict[str, Any] | None = None, timeout: float = 10) -> tuple[int, dict[str, str], Any]:
    """(status, headers (lower-case names), JSON answer) of a GET, or of a POST when `body` is given."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, {k.lower(): v for k, v in err.headers.items()}, json.loads(err.read())


class Server:
    """`runtime serve` on a free port, in its own process (demo model, CPU)."""

    def __init__(self, *flags: str) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "runtime", "serve", "--device", "cpu", "--port",
                                      str(self.port), *flags], env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def wait_for(self, path: str, status: int = 200, within: float = 180) -> None:
        deadline = time.time() + within
        while time.time() < deadline:
            try:
                if _call(self.base + path, timeout=2)[0] == status:
                    return
            except OSError:
                pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        pytest.fail(f"{path} never answered {status}: " + self.stop_and_read()[-2000:])

    def busy(self) -> bool:
        metrics = urllib.request.urlopen(self.base + "/metrics", timeout=5).read().decode()
        return "lantern_slots_busy 1.0" in metrics

    def stop_and_read(self) -> str:
        if self.proc.poll() is None:
            self.proc.kill()
        return self.proc.communicate(timeout=30)[1]


def _ask_in_background(base: str, body: dict[str, Any]) -> tuple[threading.Thread, dict[str, Any]]:
    answer: dict[str, Any] = {}

    def ask() -> None:
        answer["status"], answer["headers"], answer["body"] = _call(base + "/v1/images/generations", body,
                                                                    timeout=300)

    thread = threading.Thread(target=ask)
    thread.start()
    return thread, answer


def _until_busy(server: Server, within: float = 60) -> None:
    deadline = time.time() + within
    while not server.busy():
        assert time.time() < deadline, "the request never took a slot"
        time.sleep(0.1)


@pytest.mark.slow
def test_sigterm_drains_visibly_then_exits_0():
    """Mid-drain a probe is answered (/health 200, /ready 503) and a new request gets 503 with
    Retry-After, while the request in flight goes on and gets all its images; the startup line
    names where the server listens, the model, the method and the device."""
    server = Server("--no-graph", "--method", "ar", "--batch-size", "1", "--shutdown-timeout", "120")
    try:
        server.wait_for("/ready")
        asker, answer = _ask_in_background(server.base, {"prompt": "4", "n": 6, "seed": 2})
        _until_busy(server)
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        health = _call(server.base + "/health")
        ready = _call(server.base + "/ready")
        refused = _call(server.base + "/v1/images/generations", {"prompt": "1"})
        still_in_flight = asker.is_alive()
        asker.join(300)
        code = server.proc.wait(120)
        stderr = server.stop_and_read()
    finally:
        server.stop_and_read()
    assert still_in_flight, "the request finished before the probes: nothing was seen mid-drain"
    assert health[0] == 200
    assert ready[0] == 503 and ready[2]["error"]["code"] == "draining", ready
    assert refused[0] == 503 and int(refused[1]["retry-after"]) >= 1
    assert set(refused[2]["error"]) == {"message", "type", "param", "code"} and "draining" in refused[2]["error"]["message"]
    assert answer["status"] == 200 and [d["index"] for d in answer["body"]["data"]] == list(range(6))
    assert code == 0, stderr[-2000:]
    startup = next(line for line in stderr.splitlines() if line.startswith("runtime serve: "))
    assert f"http://127.0.0.1:{server.port}" in startup and "model demo" in startup
    assert "method ar" in startup and "device cpu" in startup


@pytest.mark.slow
def test_sigint_drains_the_same_way_and_exits_130():
    server = Server("--no-graph", "--method", "ar", "--batch-size", "1")
    try:
        server.wait_for("/ready")
        asker, answer = _ask_in_background(server.base, {"prompt": "2", "n": 3, "seed": 5})
        _until_busy(server)
        server.proc.send_signal(signal.SIGINT)
        time.sleep(0.3)
        ready = _call(server.base + "/ready")[0]
        asker.join(300)
        code = server.proc.wait(120)
    finally:
        stderr = server.stop_and_read()
    assert ready == 503
    assert answer["status"] == 200 and len(answer["body"]["data"]) == 3
    assert code == 130, stderr[-2000:]


@pytest.mark.slow
def test_a_second_ctrl_c_gives_up_the_requests_in_flight_at_once():
    server = Server("--no-graph", "--method", "ar", "--batch-size", "1")
    try:
        server.wait_for("/ready")
        asker, answer = _ask_in_background(server.base, {"prompt": "2", "n": 16})
        _until_busy(server)
        server.proc.send_signal(signal.SIGINT)
        time.sleep(0.3)
        signalled = time.monotonic()
        server.proc.send_signal(signal.SIGINT)
        code = server.proc.wait(60)
        took = time.monotonic() - signalled
        asker.join(30)
    finally:
        stderr = server.stop_and_read()
    assert code == 130 and took < 2.0, (code, took, stderr[-2000:])
    assert answer["status"] == 503 and answer["body"]["error"]["code"] == "shutdown", answer
    assert "a second Ctrl-C" in answer["body"]["error"]["message"]
    assert "Traceback" not in stderr and "interrupted by SIGINT: stopped" in stderr, stderr[-2000:]


@pytest.mark.slow
def test_the_shutdown_timeout_bounds_the_drain():
    """A request longer than --shutdown-timeout is given up with a 503 naming the timeout, and the
    process is gone within the timeout of the SIGTERM."""
    bound = 4.0
    server = Server("--no-graph", "--method", "ar", "--batch-size", "1", "--shutdown-timeout", f"{bound:g}")
    try:
        server.wait_for("/ready")
        asker, answer = _ask_in_background(server.base, {"prompt": "5", "n": 16})
        _until_busy(server)
        signalled = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        code = server.proc.wait(60)
        took = time.monotonic() - signalled
        asker.join(30)
    finally:
        stderr = server.stop_and_read()
    assert code == 0, stderr[-2000:]
    assert took <= bound + 0.5, f"exited {took:.1f} s after SIGTERM, past --shutdown-timeout {bound:g}"
    assert answer["status"] == 503 and answer["body"]["error"]["code"] == "shutdown", answer
    assert "--shutdown-timeout 4 s" in answer["body"]["error"]["message"]


@pytest.mark.slow
def test_sigterm_during_a_graph_warm_up_exits_within_the_shutdown_timeout():
    bound = 3.0
    server = Server("--graph", "--method", "lantern++", "--batch-size", "2", "--shutdown-timeout", f"{bound:g}")
    try:
        server.wait_for("/health")
        warming = _call(server.base + "/ready")
        signalled = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        code = server.proc.wait(60)
        took = time.monotonic() - signalled
    finally:
        stderr = server.stop_and_read()
    assert warming[0] == 503 and warming[2]["error"]["code"] == "warming_up", warming
    assert code == 0, stderr[-2000:]
    assert took <= bound + 0.5, f"exited {took:.1f} s after SIGTERM, past --shutdown-timeout {bound:g}"


@pytest.mark.slow
def test_a_stream_in_flight_at_sigterm_runs_to_its_end():
    """A streamed request counts as in flight: the drain waits for its last image and `[DONE]`."""
    server = Server("--no-graph", "--method", "ar", "--batch-size", "1", "--shutdown-timeout", "120")
    lines: list[str] = []

    def stream() -> None:
        body = json.dumps({"prompt": "7", "n": 4, "seed": 1, "stream": True}).encode()
        request = urllib.request.Request(server.base + "/v1/images/generations", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as r:
            lines.extend(line.decode().strip() for line in r)

    try:
        server.wait_for("/ready")
        reader = threading.Thread(target=stream)
        reader.start()
        _until_busy(server)
        server.proc.send_signal(signal.SIGTERM)
        reader.join(300)
        code = server.proc.wait(120)
    finally:
        stderr = server.stop_and_read()
    completed = [line for line in lines if line == "event: image_generation.completed"]
    assert len(completed) == 4 and [line for line in lines if line][-1] == "data: [DONE]", lines[-5:]
    assert code == 0, stderr[-2000:]
