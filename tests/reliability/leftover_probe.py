"""Not collected by itself: tests/reliability/test_leftover_check.py runs it as a pytest session
of its own, and it starts processes the way FXPORT_PROBE says, writing their PIDs (one a line)
to FXPORT_PROBE_PIDS."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SLEEPER = "import time; time.sleep(600)"


def _record(pid: int) -> None:
    with open(os.environ["FXPORT_PROBE_PIDS"], "a") as f:
        f.write(f"{pid}\n")


def _orphan(env: dict[str, str], cwd: Path) -> None:
    """A grandchild whose parent exits at once: re-parented to init, it is no longer below
    pytest (what a sandbox child left by a dead zygote, or a daemonizing server, looks like)."""
    # The grandchild's output goes nowhere: holding our pipe open, it would keep run() waiting.
    starter = (f"import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', {SLEEPER!r}], "
               "start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, "
               "stderr=subprocess.DEVNULL); print(p.pid)")
    out = subprocess.run([sys.executable, "-c", starter], env=env, cwd=cwd, capture_output=True, text=True,
                         check=True, timeout=60)
    _record(int(out.stdout))


def test_start_processes(tmp_path: Path) -> None:
    mode = os.environ["FXPORT_PROBE"]
    if mode == "stopped":  # started and stopped: nothing to report
        proc = subprocess.Popen([sys.executable, "-c", SLEEPER])
        proc.kill()
        proc.wait()
        return
    assert mode in ("leak", "leak-and-fail")
    # A child left running, in its own session like the fixtures' servers.
    _record(subprocess.Popen([sys.executable, "-c", SLEEPER], start_new_session=True).pid)
    # An orphan with only PATH left of its environment (the sandbox's scrubbed one).
    _orphan({"PATH": os.environ["PATH"]}, Path("/"))
    # An orphan with no environment at all, working in the run's temp dir.
    _orphan({}, tmp_path)
    assert mode != "leak-and-fail", "this test fails on purpose: the check must hold either way"
