#!/usr/bin/env bash
# Put `promtool` (Prometheus's rule checker) in .venv/bin, for tests/deploy/test_prometheus_rules.py.
# Taken from Debian's `prometheus` package without installing it (no service, no dependencies):
# `apt-get download`, then only usr/bin/promtool out of the .deb. Idempotent; needs apt's lists
# (run after install_report_deps.sh, which updates them when it installs anything).
set -euo pipefail
cd "$(dirname "$0")/.."
if command -v promtool >/dev/null 2>&1 || [ -x .venv/bin/promtool ]; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "install_promtool: apt-get not found; put promtool (Prometheus 2.x) on PATH by hand" >&2
  exit 1
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if ! (cd "$work" && apt-get download -qq prometheus 2>/dev/null); then
  apt-get update -qq
  (cd "$work" && apt-get download -qq prometheus)
fi
dpkg-deb -x "$work"/prometheus_*.deb "$work/root"
install -m 0755 "$work/root/usr/bin/promtool" .venv/bin/promtool
echo "install_promtool: $(.venv/bin/promtool --version 2>&1 | head -1)" >&2
