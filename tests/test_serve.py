"""`runtime serve`: continuous batching keeps every image what `runtime run` makes of it, a full
queue answers 429, bad requests 400, a cancelled request frees its slots, the metrics count,
and SIGTERM drains (a real process)."""

from __future__ import annotations

import base64
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from serve_process import free_port

pytest.importorskip("fastapi", reason="runtime serve needs the serve extra (in the test extra)")
pytest.importorskip("httpx", reason="FastAPI's test client needs httpx (in the test extra)")

from fastapi.testclient import TestClient  # noqa: E402

from runtime.cli.options import open_backend  # noqa: E402
from runtime.core import generate  # noqa: E402
from runtime.generation.loading import load_model  # noqa: E402
from runtime.generation.pipeline import decode_tokens  # noqa: E402
from runtime.generation.settings import resolve_spec  # noqa: E402
from runtime.serve import AutoMethods, build_server  # noqa: E402
from runtime.serve.engine import Job, QueueFull  # noqa: E402


@pytest.fixture(scope="module")
def demo():
    backend, prof = open_backend("cpu", None, False, None)
    loaded = load_model(model=None, gpt_model=None, gpt_ckpt=None, vq_ckpt=None, image_size=None, drafter=None,
                        gpt_type="c2i", trust=False, device=backend.device, dtype=backend.dtype)
    spec = resolve_spec("lantern++", {"tree": "chain3"}, prof, loaded.recommended)
    return backend, loaded, spec


@pytest.fixture(scope="module")
def server(demo):
    backend, loaded, spec = demo
    app, engine, served = build_server(loaded, spec, backend, batch_size=3, max_queue=12, timeout_s=120)
    assert engine.ready.wait(120)
    yield TestClient(app), engine, served
    engine.stop(drain=False, timeout=30)


def _offline_tokens(demo, label: int, seed: int, n: int) -> torch.Tensor:
    """What `runtime run --seed seed --classes label --num-images n` decodes (one image at a time)."""
    backend, loaded, spec = demo
    return generate(loaded.target, loaded.drafter, spec, [label] * n, seed=seed, vq=loaded.vq).tokens


def _png_array(b64: str) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


