#!/usr/bin/env bash
# An operator's checks of a container image, each named in the output with its result:
#
#   bash docker/check.sh cpu            # build the CPU image, then run every check below
#   bash docker/check.sh cuda|hpu       # build the vendor image (its official base), then the same checks
#   bash docker/check.sh cuda|hpu --stand-in
#                                       # the same Dockerfile over a stand-in base: BASE_IMAGE's Python
#                                       # with a CPU torch from TORCH_INDEX_URL; the image's vendor check
#                                       # (a CUDA torch, Intel's HPU bridge) skipped by argument
#
# Build arguments come from the environment, so the official bases stay the defaults and a
# machine without an image registry uses its stand-ins (../shared/tools/container-base.sh up
# exports them): BASE_IMAGE (the Python image for cpu, the vendor image for cuda / hpu),
# TORCH_INDEX_URL (where the CPU image's torch comes from), DOCKER_NET (e.g. --network host),
# PIP_INDEX_URL (a package mirror), HTTP(S)_PROXY (passed on to the build).
#
# Checks: build; runs_as_non_root; run_writes_results (`docker run IMAGE run` on the demo into a
# mounted folder, its files owned by the calling user); read_only_root (the same with
# --read-only and the documented writable mounts: /results and a tmpfs /tmp); healthy (the
# HEALTHCHECK reaches healthy); openai_client (the official client from the host gets an image);
# metrics (/metrics); drain_on_stop (`docker stop` during a request: the request is answered,
# the container exits 0 within the documented grace). Writes results/containers_KIND.json
# (image size, build seconds, cold start to /ready, stop-to-exit seconds, each check).
# Exit 0 only when every check that ran passed.
set -euo pipefail

kind=${1:?usage: docker/check.sh cpu|cuda|hpu [--stand-in]}
case "$kind" in cpu|cuda|hpu) ;; *) echo "docker/check.sh: unknown image kind '$kind'; use cpu, cuda or hpu" >&2; exit 2 ;; esac
stand_in=${2:-}
case "$stand_in" in
  "") ;;
  --stand-in) [ "$kind" != cpu ] || { echo "docker/check.sh: --stand-in is for cuda and hpu (the CPU image has no vendor base)" >&2; exit 2; } ;;
  *) echo "docker/check.sh: unknown option '$stand_in'; the only one is --stand-in" >&2; exit 2 ;;
esac
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
tag=${CHECK_TAG:-lantern-runtime:$kind-check}
net=${DOCKER_NET:-}
port=8000  # the image's default command serves here; with no bridge network that is the host's port
py=${PYTHON:-python}  # the host's Python with the official openai client (the test extra has it)
grace=30 # docker stop's -t: compose.yaml's stop_grace_period (the server drains within 25 s)
out=${CHECK_OUT:-results/containers_$kind${stand_in:+_stand_in}.json}
work=$(mktemp -d)
name=lantern-check-$kind-$$
declare -A result
order=()
failed=0

cleanup() {
  docker rm -f "$name" >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT

record() { # record NAME pass|fail|skip DETAIL
  order+=("$1")
  result[$1]="$2"
  printf 'check %-20s %-4s %s\n' "$1" "$2" "$3"
  printf '%s\t%s\t%s\n' "$1" "$2" "$3" >>"$work/checks.tsv"
  if [ "$2" = fail ]; then failed=1; fi
}

now() { python3 -c 'import time; print(time.monotonic())'; }

# -- build --------------------------------------------------------------------------------------
build_args=()
for var in PIP_INDEX_URL HTTP_PROXY HTTPS_PROXY NO_PROXY; do
  if [ -n "${!var:-}" ]; then build_args+=(--build-arg "$var=${!var}"); fi
done
torch_version=$(sed -n 's/^ARG TORCH_VERSION=//p' docker/Dockerfile.cpu)
stand_in_base=""
if [ -n "$stand_in" ]; then
  # Python and a CPU torch, where the vendor image has Python and its own torch build
  stand_in_base="local/torch-cpu:$torch_version"
  # shellcheck disable=SC2086
  docker build $net "${build_args[@]}" -t "$stand_in_base" - >"$work/stand-in.log" 2>&1 <<DOCKERFILE \
    || { tail -20 "$work/stand-in.log" >&2; exit 1; }
FROM ${BASE_IMAGE:-python:3.11-slim}
RUN python3 -m pip install --no-cache-dir --index-url "${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}" "torch==$torch_version"
DOCKERFILE
  build_args+=(--build-arg VENDOR_CHECK=skip)
  case "$kind" in
    cuda) build_args+=(--build-arg "BASE_IMAGE=$stand_in_base") ;;
    hpu) build_args+=(--build-arg "GAUDI_IMAGE=$stand_in_base" --build-arg "GAUDI_TORCH=$torch_version") ;;
  esac
