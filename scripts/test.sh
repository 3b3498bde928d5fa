#!/usr/bin/env bash
# Set up the dev environment (idempotent) and run the whole test suite.
# The tests start and stop their own Redis, SeaweedFS S3, gRPC server and Celery workers.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh dev
python -m pytest -m "not gpu" "$@"
