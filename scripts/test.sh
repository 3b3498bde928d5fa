#!/usr/bin/env bash
# Set up the dev environment (idempotent) and run the whole test suite.
# The tests start and stop their own Redis, SeaweedFS S3, gRPC server and Celery workers.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh dev
# Graphviz lays out the report's graph drawing; Chromium renders the report in its test.
bash scripts/install_report_deps.sh
# promtool checks the optional PrometheusRule (tests/deploy/test_prometheus_rules.py).
bash scripts/install_promtool.sh
# The house's gates first (ruff, mypy): a minute, and they fail before the suite's eleven.
bash scripts/lint.sh
python -m pytest -m "not gpu" "$@"
