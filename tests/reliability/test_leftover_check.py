"""The end-of-run check (tests/conftest.py): a pytest session that leaves processes running,
whether its tests passed or failed, fails, names each one and kills it by PID; one that leaves
none passes. Each case is a real pytest session of its own running tests/reliability/leftover_probe.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.servers import REPO, process_state, scaled

PROBE = Path(__file__).with_name("leftover_probe.py")


def run_probe(mode: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess, list[int]]:
    pids_file = tmp_path / "pids"
    pids_file.touch()
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(PROBE)],
                         cwd=REPO, capture_output=True, text=True, timeout=scaled(120),
                         env={**os.environ, "FXPORT_PROBE": mode, "FXPORT_PROBE_PIDS": str(pids_file)})
    return res, [int(line) for line in pids_file.read_text().split()]


def test_a_session_that_stops_its_processes_passes(tmp_path):
    res, pids = run_probe("stopped", tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "left running" not in res.stdout and pids == []


@pytest.mark.parametrize("mode, outcome", [("leak", "1 passed"), ("leak-and-fail", "1 failed")])
def test_a_session_that_leaves_processes_fails_and_kills_them(tmp_path, mode, outcome):
    res, pids = run_probe(mode, tmp_path)
    out = res.stdout
    assert res.returncode == 1, out + res.stderr
    assert len(pids) == 3 and "processes left running" in out, out
    assert f"{outcome}, 3 left running" in out, out
    for pid in pids:
        assert f"pid {pid} " in out, (pid, out)
        # Killed by the check (a zombie until init reaps it at most).
        assert process_state(pid) in (None, "Z"), (pid, process_state(pid))
    # Each found by what it carries: below pytest, the run's token in PATH, the run's temp dir.
    assert "runs below this pytest" in out
    assert "carries this run's token in its environment" in out
    assert "names this run's temp dir" in out
