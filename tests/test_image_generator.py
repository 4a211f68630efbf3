"""`runtime.ImageGenerator`, the library face: a fresh process's one-liner works; its tokens are
`runtime run`'s (through the reproduce line it reports) on the demo and on the tiny Janus-Pro and
Emu3, and the server's for the same request; bad keywords and values raise the CLI's line;
`stream` yields before the batch is done with `generate`'s tokens; `close()` returns the model;
one thread at a time."""

from __future__ import annotations

import gc
import os
import shlex
import subprocess
import sys
import threading
import weakref
from pathlib import Path

import numpy as np
import pytest

from runtime import ImageGenerator, UserError

DEMO = dict(device="cpu", graph=False)


def _run_line(run_cli, line: str, out: Path, *extra: str):
    """`runtime run` with the arguments of a reproduce line, into `out`."""
    argv = shlex.split(line)
    assert argv[:2] == ["runtime", "run"], line
    return run_cli(*argv[1:], *extra, "--out", str(out))


def test_the_one_liner_runs_in_a_fresh_process() -> None:
    code = "from runtime import ImageGenerator; g = ImageGenerator(); print(g.generate(num_images=2).images)"
    env = {**os.environ, "LANTERN_GRAPH": "0"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.count("<PIL.Image.Image image mode=RGB size=64x64") == 2


@pytest.mark.parametrize("method,options", [("lantern++", {"tree": "chain3", "lantern_lambda": 2.0}),
                                            ("sjd", {"window": 6}), ("ar", {})])
def test_generate_gives_runtime_runs_tokens_for_its_reproduce_line(run_cli, tmp_path, method, options) -> None:
    with ImageGenerator(method=method, **DEMO, **options) as g:
        out = g.generate(classes=[0, 3, 5], num_images=4, seed=7, batch_size=2)
    assert out.tokens.shape == (4, 256) and len(out.images) == 4 and out.images[0].size == (64, 64)
    assert out.labels == [0, 3, 5, 0] and out.method == method and out.batch_size == 2
    assert set(out.timings["phases"]) >= {"prefill", "decode"} and out.tau >= 1.0
    res = _run_line(run_cli, out.command, tmp_path / "run")
    assert res.exit_code == 0, res.stderr
    assert np.array_equal(np.load(tmp_path / "run" / "tokens.npy"), out.tokens.numpy())


def test_a_bad_keyword_or_value_raises_the_clis_line(run_cli, tmp_path) -> None:
    with pytest.raises(UserError, match="unknown option 'temprature'.*did you mean 'temperature'"):
        ImageGenerator(temprature=0.5, **DEMO)
    with pytest.raises(UserError) as bad:
        ImageGenerator(temperature=-1, **DEMO)
    res = run_cli("run", "--temperature", "-1", "--device", "cpu", "--out", str(tmp_path / "x"))
    assert res.exit_code == 2 and res.stderr.strip() == f"error: {bad.value}"
    with pytest.raises(UserError) as unread:
        ImageGenerator(method="ar", depth=3, **DEMO)
    res = run_cli("run", "--method", "ar", "--depth", "3", "--device", "cpu", "--out", str(tmp_path / "y"))
    assert res.exit_code == 2 and res.stderr.strip() == f"error: {unread.value}"
    with pytest.raises(UserError, match="Invalid value for '--temperature'"):
        ImageGenerator(temperature="hot", **DEMO)
    with pytest.raises(UserError, match="--attention 'fast' is not a kernel setting"):
        ImageGenerator(attention="fast", **DEMO)
    g = ImageGenerator(**DEMO)
    with pytest.raises(UserError, match="--classes: class 99 is out of range"):
        g.generate(classes=[99])
    with pytest.raises(UserError, match="--prompts is for text-to-image models"):
        g.generate(["a cat"])
    with pytest.raises(UserError, match="--num-images must be >= 1"):
        g.generate(num_images=0)


def test_stream_yields_images_before_the_batch_is_done_with_generates_tokens() -> None:
    g = ImageGenerator(method="lantern++", tree="chain3", **DEMO)
    busy_at_first: list[int] = []
    seen: list[tuple[int, int]] = []
    items = []
    for item in g.stream(classes=[0, 1, 2, 3], batch_size=4, seed=2, progress=lambda d, t: seen.append((d, t))):
        if not items:
            decoder = next(iter(g._decoders.values()))
            busy_at_first.append(len(decoder.busy()))
        items.append(item)
    assert busy_at_first[0] >= 1  # the first image came while others were still decoding
    assert seen == [(1, 4), (2, 4), (3, 4), (4, 4)]
    whole = g.generate(classes=[0, 1, 2, 3], batch_size=4, seed=2)
    assert sorted(i.index for i in items) == [0, 1, 2, 3]
    for item in items:
        assert (item.tokens == whole.tokens[item.index]).all() and item.seed == whole.seeds[item.index]
        # decoded alone, not in a batch of 4: the VQ decoder's convolutions may round a level apart
        diff = np.abs(np.asarray(item.image).astype(int) - whole.arrays[item.index].astype(int))
        assert diff.max() <= 2
    g.close()


def test_close_returns_the_model_and_refuses_later_calls() -> None:
    g = ImageGenerator(**DEMO)
    g.generate(num_images=1)
    target, decoder = weakref.ref(g.loaded.target), weakref.ref(next(iter(g._decoders.values())))
    g.close()
    gc.collect()
    assert target() is None and decoder() is None  # nothing of the model or its decoder is held
    with pytest.raises(UserError, match="closed"):
        g.generate(num_images=1)
    g.close()  # idempotent
    with ImageGenerator(**DEMO) as h:
        h.generate(num_images=1)
    assert repr(h) == "ImageGenerator(closed)"


def test_one_thread_at_a_time_and_several_generators_in_a_process() -> None:
    g, other = ImageGenerator(**DEMO), ImageGenerator(method="ar", **DEMO)
    stream = g.stream(classes=[0, 1], batch_size=2)
    next(stream)  # a stream in progress holds the generator
    errors: list[BaseException] = []

    def call() -> None:
        try:
            g.generate(num_images=1)
        except RuntimeError as err:
            errors.append(err)

    worker = threading.Thread(target=call)
    worker.start()
    worker.join()
    assert errors and "one thread at a time" in str(errors[0])
    assert other.generate(classes=[4]).tokens.shape == (1, 256)  # another generator is free meanwhile
    list(stream)
    assert g.generate(classes=[4]).tokens.shape == (1, 256)


def test_the_server_answers_a_request_with_the_generators_tokens() -> None:
    pytest.importorskip("fastapi")
    pytest.importorskip("httpx")
    from fastapi.testclient import TestClient

    from runtime.serve import build_server

    g = ImageGenerator(method="lantern++", tree="chain3", **DEMO)
    app, engine, _ = build_server(g.loaded, g.spec_for(2), g.backend, batch_size=2, max_queue=8, timeout_s=120)
    try:
        assert engine.ready.wait(120)
        answer = TestClient(app).post("/v1/images/generations",
                                      json={"prompt": "3", "n": 2, "seed": 5, "return_tokens": True}).json()
    finally:
        engine.stop(drain=False, timeout=30)
    assert [d["tokens"] for d in answer["data"]] == g.generate(classes=[3], num_images=2, seed=5).tokens.tolist()


@pytest.mark.slow
def test_janus_and_emu3_by_hub_id_give_runtime_runs_tokens(run_cli, tmp_path, monkeypatch) -> None:
    pytest.importorskip("transformers")
    import hf_tiny

    home = tmp_path / "hf_home"
    hf_tiny.write_hub_cache(home)
    hf_tiny.use_hub_cache(monkeypatch, home)
    prompts = ["a red cat", "the blue dog on the grass"]
    (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n")
    for model, extra in ((hf_tiny.JANUS_ID, {}), (hf_tiny.EMU3_ID, {"image_size": hf_tiny.EMU3_GRID * 8})):
        with ImageGenerator(model, method="sjd", **DEMO, **extra) as g:
            out = g.generate(prompts, num_images=3, seed=4, batch_size=2)
        assert out.labels == [prompts[0], prompts[1], prompts[0]]
        run_dir = tmp_path / model.replace("/", "_")
        res = _run_line(run_cli, out.command.replace("prompts.txt", str(tmp_path / "prompts.txt")), run_dir)
        assert res.exit_code == 0, res.stderr
        assert np.array_equal(np.load(run_dir / "tokens.npy"), out.tokens.numpy()), model
