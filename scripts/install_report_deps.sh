#!/usr/bin/env bash
# Install the system tools the report needs (idempotent): Graphviz `dot` lays out the FX graph,
# Chromium renders report.html headless in tests/report/test_report_chromium.py.
# Installs only what is missing, so a warm machine pays nothing. Needs root (or sudo) for apt-get.
set -euo pipefail
missing=()
command -v dot >/dev/null 2>&1 || missing+=(graphviz)
command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || missing+=(chromium)
if [ "${#missing[@]}" -eq 0 ]; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "install_report_deps: apt-get not found; install ${missing[*]} by hand" >&2
  exit 1
fi
sudo_=""
if [ "$(id -u)" -ne 0 ]; then sudo_="sudo"; fi
echo "install_report_deps: installing ${missing[*]}" >&2
$sudo_ apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo_ apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
