#!/usr/bin/env bash
# The build check every image runs (and CI runs in a plain venv): the CLI starts, the image's
# hardware profiles load, one demo image is generated on the CPU (no accelerator is present at
# build time), and `runtime serve` (the image's default command) becomes ready, answers one
# request and drains on SIGTERM with exit 0. Usage: smoke.sh PROFILE [PROFILE ...]
set -euo pipefail

runtime --help > /dev/null
python3 - "$@" <<'PY'
import sys

from runtime.config.profiles import load_profile

for name in sys.argv[1:]:
    profile = load_profile(name)
    print(f"profile {profile.name}: {profile.method.name}, tree {profile.tree.name}, dtype {profile.device.dtype}")
PY
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
runtime -q run --device cpu --num-images 1 --out "$out/demo" > /dev/null
test -f "$out/demo/result.json"

port="${SMOKE_PORT:-18765}"
runtime -q serve --device cpu --no-graph --method ar --batch-size 1 --port "$port" > "$out/serve.log" 2>&1 &
server=$!
python3 - "$port" <<'PY'
import json, sys, time, urllib.request

base = f"http://127.0.0.1:{sys.argv[1]}"
for _ in range(600):
    try:
        if urllib.request.urlopen(base + "/ready", timeout=2).status == 200:
            break
    except OSError:
        time.sleep(0.5)
else:
    sys.exit("runtime serve did not become ready")
request = urllib.request.Request(base + "/v1/images/generations", data=json.dumps({"prompt": "0"}).encode(),
                                 headers={"Content-Type": "application/json"})
body = json.loads(urllib.request.urlopen(request, timeout=300).read())
assert len(body["data"]) == 1 and body["data"][0]["b64_json"], body
PY
kill -TERM "$server"
wait "$server" || { cat "$out/serve.log"; exit 1; }
echo "smoke: ok"
