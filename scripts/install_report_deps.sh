#!/usr/bin/env bash
# Install the system tools the report needs (idempotent): Graphviz `dot` lays out the FX graph,
# Chromium renders report.html headless in tests/report/test_report_chromium.py.
# Installs only what is missing, so a warm machine pays nothing. Needs root (or sudo) for apt-get.
# Another package manager at work (unattended-upgrades, a second apt-get) is waited for, up to
# APT_LOCK_TIMEOUT_S seconds (default 300), instead of failing on its lock.
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
lock_wait_s="${APT_LOCK_TIMEOUT_S:-300}"
# DPkg::Lock::Timeout makes `install` wait for dpkg's locks; `update` takes the lists lock
# without it (apt 2.6), so that one is retried while another process holds it.
# (`env` inside sudo: sudo resets the environment, DEBIAN_FRONTEND included.)
apt_=($sudo_ env DEBIAN_FRONTEND=noninteractive apt-get -o "DPkg::Lock::Timeout=$lock_wait_s")

update() {
  local deadline=$((SECONDS + lock_wait_s)) out said=""
  while true; do
    if out=$("${apt_[@]}" update -qq 2>&1); then
      [ -z "$out" ] || echo "$out" >&2
      return 0
    fi
    if grep -qE "Could not get lock|Unable to lock" <<<"$out" && [ "$SECONDS" -lt "$deadline" ]; then
      if [ -z "$said" ]; then
        echo "install_report_deps: another package manager holds apt's lock; waiting (up to ${lock_wait_s} s)" >&2
        said=1
      fi
      sleep 3
      continue
    fi
    echo "$out" >&2
    return 1
  done
}

echo "install_report_deps: installing ${missing[*]}" >&2
update
"${apt_[@]}" install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
