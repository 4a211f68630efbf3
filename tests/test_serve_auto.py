"""`runtime serve --method auto` as an operator runs it: one real server process (the demo, the
shipped cpu-serve profile as a file of the operator's own whose [auto] table serves lantern++ at low
occupancy: its own lantern++ relaxes at lambda 5 while auto serves it exact) with two served
model names and -v, its stderr a file (not a terminal).

- the API lists and accepts the served names, not the table's method names;
- each image's `reproduce` line, run offline with the server's model, device and profile flags,
  makes the image's tokens again;
- the log is one line per record, each with its UTC time; an access line names the client;
- /ready shows the profile's tree by its file name, no path of the machine;
- an empty LANTERN_API_KEY refuses to start (it would serve the API to anyone)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from serve_process import serving

pytest.importorskip("fastapi", reason="runtime serve needs the serve extra (in the test extra)")

TABLE = 'by_occupancy = { 1 = "lantern++", 8 = "ar" }'


@pytest.fixture(scope="module")
def flags(tmp_path_factory) -> list[str]:
    """What the server and each reproduce line run with: cpu-serve and its tree copied, its [auto]
    table set to TABLE (on the CPU that profile was tuned on, AR is the faster at every occupancy
    now, which would leave nothing speculative to serve)."""
    import profiles

    shipped = Path(profiles.__file__).parent
    folder = tmp_path_factory.mktemp("profile")
    shutil.copy(shipped / "cpu-serve.tree.toml", folder)
    text = (shipped / "cpu-serve.toml").read_text()
    lines = [TABLE if line.startswith("by_occupancy") else line for line in text.splitlines()]
    assert TABLE in lines
    (folder / "cpu-serve.toml").write_text("\n".join(lines) + "\n")
    return ["--profile-name", str(folder / "cpu-serve.toml"), "--no-graph"]


def _get(url: str) -> dict:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=60) as answer:
        return json.loads(answer.read())


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(request, timeout=300) as answer:
        return json.loads(answer.read())


@pytest.fixture(scope="module")
def server(tmp_path_factory, flags):
    log = tmp_path_factory.mktemp("serve-auto") / "stderr.txt"
    argv = [*flags, "--method", "auto", "--batch-size", "8", "--served-model-name", "demo,gpt-image-1"]
    with serving(argv, log, verbose=True, within=240) as port:
        yield f"http://127.0.0.1:{port}", log


@pytest.mark.slow
def test_auto_serves_the_model_names_and_each_images_reproduce_line_gives_its_tokens(server, flags, tmp_path):
    base, log = server
    assert [m["id"] for m in _get(base + "/v1/models")["data"]] == ["demo", "gpt-image-1"]
    info = _get(base + "/info")
    assert info["names"] == ["demo", "gpt-image-1"] and info["method"] == "auto"
    startup = next(line for line in log.read_text().splitlines() if "runtime serve: " in line)
    assert "model demo, gpt-image-1" in startup and "method auto" in startup

    answer = _post(base + "/v1/images/generations",
                   {"model": "demo", "prompt": "3", "n": 2, "seed": 11, "return_tokens": True})
    data = answer["data"]
    assert {d["method"] for d in data} == {"lantern++"}  # occupancy 2: the table's lantern++, exact
    line = data[0]["reproduce"]
    assert all(d["reproduce"] == line for d in data) and "--lantern-lambda 1.0" in line, line
    argv = shlex.split(line)
    assert argv[:2] == ["runtime", "run"] and "--seed" in argv and "--num-images" in argv
    out = tmp_path / "offline"
    done = subprocess.run([sys.executable, "-m", "runtime", *argv[1:], "--device", "cpu", *flags, "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    offline = np.load(out / "tokens.npy")
    assert [d["tokens"] for d in data] == offline.tolist()
    ready = _get(base + "/ready")
    assert ready["settings"]["tree"] == "cpu-serve.tree.toml" and "/" not in json.dumps(ready["settings"])

    # -v off a terminal: one line per record, its UTC time first; the access line names the client
    lines = log.read_text().splitlines()
    access = [x for x in lines if "runtime.serve.access:" in x and "/v1/images/generations" in x]
    assert len(access) == 1, lines
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z INFO runtime\.serve\.access: [0-9a-f]{32} "
                        r"127\.0\.0\.1:\d+ POST /v1/images/generations 200 images=2 method=lantern\+\+ \d+\.\d{3}s",
                        access[0]), access[0]
    records = [x for x in lines if not x.startswith("runtime serve: ")]
    assert records and all(re.match(r"\d{4}-\d\d-\d\dT", x) for x in records), records


def test_an_empty_api_key_in_the_environment_refuses_to_start():
    done = subprocess.run([sys.executable, "-m", "runtime", "serve", "--device", "cpu", "--port", "1"],
                          env={**os.environ, "LANTERN_API_KEY": ""}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "error: LANTERN_API_KEY is set but empty (a Secret mounted empty?), which would serve the API to anyone; "
        "put the key in it, or unset it to serve without a key"], done.stderr
