"""Where /metrics listens (issue 42, item 4): the port a process bound is logged (FXPORT_METRICS_PORT=0
picks one), a worker's port is its own setting (FXPORT_WORKER_METRICS_PORT), and a port another
process holds is one error line naming the setting and exit 2, not a traceback."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tests.fixtures.servers import scaled

FXPORT = [sys.executable, "-m", "fxport.cli"]


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FXPORT_")}
    env.update(FXPORT_HOME=str(tmp_path / "home"), FXPORT_LISTEN="127.0.0.1:0", FXPORT_LOG_FORMAT="json", **extra)
    return env


def _held_port() -> socket.socket:
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    return held


def test_a_busy_metrics_port_is_one_error_line_and_exit_2(tmp_path, redis_server):
    with _held_port() as held:
        port = held.getsockname()[1]
        serve = subprocess.run([*FXPORT, "serve"], env=_env(tmp_path, FXPORT_METRICS_PORT=str(port)),
                               capture_output=True, text=True, timeout=scaled(120))
        worker = subprocess.run([*FXPORT, "worker"], capture_output=True, text=True, timeout=scaled(120),
                                env=_env(tmp_path, FXPORT_BROKER_URL=redis_server.url, FXPORT_METRICS_PORT="0",
                                         FXPORT_WORKER_METRICS_PORT=str(port)))
    for proc, command, setting in ((serve, "serve", "FXPORT_METRICS_PORT"),
                                   (worker, "worker", "FXPORT_WORKER_METRICS_PORT")):
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr
        (line,) = [x for x in proc.stderr.splitlines() if "error" in x]
        assert line.startswith(f"fxport {command}: error: cannot serve metrics on 127.0.0.1:{port}: another process "
                               f"listens there; choose another {setting}"), line


def test_the_port_chosen_for_metrics_is_logged_and_serves(tmp_path):
    proc = subprocess.Popen([*FXPORT, "serve"], env=_env(tmp_path, FXPORT_METRICS_PORT="0"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + scaled(60)
        bound = None
        while bound is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            if line.startswith("{"):
                record = json.loads(line)
                bound = record.get("metrics_port")
        assert bound, "no log line named the metrics port"
        text = urllib.request.urlopen(f"http://127.0.0.1:{bound}/metrics", timeout=10).read().decode()
        assert "fxport_build_info" in text
    finally:
        proc.terminate()
        proc.wait(timeout=scaled(60))