elif [ "$kind" = cpu ]; then
  if [ -n "${BASE_IMAGE:-}" ]; then build_args+=(--build-arg "PYTHON_IMAGE=$BASE_IMAGE"); fi
  if [ -n "${TORCH_INDEX_URL:-}" ]; then build_args+=(--build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL"); fi
fi
t0=$(now)
# shellcheck disable=SC2086
if docker build $net "${build_args[@]}" -f "docker/Dockerfile.$kind" -t "$tag" . >"$work/build.log" 2>&1; then
  build_s=$(python3 -c "print(round($(now) - $t0, 1))")
  record build pass "docker/Dockerfile.$kind -> $tag in ${build_s} s${stand_in_base:+ over the stand-in $stand_in_base}"
  if [ -n "$stand_in" ]; then
    record vendor_check skip "$(grep -o 'vendor check skipped[^"]*' "$work/build.log" | head -1)"
  fi
else
  tail -30 "$work/build.log" >&2
  record build fail "docker build failed (the log's last lines above)"
  exit 1
fi
size=$(docker image inspect --format '{{.Size}}' "$tag")

# -- the image's user ---------------------------------------------------------------------------
uid=$(docker run --rm $net --entrypoint id "$tag" -u)
if [ "$uid" != 0 ]; then record runs_as_non_root pass "uid $uid"; else record runs_as_non_root fail "uid 0 (root)"; fi

# -- a batch job into a mounted folder, as the calling user ---------------------------------------
# root calling has no user of its own to compare with: the job runs as uid 1000 there
user="$(id -u):$(id -g)"
[ "$(id -u)" = 0 ] && user=1000:1000
mkdir -p "$work/results"
chown "$user" "$work/results"
if docker run --rm $net --user "$user" -v "$work/results:/results" "$tag" \
     -q run --device cpu --num-images 1 --out /results/demo >"$work/run.log" 2>&1 \
   && [ -f "$work/results/demo/result.json" ]; then
  owners=$(find "$work/results/demo" -printf '%U:%G\n' | sort -u | tr '\n' ' ')
  if [ "$owners" = "$user " ]; then record run_writes_results pass "demo image written, every file owned by $user"
  else record run_writes_results fail "files owned by $owners, not $user"; fi
else
  cat "$work/run.log" >&2; record run_writes_results fail "docker run IMAGE run failed"
fi

# -- a read-only root filesystem with the documented writable mounts ------------------------------
mkdir -p "$work/ro"
chown "$user" "$work/ro"
if docker run --rm $net --read-only --tmpfs /tmp --user "$user" -v "$work/ro:/results" "$tag" \
     -q run --device cpu --num-images 1 --out /results/demo >"$work/ro.log" 2>&1 \
   && [ -f "$work/ro/demo/result.json" ]; then
  record read_only_root pass "--read-only --tmpfs /tmp -v RESULTS:/results: demo image written"
else
  tail -20 "$work/ro.log" >&2; record read_only_root fail "the demo run failed on a read-only root"
fi

# -- the server: healthy, the OpenAI client, /metrics, docker stop during a request ---------------
base="http://127.0.0.1:$port"
t0=$(now)
# as an operator starts it: the image's default command (runtime serve on port 8000)
# shellcheck disable=SC2086
docker run -d --name "$name" $net "$tag" >/dev/null
ready_s=""
for _ in $(seq 600); do
  if curl -fs "$base/ready" >/dev/null 2>&1; then ready_s=$(python3 -c "print(round($(now) - $t0, 2))"); break; fi
  [ "$(docker inspect --format '{{.State.Running}}' "$name")" = true ] || break
  sleep 0.25
done
if [ -z "$ready_s" ]; then
  docker logs "$name" 2>&1 | tail -20 >&2
  record healthy fail "the server never answered /ready"
else
  health=""
  for _ in $(seq 120); do  # the HEALTHCHECK probes every 15 s
    health=$(docker inspect --format '{{.State.Health.Status}}' "$name")
    [ "$health" = healthy ] && break
    sleep 1
  done
  if [ "$health" = healthy ]; then record healthy pass "/ready in ${ready_s} s from docker run; HEALTHCHECK healthy"
  else record healthy fail "HEALTHCHECK says '$health'"; fi

  if "$py" - "$base" >"$work/client.log" 2>&1 <<'PY'
import base64, sys
try:
    from openai import OpenAI
except ImportError:
    sys.exit("the host's Python has no openai client: pip install openai (or set PYTHON)")