def _ask_together(client, asks: list[dict], timeout: float) -> dict[int, dict]:
    """Send every request at once (one thread each, tokens asked for); {k: the answer's JSON}."""
    answers: dict[int, dict] = {}

    def ask(k: int) -> None:
        answers[k] = client.post("/v1/images/generations", json={**asks[k], "return_tokens": True}).json()

    threads = [threading.Thread(target=ask, args=(k,)) for k in range(len(asks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return answers


def test_concurrent_requests_get_the_images_runtime_run_makes(server, demo):
    client, engine, _ = server
    asks = [dict(prompt="3", n=2, seed=11), dict(prompt="rings", n=1, seed=4), dict(prompt="0", n=3, seed=99),
            dict(prompt="7", n=1, seed=11), dict(prompt="checkerboard", n=2, seed=0)]
    answers = _ask_together(client, asks, timeout=300)
    assert len(answers) == len(asks)
    _, loaded, _ = demo
    for k, body in answers.items():
        data = body["data"]
        assert [d["index"] for d in data] == list(range(asks[k]["n"]))
        label = data[0]["class_id"]
        expected = _offline_tokens(demo, label, asks[k]["seed"], asks[k]["n"])
        for i, d in enumerate(data):
            assert d["tokens"] == expected[i].tolist(), (k, i)
            assert (_png_array(d["b64_json"]) == decode_tokens(loaded.vq, expected[i:i + 1])[0]).all()
            assert d["stats"]["tau"] >= 1.0 and d["stats"]["latency_s"] >= d["stats"]["queue_s"] >= 0
    assert engine.stats.busy_slots == 0


@pytest.mark.parametrize("body, message", [
    ({"prompt": "12"}, "prompt: class 12 is out of range"),
    ({"prompt": "zebra"}, "prompt: 'zebra' is no class of this model; give one of circle"),
    ({"prompt": "\u00b2"}, "prompt: '\u00b2' is no class of this model"),  # isdigit(), but no int()
    ({"prompt": "\u0663"}, "prompt: '\u0663' is no class of this model"),  # an Arabic-Indic 3 is no class id
    ({"prompt": "7" * 5000}, "prompt: '" + "7" * 60 + "... (5000 characters)' is no class"),  # cut, no 500
    ({"prompt": "3", "n": 13}, "n: 13 images can never be queued together on this server (--max-queue 12)"),
    ({"prompt": "3", "n": 0}, "n: Input should be greater than or equal to 1"),
    ({"prompt": "3", "n": 17}, "n: Input should be less than or equal to 16"),
    ({"prompt": "3", "response_format": "url"}, "response_format: Input should be 'b64_json'"),
    ({"prompt": "3", "cfg": 7.5}, "cfg: this server's steps were captured at cfg 3"),
    ({"prompt": "3", "size": "1024x1024"}, "size: this model makes 64x64 images"),
    ({"prompt": "3", "colour": "red"}, "colour: Extra inputs are not permitted"),
    ({"n": 1}, "prompt: Field required"),
])
def test_a_bad_request_gets_400_with_one_line(server, body, message):
    client, _, _ = server
    answer = client.post("/v1/images/generations", json=body)
    assert answer.status_code == 400
    assert answer.json()["error"]["message"].startswith(message), answer.json()


def test_a_full_queue_answers_429_with_retry_after_and_queues_nothing(server):
    client, engine, _ = server
    filling = [Job("fill", i, 1, i) for i in range(12)]  # --max-queue 12: 3 take slots, 9 wait
    engine.submit(filling)
    try:
        before = engine.queue_depth
        answer = client.post("/v1/images/generations", json={"prompt": "1", "n": 4})
        assert answer.status_code == 429 and int(answer.headers["Retry-After"]) >= 1
        assert engine.queue_depth <= before  # nothing of the refused request was queued
    finally:
        engine.cancel(filling)


def test_a_cancelled_request_leaves_the_queue_and_frees_its_slots(server):
    _, engine, _ = server
    jobs = [Job("gone", i, 2, 1000 + i) for i in range(6)]
    engine.submit(jobs)
    engine.cancel(jobs)
    deadline = time.time() + 60
    while engine.stats.busy_slots and time.time() < deadline:
        time.sleep(0.05)
    assert engine.stats.busy_slots == 0 and engine.queue_depth == 0
    assert all(job.future.cancelled() or job.future.done() for job in jobs)


def test_engine_refuses_when_stopping_and_queue_full_is_typed(server):
    _, engine, _ = server
    with pytest.raises(QueueFull):
        engine.submit([Job("big", i, 0, i) for i in range(engine.scheduler.max_queue + 1)])


def test_the_returned_seed_reproduces_the_request(server):
    """An unseeded request returns the run seed it drew; the same request with that seed makes the
    same images, and each image names its own stream and the method that made it."""
    from runtime.core.rng import derive_seed

    client, _, _ = server
    first = client.post("/v1/images/generations", json={"prompt": "4", "n": 2, "return_tokens": True}).json()["data"]
    seed = first[0]["seed"]
    assert all(d["seed"] == seed for d in first) and [d["index"] for d in first] == [0, 1]
    assert [d["image_seed"] for d in first] == [derive_seed(seed, 0), derive_seed(seed, 1)]
    assert {d["method"] for d in first} == {"lantern++"}
    again = client.post("/v1/images/generations",
                        json={"prompt": "4", "n": 2, "seed": seed, "return_tokens": True}).json()["data"]
    assert [d["tokens"] for d in again] == [d["tokens"] for d in first]


def test_health_ready_and_metrics(server):
    client, _, served = server
    assert client.get("/health").json() == {"status": "ok"}
    ready = client.get("/ready")
    assert ready.status_code == 200 and ready.json()["method"] == "lantern++"
    assert ready.json()["compile_keys"]["lantern++"].startswith("lantern++-b3-")
    client.post("/v1/images/generations", json={"prompt": "5", "seed": 1})
    text = client.get("/metrics").text
    for name in ("lantern_queue_depth", "lantern_slots_busy", "lantern_images_total", "lantern_tau",
                 "lantern_image_latency_seconds_bucket", "lantern_image_queue_seconds_count",
                 'lantern_method_info{method="lantern++"}', "lantern_requests_rejected_total"):
        assert name in text, name
    assert "lantern_steps_recompiled 0.0" in text
    engine = client.app.state.metrics.engine
    engine.capture_count["lantern++.verify"] = engine.capture_count.get("lantern++.verify", 0) + 1  # as a recompile would
    try:
        assert "lantern_steps_recompiled 1.0" in client.get("/metrics").text
    finally:
        engine.capture_count["lantern++.verify"] -= 1


def test_an_unexpected_error_is_openais_500_without_a_traceback(server, monkeypatch):
    """An exception no route handles (here: encoding the images) answers OpenAI's 500 body with the
    request id; the traceback goes to the log only, and the server goes on."""
    client, _, served = server

    def broken(*_):
        raise RuntimeError("the encoder broke")

    monkeypatch.setattr(served, "encode", broken)
    answer = TestClient(client.app, raise_server_exceptions=False).post("/v1/images/generations",
                                                                         json={"prompt": "2", "seed": 1})
    assert answer.status_code == 500
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "server_error"
    assert answer.headers["x-request-id"] in error["message"] and "Traceback" not in answer.text
    monkeypatch.undo()
    assert client.post("/v1/images/generations", json={"prompt": "2", "seed": 1}).status_code == 200


def test_the_committed_openapi_schema_is_the_servers(server):
    client, _, _ = server
    committed = Path(__file__).resolve().parents[1] / "docs" / "reference" / "openapi.json"
    served = client.get("/openapi.json").json()
    served["info"]["version"] = "VERSION"
    assert json.loads(committed.read_text()) == served, (
        "docs/reference/openapi.json is stale: python -m runtime.serve.schema --out docs/reference/openapi.json")


def _get(url: str, timeout: float = 5) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


@pytest.mark.slow
def test_a_real_server_frees_a_gone_clients_slots_refuses_a_bad_request_alone_and_drains_on_sigterm(tmp_path):
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "runtime", "serve", "--device", "cpu", "--no-graph", "--port",
                             str(port), "--batch-size", "2", "--method", "ar"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 180
        while time.time() < deadline:
            try:
                if _get(base + "/ready")[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.3)
        else:
            pytest.fail("the server did not become ready: " + proc.stderr.read()[-2000:])
        result: dict[str, object] = {}

        def ask() -> None:
            body = json.dumps({"prompt": "4", "n": 4, "seed": 3}).encode()
            req = urllib.request.Request(base + "/v1/images/generations", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=180) as r:
                result["status"], result["body"] = r.status, json.loads(r.read())

        # a client that goes away mid-request frees its slots: ask for 8 images, then hang up
        with socket.create_connection(("127.0.0.1", port)) as gone:
            body = json.dumps({"prompt": "2", "n": 8, "seed": 1}).encode()
            gone.sendall(b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            time.sleep(0.5)
        deadline = time.time() + 60
        while time.time() < deadline:
            metrics = _get(base + "/metrics")[1].decode()
            if "lantern_slots_busy 0.0" in metrics and "lantern_queue_depth 0.0" in metrics:
                break
            time.sleep(0.25)
        else:
            pytest.fail("a disconnected client's images kept their slots: " + metrics[:600])
        made = float(re.search(r"^lantern_images_total (\S+)$", metrics, re.M).group(1))
        assert made < 8, f"all {made:g} images of the gone client were made: its slots were not freed"
        # a bad request amid good ones is refused alone
        bad: dict[str, object] = {}

        def ask_bad() -> None:
            req = urllib.request.Request(base + "/v1/images/generations", data=b'{"prompt": "99"}',
                                         headers={"Content-Type": "application/json"})
            try:
                urllib.request.urlopen(req, timeout=60)
            except urllib.error.HTTPError as err:
                bad["status"] = err.code

        asker = threading.Thread(target=ask)
        asker.start()
        threading.Thread(target=ask_bad).start()
        time.sleep(1.0)  # the request is in flight
        proc.send_signal(signal.SIGTERM)
        asker.join(180)
        assert result.get("status") == 200 and len(result["body"]["data"]) == 4  # type: ignore[index]
        assert bad.get("status") == 400
        assert proc.wait(60) == 0, proc.stderr.read()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
def test_the_load_test_checks_every_image_and_compares_with_offline(tmp_path):
    out = tmp_path / "load.json"
    proc = subprocess.run([sys.executable, "-m", "runtime.serve.load", "--requests", "6", "--concurrency", "3",
                           "--max-n", "2", "--verify", "3", "--out", str(out), "--", "--device", "cpu", "--no-graph",
                           "--method", "sd", "--batch-size", "2"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["images"] == 9 and result["failed_requests"] == 0 and result["token_mismatches"] == 0
    assert result["server_exit_code"] == 0 and result["offline"]["images"] == 9
    assert result["latency_s"]["p99"] >= result["latency_s"]["p50"] > 0


@pytest.mark.slow
def test_sigterm_under_load_loses_nothing_admitted(tmp_path):
    """The SIGTERM comes after 4 of 16 requests are answered, with 4 clients in flight: the server
    exits 0 and every request sent before it got all its images, none half-served."""
    out = tmp_path / "drain.json"
    proc = subprocess.run([sys.executable, "-m", "runtime.serve.load", "--requests", "16", "--concurrency", "4",
                           "--max-n", "3", "--verify", "2", "--sigterm-after", "4", "--out", str(out), "--",
                           "--device", "cpu", "--no-graph", "--method", "sd", "--batch-size", "2"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    outcome = result["outcome"]
    assert result["server_exit_code"] == 0 and result["failed_requests"] == 0 and outcome["failed"] == 0
    stop = result["sigterm_at_s"]
    drained = [r for r in result["records"] if r.get("status") == 200 and r["answered_s"] > stop]
    assert outcome["served"] >= 4 and drained  # requests in flight at the SIGTERM were finished
    assert outcome["served"] + outcome["refused"] + outcome["not_sent"] == 16 and outcome["not_sent"] > 0
    assert result["token_mismatches"] == 0


def test_method_auto_serves_each_occupancy_with_the_tables_method(demo):
    """[auto] = {1: lantern++ (exact), 2: ar}: a lone image is made by lantern++ at lambda 1, a
    request of four (occupancy 2 = the batch) by AR; each image's tokens are that method's."""
    from runtime.config.profiles import AutoSettings

    backend, loaded, _ = demo
    _, prof = open_backend("cpu", None, False, None)
    table = AutoSettings(by_occupancy={"1": "lantern++", "2": "ar"})
    specs = {m: resolve_spec(m, {"tree": "chain3"} if m == "lantern++" else {}, prof, loaded.recommended,
                             lossless=True) for m in table.methods}
    assert specs["lantern++"].lantern_lambda == 1.0
    app, engine, _ = build_server(loaded, specs["lantern++"], backend, batch_size=2, max_queue=16, timeout_s=120,
                                  auto=AutoMethods(specs, table))
    try:
        assert engine.ready.wait(120)
        client = TestClient(app)
        lone = client.post("/v1/images/generations", json={"prompt": "2", "seed": 5, "return_tokens": True}).json()
        four = client.post("/v1/images/generations", json={"prompt": "6", "n": 4, "seed": 8, "return_tokens": True}).json()
        by = {m: generate(loaded.target, loaded.drafter, specs[m], [2], seed=5, vq=loaded.vq).tokens for m in specs}
        assert lone["data"][0]["tokens"] == by["lantern++"][0].tolist() != by["ar"][0].tolist()
        ar4 = generate(loaded.target, None, specs["ar"], [6] * 4, seed=8).tokens
        assert [d["tokens"] for d in four["data"]] == ar4.tolist()
        assert engine.scheduler.switches >= 1 and engine.current == "ar"
        text = client.get("/metrics").text
        assert 'lantern_method_in_use{method="ar"} 1.0' in text and 'lantern_method_info{method="auto"}' in text
        assert client.get("/ready").json()["in_use"] == "ar"
    finally:
        engine.stop(drain=False, timeout=30)


def test_a_streamed_request_reports_progress_then_each_image_as_it_is_done_then_done(server, demo, monkeypatch):
    from runtime.serve import api

    monkeypatch.setattr(api, "PROGRESS_EVERY_S", 0.05)
    client, engine, _ = server
    events = []
    with client.stream("POST", "/v1/images/generations",
                       json={"prompt": "9", "n": 3, "seed": 21, "stream": True, "return_tokens": True}) as answer:
        assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/event-stream")
        kind = None
        for line in answer.iter_lines():
            if line.startswith("event: "):
                kind = line[len("event: "):]
            elif line.startswith("data: "):
                events.append((kind, line[len("data: "):]))
                kind = None
    assert events[-1] == (None, "[DONE]")
    parsed = [(kind, json.loads(data)) for kind, data in events[:-1]]
    assert all(kind == body["type"] for kind, body in parsed)
    completed = [body for kind, body in parsed if kind == "image_generation.completed"]
    progress = [body for kind, body in parsed if kind == "image_generation.progress"]
    assert len(completed) == 3 and len(parsed) == 3 + len(progress)
    images = sorted(completed, key=lambda d: d["index"])
    assert [d["index"] for d in images] == [0, 1, 2]
    expected = _offline_tokens(demo, 9, 21, 3)
    assert [d["tokens"] for d in images] == expected.tolist()
    assert all(d["b64_json"] and d["stats"]["tau"] >= 1 for d in images)
    # progress: some image reported before it was done, each image's count rising and below the total
    total = engine.decoder.config.num_tokens
    assert progress and all(p["tokens_total"] == total and 0 < p["tokens_done"] <= total for p in progress)
    for index in range(3):
        counts = [p["tokens_done"] for p in progress if p["index"] == index]
        assert counts == sorted(set(counts))
        done_at = next(k for k, (kind, body) in enumerate(parsed) if kind.endswith("completed") and body["index"] == index)
        assert all(body["index"] != index for kind, body in parsed[done_at + 1:] if kind.endswith("progress"))


def test_a_stream_with_partial_images_previews_each_image_from_its_committed_tokens(server, demo, monkeypatch):
    """partial_images 2: each image sends up to two `image_generation.partial_image` previews, in
    order, before it is completed; each is exactly the VQ decode of the image's first tokens_done
    tokens (those of the finished image) with code 0 after them and those positions painted gray."""
    from runtime.generation.pipeline import decode_tokens
    from runtime.serve import api

    monkeypatch.setattr(api, "PROGRESS_EVERY_S", 0.02)
    client, engine, _ = server
    _, loaded, _ = demo
    events = []
    with client.stream("POST", "/v1/images/generations",
                       json={"prompt": "4", "n": 2, "seed": 5, "stream": True, "partial_images": 2,
                             "return_tokens": True}) as answer:
        assert answer.status_code == 200
        for line in answer.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[len("data: "):]))
    total = engine.decoder.config.num_tokens
    grid = int(total ** 0.5)
    finals = {e["index"]: e for e in events if e["type"] == "image_generation.completed"}
    assert sorted(finals) == [0, 1]
    shown = 0
    for index, final in finals.items():
        previews = [e for e in events if e["type"] == "image_generation.partial_image" and e["index"] == index]
        assert [e["partial_image_index"] for e in previews] == list(range(len(previews))) and len(previews) <= 2
        done_at = events.index(final)
        assert all(events.index(e) < done_at for e in previews)
        for e in previews:
            k = e["tokens_done"]
            assert e["partial_image_index"] < 2 and (e["partial_image_index"] + 1) * total / 3 <= k < total
            assert e["size"] == final["size"] == "64x64" and e["output_format"] == "png"
            tokens = torch.tensor(final["tokens"])
            tokens[k:] = 0
            expected = decode_tokens(loaded.vq, tokens[None])[0].copy()
            patch = expected.shape[0] // grid
            row, col = divmod(k, grid)
            expected[(row + 1) * patch:] = 128
            expected[row * patch:(row + 1) * patch, col * patch:] = 128
            got = _png_array(e["b64_json"])
            assert np.array_equal(got, expected)
            assert (got[: row * patch] != 128).any()  # the known rows are drawn
        shown += len(previews)
    assert shown >= 1  # progress is read every few steps: an image this long is caught mid-way


def test_partial_images_without_a_stream_are_refused(server):
    client, _, _ = server
    answer = client.post("/v1/images/generations", json={"prompt": "4", "partial_images": 1})
    assert answer.status_code == 400
    assert answer.json()["error"]["message"].startswith("partial_images: previews are sent as events of a stream")


def _tiny_t5(folder: Path, d_model: int) -> Path:
    """A random 1-layer T5 encoder (width `d_model`) and a word-level tokenizer, saved like an HF model."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast, T5Config, T5EncoderModel

    words = "a photo of cat red car on the street dog sleeps bird flies over sea".split()
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    torch.manual_seed(0)
    model = T5EncoderModel(T5Config(vocab_size=len(vocab), d_model=d_model, d_kv=4, d_ff=32, num_layers=1,
                                    num_heads=2, relative_attention_num_buckets=8))
    tokenizer.save_pretrained(folder)
    model.save_pretrained(folder)
    return folder


def test_a_text_to_image_model_is_served_from_captions(tmp_path):
    """A LlamaGen t2i checkpoint with its T5 encoder: a caption's images are the tokens offline
    generation makes from that caption's features and seeds, whatever else is decoding; a
    class-style request is just a caption; the server refuses to start without the encoder."""
    from runtime.utils.errors import UserError
    from runtime.models.configs import gpt_config
    from runtime.models.gpt import Transformer
    from runtime.models.t5 import T5Encoder
    from runtime.serve.conditions import Captions
    from tiny_models import save_tiny_official

    save_tiny_official(tmp_path, "unused.pt", "vq.pt")
    torch.manual_seed(1)
    t2i = Transformer(gpt_config("GPT-tiny", model_type="t2i", image_size=64, vocab_size=16384))
    t2i.init_weights()
    torch.nn.init.normal_(t2i.output.weight, std=0.02)
    torch.save({"model": t2i.state_dict()}, tmp_path / "t2i.pt")
    t5 = _tiny_t5(tmp_path / "t5", t2i.config.caption_dim)
    backend, prof = open_backend("cpu", None, False, None)
    loaded = load_model(model=None, gpt_model="GPT-tiny", gpt_ckpt=str(tmp_path / "t2i.pt"), vq_ckpt=str(tmp_path / "vq.pt"),
                        image_size=64, drafter=None, gpt_type="t2i", trust=False, device=backend.device,
                        dtype=backend.dtype)
    spec = resolve_spec("sjd", {}, prof, loaded.recommended)
    with pytest.raises(UserError, match="--t5-path"):
        build_server(loaded, spec, backend, batch_size=2, max_queue=8, timeout_s=60, warm_up=False)
    encoder = T5Encoder(t5, device=backend.device, dtype=backend.dtype, max_length=loaded.config.cls_token_num)
    app, engine, _ = build_server(loaded, spec, backend, batch_size=2, max_queue=8, timeout_s=120,
                                  conditioner=Captions(encoder, backend.device, backend.dtype))
    try:
        assert engine.ready.wait(120)
        client = TestClient(app)
        asks = [dict(prompt="A red car on the street", n=2, seed=5), dict(prompt="a dog sleeps", n=1, seed=8),
                dict(prompt="3", n=1, seed=1)]
        answers = _ask_together(client, asks, timeout=180)
        for k, a in enumerate(asks):
            data = answers[k]["data"]
            assert [d["index"] for d in data] == list(range(a["n"]))
            assert all("class_id" not in d and d["revised_prompt"] == a["prompt"].lower() for d in data), data[0].keys()
            emb, mask = encoder.encode([a["prompt"]])
            expected = generate(loaded.target, None, spec, emb.expand(a["n"], -1, -1), cond_masks=mask.expand(a["n"], -1),
                                seed=a["seed"]).tokens
            assert [d["tokens"] for d in data] == expected.tolist(), a
        assert client.post("/v1/images/generations", json={"prompt": "   "}).status_code == 400
    finally:
        engine.stop(drain=False, timeout=30)


def test_serve_refuses_a_caption_encoder_for_a_class_model_with_one_line(run_cli, tmp_path):
    res = run_cli("serve", "--device", "cpu", "--no-graph", "--t5-path", str(tmp_path), "--port", "8011")
    assert res.exit_code == 2 and res.stderr.strip().count("\n") == 0
    assert "--t5-path does nothing for a class-conditional model" in res.stderr


@pytest.mark.parametrize("flags, message", [
    (["--shutdown-timeout", "0"], "--shutdown-timeout must be in (0, 3600] seconds"),
    (["--max-request-bytes", "10"], "--max-request-bytes must be at least 1024"),
    (["--allowed-origins", "app.example.com"], "--allowed-origins: 'app.example.com' is no origin"),
    (["--allowed-origins", "https://a.example.com/path"], "is no origin; give scheme://host[:port]"),
    (["--root-path", "lantern/"], "--root-path 'lantern/': start it with / and end it without one"),
    (["--api-key", " "], "--api-key / LANTERN_API_KEY is empty"),
    (["--served-model-name", "demo,,x"], "--served-model-name: each name must be 1 to 256 characters"),
    (["--host", "no.such.host.invalid"], "--host 'no.such.host.invalid'"),
])
def test_serve_refuses_a_bad_http_option_with_one_line_before_loading(run_cli, flags, message):
    res = run_cli("serve", "--device", "cpu", "--no-graph", "--port", str(free_port()), *flags)
    assert res.exit_code == 2 and res.stderr.strip().count("\n") == 0, res.stderr
    assert message in res.stderr


def test_serve_refuses_a_port_in_use_with_one_line(run_cli):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        res = run_cli("serve", "--device", "cpu", "--no-graph", "--port", str(taken.getsockname()[1]))
    assert res.exit_code == 2 and res.stderr.strip().count("\n") == 0, res.stderr
    assert "Address already in use; choose another --port" in res.stderr
