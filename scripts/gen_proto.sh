#!/usr/bin/env bash
# Regenerate the Python gRPC stubs in fxport/v1/ from proto/fxport/v1/*.proto.
# Usage: scripts/gen_proto.sh [OUT_DIR]   (default: the repo root; tests pass a temp dir)
# The stubs are committed; tests/service/test_proto_stubs.py fails when they are stale.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-.}"
mkdir -p "$out"
python -m grpc_tools.protoc -Iproto \
  --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  proto/fxport/v1/*.proto