client = OpenAI(base_url=sys.argv[1] + "/v1", api_key="none")
answer = client.images.generate(model=client.models.list().data[0].id, prompt="0", n=1)
assert base64.b64decode(answer.data[0].b64_json)[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
PY
  then record openai_client pass "images.generate from the host: a PNG"
  else cat "$work/client.log" >&2; record openai_client fail "the official client got no image"; fi

  metrics=$(curl -fs "$base/metrics" || true)
  if grep -q '^lantern_images_total' <<<"$metrics"; then
    record metrics pass "$(grep -c '^lantern_' <<<"$metrics") lantern_ samples"
  else record metrics fail "/metrics has no lantern_images_total"; fi

  # a request of several images, then docker stop while it decodes
  "$py" - "$base" >"$work/drain.log" 2>&1 <<'PY' &
import json, sys, urllib.request
body = json.dumps({"prompt": "1", "n": 4}).encode()
request = urllib.request.Request(sys.argv[1] + "/v1/images/generations", data=body,
                                 headers={"Content-Type": "application/json"})
answer = json.loads(urllib.request.urlopen(request, timeout=300).read())
print("images", len(answer["data"]))
PY
  client=$!
  sleep 1
  t0=$(now)
  docker stop -t "$grace" "$name" >/dev/null
  stop_s=$(python3 -c "print(round($(now) - $t0, 2))")
  code=$(docker inspect --format '{{.State.ExitCode}}' "$name")
  if wait "$client" && grep -q '^images 4$' "$work/drain.log" && [ "$code" = 0 ]; then
    record drain_on_stop pass "the request in flight got its 4 images; exit 0 ${stop_s} s after docker stop (grace ${grace} s)"
  else
    cat "$work/drain.log" >&2
    record drain_on_stop fail "exit code $code after ${stop_s} s; the request in flight: $(tail -1 "$work/drain.log")"
  fi
fi

# -- docker/compose.yaml's service, brought up and down as a user would -------------------------
compose=""
if docker compose version >/dev/null 2>&1; then compose="docker compose"
elif command -v docker-compose >/dev/null; then compose=docker-compose; fi
if [ "$kind" != cpu ]; then
  : # the cuda and hpu services reserve devices this check has none of
elif [ -z "$compose" ]; then
  record compose_up_down skip "neither 'docker compose' nor docker-compose is installed"
else
  # the service as written, on the image just built and the host's network (no bridge here:
  # its port mapping is dropped, the server listens on the host's 8000 as the mapping would)
  mkdir -p "$work/compose/results" "$work/compose/checkpoints"
  chmod 0777 "$work/compose/results"
  "$py" - docker/compose.yaml "$tag" "$work/compose/compose.yaml" "${net:+host}" <<'PY'
import sys, yaml
source, tag, out, host = sys.argv[1:]
spec = yaml.safe_load(open(source))
service = spec["services"]["cpu"]
service.pop("build")
service["image"] = tag
if host:
    service.pop("ports", None)
    service["network_mode"] = "host"
yaml.safe_dump({"services": {"cpu": service}}, open(out, "w"))
PY
  project=lantern-check-$$
  export CHECKPOINTS_DIR="$work/compose/checkpoints" RESULTS_DIR="$work/compose/results"
  # shellcheck disable=SC2086
  if $compose -p "$project" -f "$work/compose/compose.yaml" up -d cpu >"$work/compose.log" 2>&1; then
    id=$($compose -p "$project" -f "$work/compose/compose.yaml" ps -q cpu)
    health=""
    for _ in $(seq 180); do
      health=$(docker inspect --format '{{.State.Health.Status}}' "$id" 2>/dev/null || true)
      [ "$health" = healthy ] && break
      sleep 1
    done
    $compose -p "$project" -f "$work/compose/compose.yaml" down >>"$work/compose.log" 2>&1 || health="$health, down failed"
    left=$(docker ps -aq --filter "label=com.docker.compose.project=$project")
    if [ "$health" = healthy ] && [ -z "$left" ]; then
      record compose_up_down pass "$compose up: the cpu service healthy; down: nothing left"
    else
      tail -20 "$work/compose.log" >&2
      record compose_up_down fail "health '$health'; containers left: ${left:-none}"
    fi
  else
    tail -20 "$work/compose.log" >&2
    record compose_up_down fail "$compose up failed"
  fi
fi

# -- the record -------------------------------------------------------------------------------
mkdir -p "$(dirname "$out")"
python3 - "$out" "$kind" "$tag" "$size" "${build_s:-}" "${ready_s:-}" "${stop_s:-}" "$work/checks.tsv" "$stand_in_base" <<'PY'
import datetime, json, platform, sys
out, kind, tag, size, build_s, ready_s, stop_s, tsv, stand_in = sys.argv[1:]
checks = [dict(zip(("name", "result", "detail"), line.rstrip("\n").split("\t"))) for line in open(tsv)]
num = lambda x: float(x) if x else None
json.dump({"image": kind, "tag": tag, "stand_in_base": stand_in or None, "size_bytes": int(size), "build_s": num(build_s),
           "cold_start_to_ready_s": num(ready_s), "stop_to_exit_s": num(stop_s),
           "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "host": f"{platform.machine()}, {__import__('os').cpu_count()} CPUs", "checks": checks},
          open(out, "w"), indent=1)
open(out, "a").write("\n")
PY
echo "docker/check.sh $kind: $([ $failed = 0 ] && echo 'every check passed' || echo 'FAILED'); $out"
exit $failed
