"""A load test of `runtime serve` on loopback: concurrent clients, mixed `n` and seeds, every image
checked, throughput and latency percentiles against offline batches on the same device.

    python -m runtime.serve.load --requests 200 --concurrency 16 --out results/serve_load_cpu.json \
        -- --device cpu --batch-size 8 --method ar

starts `runtime serve` with the arguments after `--` on a free port, waits for `/ready`, sends
the requests (request k: n = 1 + k % `--max-n`, seed k, class k % classes, with its tokens), then
SIGTERMs the server and checks that it exits 0. Every image must come back with the tokens the
same seed gives offline (`runtime run`'s decoder: same model, method, batch size and graph
mode, checked for `--verify` requests spread over the run). Offline throughput: the same images through
`Decoder.generate_many` at the server's batch size, timed in this process after the server has
stopped. The result file holds both, the latency percentiles and every request's timings.

`--sigterm-after K` is the drain under load: the SIGTERM comes once K requests are answered,
while others are in flight. Every request sent before it must get all its images (nothing
admitted is lost); requests sent in its last second may be refused instead, none half-served.
While the server drains, a prober asks `/health`, `/ready` and for a new image every 0.2 s until
it exits: the listener must stay open (`/health` 200, `/ready` 503, a new request 503 with
Retry-After), at least one round answered.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable, TypedDict, cast


class ServedImage(TypedDict, total=False):
    """The fields of an answer's image the load test reads."""

    seed: int
    tokens: list[int]


class Answer(TypedDict, total=False):
    """A generation answer as the load test reads it: its images, or OpenAI's error."""

    data: list[ServedImage]
    error: dict[str, str]


class LoadRequest(TypedDict):
    prompt: str
    n: int
    seed: int
    return_tokens: bool


class Record(TypedDict, total=False):
    """One request of the load (empty: never sent); seconds from the load's start."""

    request: LoadRequest
    status: int  # 0: no answer
    seconds: float
    sent_s: float
    answered_s: float
    data: list[ServedImage]
    error: dict[str, str] | None


class Probe(TypedDict):
    """One round of the drain probes: each answer's status (0: none) and the 503's Retry-After."""

    at_s: float
    health: int
    ready: int
    generate: int
    retry_after: str | None


class Ready(TypedDict, total=False):
    """The fields of the server's /ready the load test reads."""

    method: str
    batch_size: int
    settings: dict[str, object]


class Offline(TypedDict):
    """The served images made again by `runtime run`'s decoder in one process."""

    images: int
    seconds: float
    images_per_s: float
    batch_size: int
    method: str


class Latency(TypedDict, total=False):
    p50: float
    p90: float
    p99: float
    mean: float


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _post(url: str, body: LoadRequest, timeout: float) -> tuple[int, Answer]:
    """(HTTP status, JSON answer); status 0 when no answer came (connection refused or dropped)."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, cast(Answer, json.loads(r.read()))
    except urllib.error.HTTPError as err:
        return err.code, cast(Answer, json.loads(err.read() or b"{}"))
    except (OSError, http.client.HTTPException) as err:  # refused, reset, closed mid-answer
        return 0, {"error": {"message": f"{type(err).__name__}: {err}", "type": "connection"}}


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by linear interpolation between order statistics."""
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def run_load(base: str, *, requests: int, concurrency: int, max_n: int, classes: int, timeout: float,
             stop_after: int | None = None, stop: Callable[[], None] | None = None
             ) -> tuple[list[Record], float, float | None]:
    """Send the requests from `concurrency` threads; (per-request records, wall seconds, seconds
    from the start to the stop or None).

    With `stop_after`, `stop()` (the SIGTERM) is called once that many requests are answered;
    requests not sent by then are not sent (their records stay empty) and those in flight finish
    or are refused. A record's `sent_s` / `answered_s` count seconds from the start."""
    records: list[Record] = [{} for _ in range(requests)]
    todo = iter(range(requests))
    lock = threading.Lock()
    answered = [0]
    stopped_at: list[float] = []
    t0 = time.perf_counter()

    def client() -> None:
        while True:
            with lock:
                k = None if stopped_at else next(todo, None)
            if k is None:
                return
            body: LoadRequest = {"prompt": str(k % classes), "n": 1 + k % max_n, "seed": k, "return_tokens": True}
            start = time.perf_counter()
            status, answer = _post(base + "/v1/images/generations", body, timeout)
            while status == 429 and not stopped_at:  # the queue is full: wait a moment, then again
                time.sleep(1.0)
                status, answer = _post(base + "/v1/images/generations", body, timeout)
            end = time.perf_counter()
            records[k] = {"request": body, "status": status, "seconds": end - start, "sent_s": start - t0,
                          "answered_s": end - t0, "data": answer.get("data", []), "error": answer.get("error")}
            with lock:
                answered[0] += 1
                if stop is not None and stop_after is not None and answered[0] == stop_after and not stopped_at:
                    stopped_at.append(time.perf_counter() - t0)
                    stop()

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return records, time.perf_counter() - t0, (stopped_at[0] if stopped_at else None)


