#!/usr/bin/env bash
# The README's first command on a fresh machine: set up, start fxport in its embedded default,
# submit an example model through the client, print the result table, keep the artifacts.
#   bash scripts/demo.sh            → artifacts/ (model.ts, model.onnx, model.pt2, fx_source/, manifest.json)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh dev

model=examples/cnn_bn.pt2
python examples/make_example_model.py "$model"

# The embedded default: in-process workers, SQLite job store and artifact files under ./.fxport.
work=$(mktemp -d)
port=$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
fxport serve --listen "127.0.0.1:$port" --ready-file "$work/ready" >"$work/serve.log" 2>&1 &
server_pid=$!
cleanup() {
  kill "$server_pid" 2>/dev/null || true
  wait "$server_pid" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

for _ in $(seq 1 100); do
  [ -f "$work/ready" ] && break
  if ! kill -0 "$server_pid" 2>/dev/null; then cat "$work/serve.log" >&2; exit 1; fi
  sleep 0.1
done
[ -f "$work/ready" ] || { echo "fxport serve did not start" >&2; cat "$work/serve.log" >&2; exit 1; }
echo "fxport serving on $(cat "$work/ready") (embedded; state in ./.fxport)"

rm -rf artifacts
fxport submit "$model" --spec examples/deploy.yaml --server "$(cat "$work/ready")" --wait --timeout 600 --out artifacts/
echo
ls -l artifacts/
