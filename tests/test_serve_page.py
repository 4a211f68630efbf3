"""The web page of `runtime serve` in a real browser: headless Chromium (Debian's `chromium`
package; `.ci/run` installs it, and where it is absent the browser test skips with the reason)
opens the page of a live server (demo model, CPU) with an API key, through a proxy that serves
it under a prefix (as `--root-path` expects), fills the form, clicks Generate and waits for the
finished image. The image's PNG, read back out of the page, must be the pixels `runtime run`
writes for the seed the page shows, at least one streamed preview must have been drawn before
it, and every request the page made must have stayed under the prefix (relative URLs).

The browser is driven over the Chrome DevTools Protocol with the small websocket client below
(no dependency beyond the standard library)."""

from __future__ import annotations

import base64
import io
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from serve_process import serving

pytest.importorskip("fastapi", reason="runtime serve needs the serve extra (in the test extra)")
pytest.importorskip("httpx", reason="FastAPI's test client needs httpx (in the test extra)")

from fastapi.testclient import TestClient  # noqa: E402

from runtime.serve.api import HttpOptions, create_app  # noqa: E402
from runtime.serve.page import PAGE_FILES  # noqa: E402

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
KEY = "page-test-key"
PREFIX = "/lantern"  # where the proxy serves the server (it strips the prefix, as --root-path expects)
STATIC = Path(__file__).resolve().parents[1] / "runtime" / "serve" / "static"


def _open(url: str, timeout: float = 5) -> tuple[int, bytes]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never an HTTP proxy
    try:
        with opener.open(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


# --- the page's routes, without a model -------------------------------------------------------

def _app(**http: Any) -> TestClient:
    """The app over a stand-in engine (no model): enough for the page's routes."""
    engine = SimpleNamespace(ready=None, decoder=None, stats=None, queue_depth=0, on_done=None)
    served = SimpleNamespace(version="VERSION", method="-", names=["-"], in_flight=0)
    return TestClient(create_app(engine, served, HttpOptions(**http)))  # type: ignore[arg-type]


def test_the_page_is_served_at_the_root_with_a_policy_that_loads_nothing_from_elsewhere():
    client = _app(docs=False)  # --disable-docs leaves the page
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    policy = page.headers["content-security-policy"]
    assert "default-src 'none'" in policy and "script-src 'self'" in policy and "connect-src 'self'" in policy
    for name in ("page.js", "page.css"):
        answer = client.get(f"ui/{name}")
        assert answer.status_code == 200 and answer.headers["content-type"] == PAGE_FILES[name]
    assert client.get("/ui/index.html").status_code == 404 and client.get("/ui/../api.py").status_code == 404
    assert client.get("/docs").status_code == 404


def test_disable_ui_serves_no_page_and_the_api_stays():
    client = _app(ui=False)
    assert client.get("/").status_code == 404 and client.get("/ui/page.js").status_code == 404
    assert "page at /" not in client.get("/").json()["error"]["message"]
    assert "/info" in client.get("/openapi.json").json()["paths"]


def test_the_pages_files_name_nothing_outside_the_server_and_only_relative_urls():
    """No CDN, font or script from elsewhere, and no absolute path (it would miss a proxy's prefix)."""
    for name in PAGE_FILES:
        text = (STATIC / name).read_text(encoding="utf-8")
        assert not re.search(r"https?://|//[a-z0-9.-]+\.[a-z]{2,}/", text, re.I), name
        assert not re.search(r"""(?:src|href)=["']/|fetch\(\s*["'`]/|url\(\s*["']?/""", text), name


# --- the browser ------------------------------------------------------------------------------

def _browser() -> str | None:
    return next((path for name in BROWSERS if (path := shutil.which(name))), None)


class DevTools:
    """A Chrome DevTools Protocol session over one websocket (RFC 6455: masked text frames out,
    unmasked frames in). `call` returns a command's result; events that arrive meanwhile are
    kept in `events`."""

    def __init__(self, url: str) -> None:
        host, port, path = re.fullmatch(r"ws://([^:/]+):(\d+)(/.*)", url).groups()  # type: ignore[union-attr]
        self.sock = socket.create_connection((host, int(port)), timeout=60)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
                          f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
                          .encode())
        head = b""
        while not head.endswith(b"\r\n\r\n"):  # byte by byte: the first frame may follow at once
            head += self._exactly(1)
        assert head.startswith(b"HTTP/1.1 101"), head.decode("latin-1")
        self.last_id = 0
        self.events: list[dict[str, Any]] = []

    def _exactly(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            if not chunk:
                raise ConnectionError("the browser closed the DevTools connection")
            data += chunk
        return data

    def _send(self, text: str) -> None:
        data = text.encode()
        n = len(data)
        size = bytes([0x80 | n]) if n < 126 else (bytes([0x80 | 126]) + n.to_bytes(2, "big") if n < 1 << 16
                                                   else bytes([0x80 | 127]) + n.to_bytes(8, "big"))
        mask = os.urandom(4)
        masked = (np.frombuffer(data, np.uint8) ^ np.resize(np.frombuffer(mask, np.uint8), n)).tobytes()
        self.sock.sendall(bytes([0x81]) + size + mask + masked)

    def _receive(self) -> dict[str, Any]:
        message = b""
        while True:
            first, second = self._exactly(2)
            n = second & 0x7F
            if n >= 126:
                n = int.from_bytes(self._exactly(2 if n == 126 else 8), "big")
            payload = self._exactly(n)
            if first & 0x0F == 0x8:
                raise ConnectionError("the browser closed the DevTools connection")
            if first & 0x0F in (0x0, 0x1, 0x2):
                message += payload
                if first & 0x80:
                    return json.loads(message)

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self.last_id += 1
        self._send(json.dumps({"id": self.last_id, "method": method, "params": params}))
        while True:
            message = self._receive()
            if message.get("id") == self.last_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]
            self.events.append(message)

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise AssertionError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float) -> Any:
        """The first truthy value of `expression`, polled every 0.1 s."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = self.evaluate(expression)
            if value:
                return value
            time.sleep(0.1)
        raise AssertionError(f"not within {timeout:g} s: {expression}; the page says "
                             f"{self.evaluate('document.body.dataset.state + `: ` + status.textContent')!r}")


class PrefixProxy:
    """A reverse proxy serving `backend` under PREFIX, as one in front of `--root-path` would:
    it strips the prefix, forwards the bytes both ways (a stream included), one request per
    connection, and answers 404 itself for a path outside the prefix. `paths` records every
    path asked for."""

    def __init__(self, backend_port: int) -> None:
        self.backend_port = backend_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.paths: list[str] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        with client:
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = client.recv(65536)
                if not chunk:
                    return
                head += chunk
            head, rest = head.split(b"\r\n\r\n", 1)
            request_line, *headers = head.decode("latin-1").split("\r\n")
            verb, path, version = request_line.split(" ")
            self.paths.append(path)
            if not path.startswith(PREFIX + "/"):
                client.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                return
            kept = [h for h in headers if h.split(":", 1)[0].lower() not in ("connection", "keep-alive")]
            forwarded = "\r\n".join([f"{verb} {path[len(PREFIX):]} {version}", *kept, "Connection: close", "", ""])
            with socket.create_connection(("127.0.0.1", self.backend_port)) as backend:
                backend.sendall(forwarded.encode("latin-1") + rest)
                threading.Thread(target=self._pump, args=(client, backend), daemon=True).start()
                self._pump(backend, client)

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while chunk := source.recv(65536):
                sink.sendall(chunk)
        except OSError:
            pass

    def close(self) -> None:
        self.listener.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(port, server log) of `runtime serve` on the demo with an API key and --root-path."""
    log = tmp_path_factory.mktemp("serve") / "stderr.txt"
    flags = ["--no-graph", "--batch-size", "2", "--root-path", PREFIX, "--disable-docs"]
    with serving(flags, log, env={"LANTERN_API_KEY": KEY}, within=120) as port:
        yield port, log


