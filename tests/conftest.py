"""Session fixtures: real servers on free loopback ports, started once, stopped by PID.

- `redis_server`: redis-server (no persistence) on its own port.
- `s3_server`: SeaweedFS `weed mini` with credentials (auth on) and a bucket; its AWS_*
  variables are put in this process's environment so boto3 clients here find it.
- `distributed_stack`: `fxport serve --broker redis --store s3` + Celery workers for the
  cpu (prefork) and gpu (solo) queues, all subprocesses.
- `embedded_server`: `fxport serve` with no mode flags in a temp FXPORT_HOME.
- `tiny_pt2` / `resnet18_pt2`: corpus models saved as torch.export archives.

And for the whole run:
- nothing left behind: once every fixture is torn down, a process of this session still
  running (a Celery worker, a sandbox zygote or child, redis-server, weed, `fxport serve`, ...;
  tests/fixtures/servers.py `RunMarks` says how they are told from other sessions' on the same
  machine) is reported with its command line, killed by PID, and fails the run, whether the
  tests passed or not;
- `--under-load N`: N CPU-bound processes run beside the session, to show the tests hold on a
  busy machine (their waits end on events, or on bounds stretched to the machine's pace).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.servers import (
    Leftover,
    RunMarks,
    scaled,
    settle_and_kill_leftovers,
    slowdown,
    start_api,
    start_burners,
    start_distributed,
    start_redis,
    start_seaweed,
    stop_burners,
)

_MARKS = pytest.StashKey[RunMarks]()
_BURNERS = pytest.StashKey[list[subprocess.Popen]]()
_LEFTOVERS = pytest.StashKey[tuple[list[Leftover], float]]()
# How long processes of the run get to finish exiting once the fixtures are torn down, on the
# idle build machine: a zygote that was importing torch when its worker ended reads EOF only
# when its imports are done (1.5 s idle), then its children die with it.
SETTLE_S = 10.0


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--under-load", type=int, default=0, metavar="N",
                     help="run beside N CPU-bound processes (busy loops) started with the session and "
                          "stopped by PID at its end: the tests must hold on a busy machine")


def pytest_sessionstart(session: pytest.Session) -> None:
    marks = RunMarks()
    marks.mark_environment()  # before collection: whatever starts a process from here on passes it on
    session.config.stash[_MARKS] = marks
    session.config.stash[_BURNERS] = start_burners(session.config.getoption("under_load"))


def pytest_report_header(config: pytest.Config) -> list[str]:
    burners = config.stash.get(_BURNERS, [])
    lines = [f"pace: {slowdown():.1f}x slower than the idle build machine (calibration loop)"]
    if burners:
        lines.append(f"under load: {len(burners)} CPU burner(s), pids {', '.join(str(p.pid) for p in burners)}")
    return lines


@pytest.fixture(scope="session", autouse=True)
def _run_temp_dir(pytestconfig: pytest.Config, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The session's temp dir, where its servers keep their files: a mark of its processes. The
    client's remembered digests (fxport/digest.py) go there too, not to the user's ~/.cache."""
    marks = pytestconfig.stash.get(_MARKS, None)
    if marks is not None:
        marks.basetemp = tmp_path_factory.getbasetemp().resolve()
    os.environ["FXPORT_DIGEST_CACHE_DIR"] = str(tmp_path_factory.mktemp("digests"))


def _close_own_warm_sandbox() -> None:
    """A test that ran the sandbox inside pytest leaves its warm zygote to end with pytest (it
    exits on EOF from us): end it now, as pytest's own exit would, so it is not counted."""
    launch = sys.modules.get("fxport.workers.sandbox.launch")
    warm = getattr(launch, "_warm", None)
    if warm is not None:
        warm.close()


@pytest.hookimpl(trylast=True)  # after pytest's own sessionfinish, which tears down every fixture left
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    marks = config.stash.get(_MARKS, None)
    if marks is None:
        return
    stop_burners(config.stash.get(_BURNERS, []))
    _close_own_warm_sandbox()
    settle_s = scaled(SETTLE_S)
    left = settle_and_kill_leftovers(marks, settle_s)
    marks.unmark_environment()
    if not left:
        return
    config.stash[_LEFTOVERS] = (left, settle_s)
    if session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:  # counted in the last line ("1 passed, 2 left running")
        reporter.stats.setdefault("left running", []).extend(left)


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:  # noqa: ANN001
    left, settle_s = config.stash.get(_LEFTOVERS, ([], 0.0))
    if not left:
        return
    terminalreporter.write_sep("=", "processes left running", red=True)
    for item in left:
        terminalreporter.write_line(item.describe())
    terminalreporter.write_line(
        f"{len(left)} process(es) of this run still ran after every fixture was torn down and "
        f"{settle_s:.0f} s more: each was killed by PID, and the run fails. A test or fixture "
        "that starts a process must stop it (tests/fixtures/servers.py stops by PID), and a process "
        "must end with its parent (a worker's zygote, the zygote's children).", red=True)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    server = start_redis(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    server = start_seaweed(tmp_path_factory.mktemp("seaweed"))
    saved = {k: os.environ.get(k) for k in server.env()}
    os.environ.update(server.env())
    yield server
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    server.stop()


@pytest.fixture(scope="session")
def distributed_stack(tmp_path_factory, redis_server, s3_server):
    stack = start_distributed(tmp_path_factory.mktemp("stack"), redis_server, s3_server)
    yield stack
    stack.stop()


@pytest.fixture(scope="session")
def embedded_server(tmp_path_factory):
    base = tmp_path_factory.mktemp("embedded")
    # Result-cache lookups off: tests must not answer each other's jobs (tests/service/test_cache.py tests them).
    server = start_api(base, {"FXPORT_HOME": str(base / "home"), "FXPORT_SANDBOX_THREADS": "1",
                              "FXPORT_CACHE_ENABLED": "false"}, name="embedded")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny_pt2(tmp_path_factory) -> Path:
    from tests.fixtures.models import save_pt2

    return save_pt2("tiny_linear", tmp_path_factory.mktemp("models") / "tiny_linear.pt2")


@pytest.fixture(scope="session")
def resnet18_pt2(tmp_path_factory) -> Path:
    from tests.fixtures.models import save_pt2

    return save_pt2("resnet18", tmp_path_factory.mktemp("models") / "resnet18.pt2")