def _parse(args_in: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(the load test's options, the serve flags after `--`), refused with argparse's line."""
    split = args_in.index("--") if "--" in args_in else len(args_in)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-n", type=int, default=3, help="request k asks for 1 + k %% max-n images")
    parser.add_argument("--verify", type=int, default=16, help="requests whose tokens are checked against offline")
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--sigterm-after", type=int, default=None, metavar="K",
                        help="SIGTERM the server once K requests are answered, under load: every request sent "
                        "before it must still get all its images; later ones may be refused, never half-served")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(args_in[:split])
    serve_args = args_in[split + 1:]
    method = serve_args[serve_args.index("--method") + 1] if "--method" in serve_args[:-1] else None
    if method == "auto":
        parser.error("--method auto serves with several methods; the offline comparison needs one (name it)")
    if args.sigterm_after is not None and not 0 < args.sigterm_after < args.requests:
        parser.error(f"--sigterm-after must be in 1..{args.requests - 1} (fewer than --requests)")
    return args, serve_args


def main(argv: list[str] | None = None) -> int:
    args_in = sys.argv[1:] if argv is None else argv
    args, serve_args = _parse(args_in)
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    log = Path(tempfile.mkdtemp(prefix="serve-load-")) / "server.log"  # named when the server fails
    with open(log, "w") as server_log:
        proc = subprocess.Popen([sys.executable, "-m", "runtime", "serve", "--port", str(port), *serve_args],
                                stdout=server_log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 600
        ready: Ready = {}
        while time.time() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(base + "/ready", timeout=2) as r:
                    ready = cast(Ready, json.loads(r.read()))
                    break
            except (OSError, ValueError):
                time.sleep(0.5)
        if not ready:
            print(f"the server did not become ready; see {log}", file=sys.stderr)
            return 1
        classes = 12  # the demo's; a c2i model has at least as many
        probes: list[Probe] = []

        def stop() -> None:
            proc.send_signal(signal.SIGTERM)
            threading.Thread(target=_probe_drain, args=(base, proc, probes), daemon=True).start()

        records, wall, stopped_s = run_load(
            base, requests=args.requests, concurrency=args.concurrency, max_n=args.max_n, classes=classes,
            timeout=args.timeout, stop_after=args.sigterm_after, stop=stop)
        metrics = ""
        if stopped_s is None:
            with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
                metrics = r.read().decode()
            proc.send_signal(signal.SIGTERM)
        exit_code = proc.wait(600)
    finally:
        if proc.poll() is None:
            proc.kill()

    failed, outcome = _judge(records, stopped_s)
    drain_ok = None
    if stopped_s is not None:
        answered = [p for p in probes if p["health"] and p["ready"] and p["generate"]]  # a whole round
        drain_ok = bool(answered) and all(p["health"] == 200 and p["ready"] == 503 and p["generate"] == 503
                                          and p["retry_after"] for p in answered)
        outcome["drain_probes_answered"] = len(answered)
    mismatches, offline = _offline(records, serve_args, ready, args.verify)
    result = _result(args, args_in, records, ready, wall, failed, exit_code, mismatches, offline, probes, drain_ok,
                     stopped_s, outcome, metrics)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    latency = _latency(records)
    print(f"{result['images']} images from {args.requests} requests ({args.concurrency} clients) in {wall:.1f} s: "
          f"{result['images_per_s']:.3f} images/s served, {offline['images_per_s']:.3f} offline "
          f"(batch {ready.get('batch_size')}); latency p50 {latency.get('p50', 0):.2f} s, "
          f"p99 {latency.get('p99', 0):.2f} s; {len(failed)} failed, {mismatches} token mismatches, "
          f"server exit {exit_code}" + (f"; SIGTERM at {stopped_s:.1f} s: {outcome}, drain visible: {drain_ok}"
                                        if stopped_s is not None else ""))
    return 0 if not failed and not mismatches and exit_code == 0 and drain_ok is not False else 1


def _result(args: argparse.Namespace, args_in: list[str], records: list[Record], ready: Ready,
            wall: float, failed: list[Record], exit_code: int, mismatches: int, offline: Offline,
            probes: list[Probe], drain_ok: bool | None, stopped_s: float | None, outcome: dict[str, int],
            metrics: str) -> dict[str, object]:
    """The load test's result file: what was asked, what the server answered, the offline check."""
    images = sum(len(r["data"]) for r in records if r.get("status") == 200)
    return {
        "command": ["python", "-m", "runtime.serve.load", *args_in],
        "server": ready, "requests": args.requests, "concurrency": args.concurrency, "images": images,
        "failed_requests": len(failed), "server_exit_code": exit_code, "token_mismatches": mismatches,
        "sigterm_after": args.sigterm_after, "sigterm_at_s": stopped_s, "outcome": outcome,
        "drain_probes": probes, "drain_visible": drain_ok,
        "wall_s": wall, "images_per_s": images / wall if wall else 0.0,
        "latency_s": _latency(records),
        "offline": offline,
        "served_over_offline": (images / wall) / offline["images_per_s"] if offline["images_per_s"] else None,
        "metrics": metrics,
        "records": [{k: v for k, v in r.items() if k != "data"} | {"seeds": [d["seed"] for d in r.get("data", [])]}
                    for r in records],
    }


def _latency(records: list[Record]) -> Latency:
    """Percentiles of the answered requests' seconds ({} when none was answered)."""
    latencies = [r["seconds"] for r in records if r.get("status") == 200]
    if not latencies:
        return {}
    return {"p50": percentile(latencies, 0.5), "p90": percentile(latencies, 0.9),
            "p99": percentile(latencies, 0.99), "mean": statistics.fmean(latencies)}


def _probe_drain(base: str, proc: subprocess.Popen[str], probes: list[Probe]) -> None:
    """While the server drains (until it exits): `/health`, `/ready` and a new generation every
    0.2 s, their statuses (0: no answer) and whether the 503 named a Retry-After."""
    def status(path: str, body: LoadRequest | None = None) -> tuple[int, str | None]:
        request = urllib.request.Request(base + path, data=None if body is None else json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=5) as r:
                return r.status, r.headers.get("Retry-After")
        except urllib.error.HTTPError as err:
            return err.code, err.headers.get("Retry-After")
        except (OSError, http.client.HTTPException):
            return 0, None

    t0 = time.perf_counter()
    while proc.poll() is None:
        health, _ = status("/health")
        ready, _ = status("/ready")
        generate, retry = status("/v1/images/generations", {"prompt": "1", "n": 1, "seed": 0, "return_tokens": False})
        if proc.poll() is None or health:
            probes.append({"at_s": time.perf_counter() - t0, "health": health, "ready": ready,
                           "generate": generate, "retry_after": retry})
        time.sleep(0.2)


ADMITTED_BEFORE_S = 1.0  # a request sent this long before the SIGTERM has surely been admitted


def _judge(records: list[Record], stopped_s: float | None) -> tuple[list[Record], dict[str, int]]:
    """(the failed requests, counts of each outcome). Without a stop every request must get all its
    images. With one, a request sent ADMITTED_BEFORE_S before it must too (nothing admitted is
    lost); one sent later may instead be refused (no answer, or 503), but never half-served."""
    outcome = {"served": 0, "refused": 0, "not_sent": 0, "failed": 0}
    failed = []
    for r in records:
        if not r:
            outcome["not_sent"] += 1
            continue
        complete = r["status"] == 200 and len(r["data"]) == r["request"]["n"]
        late = stopped_s is not None and r["sent_s"] > stopped_s - ADMITTED_BEFORE_S
        if complete:
            outcome["served"] += 1
        elif late and r["status"] in (0, 503):
            outcome["refused"] += 1
        else:
            outcome["failed"] += 1
            failed.append(r)
    return failed, outcome


def _offline(records: list[Record], serve_args: list[str], ready: Ready,
             verify: int) -> tuple[int, Offline]:
    """(token mismatches among `verify` requests, offline throughput of every image served)."""
    import torch

    from runtime.core.rng import derive_seed
    from runtime.config.method_options import OPTION_TYPES, SAMPLING_KEYS
    from runtime.generation.device_setup import open_backend
    from runtime.generation.loading import load_model
    from runtime.generation.pipeline import make_decoder, timed_many
    from runtime.generation.settings import resolve_spec

    def flag(name: str, default: str | None = None) -> str | None:
        return serve_args[serve_args.index(name) + 1] if name in serve_args else default

    backend, prof = open_backend(flag("--device") or "auto", flag("--profile-name"),
                                 False if "--no-graph" in serve_args else (True if "--graph" in serve_args else None),
                                 flag("--dtype"))
    size = flag("--image-size")
    loaded = load_model(model=flag("--model"), gpt_model=flag("--gpt-model"), gpt_ckpt=flag("--gpt-ckpt"),
                        vq_ckpt=flag("--vq-ckpt"), image_size=int(size) if size is not None else None,
                        drafter=flag("--drafter"), gpt_type=flag("--gpt-type", "c2i"),
                        trust="--trust-checkpoint" in serve_args, device=backend.device, dtype=backend.dtype,
                        revision=flag("--model-revision"))
    settings = dict(ready.get("settings", {}))  # the server's resolved method, as result files record it
    if settings.get("proactive"):
        settings["proactive"] = "x".join(map(str, cast(list[int], settings["proactive"])))
    flags = {k: v for k, v in settings.items() if k in OPTION_TYPES or k in SAMPLING_KEYS}
    spec = resolve_spec(ready.get("method"), flags, prof, loaded.recommended)
    served = [r for r in records if r.get("status") == 200]
    # the server's decoder as `runtime run` builds it (same batch, same graph mode: compiled steps
    # may round differently from eager ones, see docs/methods.md), for the check and the timing
    decoder = make_decoder(loaded, spec, backend, batch_size=int(ready.get("batch_size", 1)))
    step = max(1, len(served) // max(verify, 1))
    checked = served[::step][:verify]
    tokens, _ = decoder.generate_many([
        (torch.tensor([int(r["request"]["prompt"])], device=backend.device), None, derive_seed(r["request"]["seed"], i))
        for r in checked for i in range(r["request"]["n"])])
    expected = iter(tokens)
    mismatches = sum(d["tokens"] != next(expected).tolist() for r in checked for d in r["data"])
    work: list[tuple[torch.Tensor, torch.Tensor | None, int]] = [
        (torch.tensor([int(r["request"]["prompt"])], device=backend.device), None, derive_seed(r["request"]["seed"], i))
        for r in served for i in range(r["request"]["n"])]
    _, seconds = timed_many(decoder, work, backend)
    return mismatches, {"images": len(work), "seconds": seconds, "images_per_s": len(work) / seconds,
                        "batch_size": decoder.config.batch, "method": spec.method}


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