@pytest.fixture(scope="module")
def chromium(tmp_path_factory):
    """A DevTools session on a blank page of headless Chromium."""
    path = _browser()
    if path is None:
        pytest.skip("no headless Chromium: install Debian's `chromium` package (.ci/run does) to run this test")
    profile = tmp_path_factory.mktemp("chromium-profile")
    proc = subprocess.Popen([path, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                             "--disable-background-networking", "--disable-component-update", "--disable-sync",
                             "--disable-dev-shm-usage", "--no-proxy-server", "--remote-debugging-port=0",
                             f"--user-data-dir={profile}", "--window-size=1100,900", "about:blank"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        active = profile / "DevToolsActivePort"  # Chromium writes its port there
        deadline = time.time() + 30
        while not (active.exists() and len(active.read_text().split()) >= 2):
            if proc.poll() is not None or time.time() > deadline:
                pytest.fail(f"{path} did not start: {proc.stderr.read().decode(errors='replace')[-2000:]}")
            time.sleep(0.1)
        port = active.read_text().split()[0]
        targets = json.loads(_open(f"http://127.0.0.1:{port}/json/list")[1])
        page = next(t for t in targets if t["type"] == "page")
        tools = DevTools(page["webSocketDebuggerUrl"])
        tools.call("Runtime.enable")
        yield tools
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def _offline_png(tmp_path: Path, label: int, seed: int) -> np.ndarray:
    """The image `runtime run --seed seed --classes label --num-images 1` writes (the server's
    method and flags: the cpu profile's, no graph)."""
    from PIL import Image

    out = tmp_path / f"run-{label}-{seed}"
    done = subprocess.run([sys.executable, "-m", "runtime", "run", "--device", "cpu", "--no-graph", "--seed", str(seed),
                           "--classes", str(label), "--num-images", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return np.asarray(Image.open(out / f"image_0000_c{label}.png").convert("RGB"))


def _generate(page: DevTools, *, key: str, label: int, n: int, seed: str) -> dict[str, Any]:
    """Fill the form, click Generate, wait for the page to finish; what the page shows."""
    page.evaluate(f"""(() => {{
        const set = (id, value) => {{
          const el = document.getElementById(id);
          el.value = value;
          el.dispatchEvent(new Event("input", {{bubbles: true}}));
          el.dispatchEvent(new Event("change", {{bubbles: true}}));
        }};
        set("key", {json.dumps(key)}); set("class", "{label}"); set("n", "{n}"); set("seed", {json.dumps(seed)});
        document.getElementById("go").click();  // the submit handler marks the page running at once
    }})()""")
    page.wait_for("document.body.dataset.state === 'done' || document.body.dataset.state === 'error'", 45)
    return page.evaluate("""(() => ({
        state: document.body.dataset.state, status: document.getElementById("status").textContent,
        seed: document.getElementById("request-seed").textContent,
        reproduce: document.getElementById("reproduce").textContent,
        cards: Array.from(document.querySelectorAll(".card"), card => ({
          state: card.dataset.state, partials: Number(card.dataset.partials),
          src: card.querySelector("img").src, caption: card.querySelector("figcaption").textContent})),
    }))()""")


def _png(data_url: str) -> tuple[bytes, np.ndarray]:
    from PIL import Image

    assert data_url.startswith("data:image/png;base64,"), data_url[:40]
    raw = base64.b64decode(data_url.split(",", 1)[1])
    return raw, np.asarray(Image.open(io.BytesIO(raw)).convert("RGB"))


@pytest.mark.slow
def test_the_page_in_chromium_generates_the_image_runtime_run_makes_with_previews_first(chromium, server, tmp_path):
    from runtime.core.rng import derive_seed

    port, _ = server
    proxy = PrefixProxy(port)
    try:
        page = chromium
        page.call("Page.enable")
        page.call("Page.navigate", url=f"http://127.0.0.1:{proxy.port}{PREFIX}/")
        page.wait_for("document.body && document.body.dataset.state === 'idle'", 20)
        assert "method lantern++" in page.evaluate("document.getElementById('about').textContent")
        assert page.evaluate("document.getElementById('key-row').hidden") is False  # the server asks for a key
        assert page.evaluate("document.getElementById('class').options[3].textContent") == "3: cross"
        # a card waiting for its first preview shows gray, not a broken-image icon
        page.evaluate("window.probe = makeCard(9); document.body.append(window.probe)")
        page.wait_for("window.probe.querySelector('img').complete", 5)
        assert page.evaluate("window.probe.querySelector('img').naturalWidth") > 0
        page.evaluate("window.probe.remove()")

        # a wrong key: the server's 401 message, shown on the page
        refused = _generate(page, key="not-the-key", label=3, n=1, seed="7")
        assert refused["state"] == "error" and "incorrect API key" in refused["status"], refused["status"]

        # class 3, one image, seed 7
        shown = _generate(page, key=KEY, label=3, n=1, seed="7")
        assert shown["state"] == "done", shown["status"]
        (card,) = shown["cards"]
        assert card["state"] == "done" and card["partials"] >= 1, card  # a preview was drawn before the image
        assert shown["seed"] == "7" and "--seed 7 --classes 3" in shown["reproduce"]
        assert f"image seed {derive_seed(7, 0)}" in card["caption"]  # all 64 bits (JSON.parse would round)
        assert re.search(r"tau \d+\.\d\d tokens per step", card["caption"]) and "method lantern++" in card["caption"]
        _, pixels = _png(card["src"])
        assert pixels.shape == (64, 64, 3) and np.array_equal(pixels, _offline_png(tmp_path, 3, 7))

        # no seed typed: the server draws one, and the seed the page shows reproduces the image
        drawn = _generate(page, key=KEY, label=8, n=1, seed="")
        assert drawn["state"] == "done" and drawn["seed"].isdigit(), drawn["status"]
        _, pixels = _png(drawn["cards"][0]["src"])
        assert np.array_equal(pixels, _offline_png(tmp_path, 8, int(drawn["seed"])))

        # every request stayed under the prefix (relative URLs), and the script raised nothing
        assert proxy.paths and all(p.startswith(PREFIX + "/") for p in proxy.paths), proxy.paths
        assert {PREFIX + "/", PREFIX + "/ui/page.js", PREFIX + "/info", PREFIX + "/v1/images/generations"} \
            <= set(proxy.paths)
        errors = [e for e in page.events if e.get("method") == "Runtime.exceptionThrown"]
        assert not errors, errors[:3]
    finally:
        proxy.close()
