"""scripts/distributed.sh, the README's recipe for the distributed mode on one machine: it
starts Redis, SeaweedFS, `fxport serve` and a worker on loopback, a real client gets a job
through them at the address it printed, and `stop` leaves none of the processes it started."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fxport.client import Client
from tests.fixtures.servers import descendants

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "distributed.sh"
NAMES = {"redis", "seaweedfs", "api", "worker"}

pytestmark = pytest.mark.slow


def _start_time(pid: int) -> str | None:
    """Field 22 of /proc/PID/stat (None: no such process, or a zombie: it has stopped)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" else fields[19]


def _script(command: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), command], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _recorded(pids: Path) -> dict[str, tuple[int, str]]:
    return {f.stem: (int(f.read_text()), (pids / f"{f.stem}.started").read_text().strip())
            for f in pids.glob("*.pid")}


def test_the_script_starts_the_stack_serves_a_job_and_stop_leaves_nothing_it_started(tmp_path, tiny_pt2):
    local = tmp_path / "local"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FXPORT_", "AWS_"))}
    env.update(FXPORT_LOCAL_DIR=str(local), FXPORT_LOCAL_NO_SETUP="1", FXPORT_SANDBOX_THREADS="1",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}")
    started: dict[str, tuple[int, str]] = {}
    below: set[tuple[int, str]] = set()
    try:
        up = _script("start", env, timeout=600)
        assert up.returncode == 0, (up.stdout, up.stderr)
        server = re.search(r"^FXPORT_SERVER=(\S+)$", up.stdout, re.M)
        assert server, up.stdout
        address = server.group(1)
        assert address.startswith("127.0.0.1:") and "fxport submit" in up.stdout and "stop" in up.stdout
        started = _recorded(local / "pids")
        assert set(started) == NAMES, started
        assert all(_start_time(pid) == t0 for pid, t0 in started.values()), started

        # Started again: it says so, and starts nothing more.
        again = _script("start", env, timeout=120)
        assert again.returncode == 0 and "already running" in again.stderr, (again.stdout, again.stderr)
        assert f"FXPORT_SERVER={address}" in again.stdout and _recorded(local / "pids") == started

        with Client(address) as client:
            job = client.submit(tiny_pt2, {"targets": ["onnx"], "labels": {"suite": "distributed-script"}})
            job.wait(timeout=300, download_to=tmp_path / "out")
        logs = "".join(f"== {p.name} ==\n{p.read_text(errors='replace')[-3000:]}"
                       for p in (local / "logs").glob("*.log"))
        assert job.state == "SUCCEEDED", (job.state, job.error, logs)
        assert (tmp_path / "out" / "model.onnx").is_file()
        # What the worker and the others run below them (pool, sandbox zygote) must go too.
        for pid, _ in started.values():
            below.update((child, t0) for child in descendants(pid) if (t0 := _start_time(child)) is not None)
    finally:
        down = _script("stop", env, timeout=300)
    assert down.returncode == 0, (down.stdout, down.stderr)
    left = [(pid, t0) for pid, t0 in [*started.values(), *below] if _start_time(pid) == t0]
    assert not left, (left, down.stderr)
    assert not list((local / "pids").glob("*.pid"))
    status = _script("status", env, timeout=60)
    assert status.returncode == 1 and "running (pid" not in status.stdout, status.stdout
