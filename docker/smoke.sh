#!/usr/bin/env bash
# The build check every image runs (and CI runs in a plain venv): the CLI starts, the image's
# hardware profiles load, and one demo image is generated on the CPU (no accelerator is present
# at build time). Usage: smoke.sh PROFILE [PROFILE ...]
set -euo pipefail

runtime --help > /dev/null
python3 - "$@" <<'PY'
import sys

from runtime.profiles import load_profile

for name in sys.argv[1:]:
    profile = load_profile(name)
    print(f"profile {profile.name}: {profile.method.name}, tree {profile.tree.name}, dtype {profile.device.dtype}")
PY
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
runtime -q run --device cpu --num-images 1 --out "$out/demo" > /dev/null
test -f "$out/demo/result.json"
echo "smoke: ok"
