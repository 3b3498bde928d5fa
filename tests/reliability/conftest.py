"""The fault-injection stack: its own Redis (AOF, restartable on its port), its own SeaweedFS
(stoppable for an outage), `fxport serve` and two prefork CPU workers, all subprocesses on
loopback, with the reliability settings scaled down so faults resolve in seconds:

| setting                           | here | default | effect here                                      |
|-----------------------------------|------|---------|--------------------------------------------------|
| FXPORT_VISIBILITY_TIMEOUT_S       | 4    | 120     | a dead worker's job is back within ~4 + 1 s      |
| FXPORT_UNACKED_RESTORE_INTERVAL_S | 1    | 15      |                                                  |
| FXPORT_JOB_LEASE_S                | 3    | 60      | heartbeat every 0.75 s                           |
| FXPORT_ORPHAN_SWEEP_INTERVAL_S    | 1    | 60      | orphans: silent 2 × (4 + 1) = 10 s               |
| FXPORT_STORE_RETRY_S              | 30   | 60      | outlasts the 10 s S3 outage                      |
| FXPORT_WORKER_SOFT_SHUTDOWN_S     | 5    | 540     | SIGTERM: a job gets 5 s to finish, then requeued |

Every wait in these tests ends on an event (a job's state or attempt read from the job store, a
process gone, a log line) or on a bound that follows the machine's pace, and every process is
stopped by PID. Two kinds of bound:
- `deadline(jobs, cold=, plus=)`: for work, in units of the reference job (`job_pace` times
  SPEC on tiny_pt2 on this stack at the start of the session, cold and warm);
- `scaled(s)` (tests/fixtures/servers.py): for a latency chosen on the idle build machine (a
  signal taking effect, a cancel reaching a worker), stretched by how busy the machine is now.
Windows that are the scenario itself (an outage's length, how long a job is held frozen) and
bounds the stack's settings promise (REDELIVERY_BOUND_S) stay fixed; the slack for acting on
them is scaled.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.servers import (
    ApiServer,
    ManagedProcess,
    RedisServer,
    S3Server,
    distributed_env,
    kill_tree,
    process_state,
    scaled,
    slowdown,
    start_api,
    start_redis,
    start_seaweed,
    start_worker,
    wait_until,
)

FAULT_ENV = {
    "FXPORT_VISIBILITY_TIMEOUT_S": "4",
    "FXPORT_UNACKED_RESTORE_INTERVAL_S": "1",
    "FXPORT_JOB_LEASE_S": "3",
    "FXPORT_ORPHAN_SWEEP_INTERVAL_S": "1",
    "FXPORT_STORE_RETRY_S": "30",
    "FXPORT_SHUTDOWN_GRACE_S": "5",
    "FXPORT_WORKER_SOFT_SHUTDOWN_S": "5",
    "REMAP_SIGTERM": "SIGQUIT",  # as in the manifests: SIGTERM starts Celery's soft shutdown
    # Every job here must really run (the same model and spec, again and again): no result cache.
    "FXPORT_CACHE_ENABLED": "false",
    "FXPORT_LOG_LEVEL": "INFO",
}
REDELIVERY_BOUND_S = 4 + 1
SPEC = {"targets": ["onnx", "torchscript"], "verify": {"samples": 1}}
# Written fresh by every run (timings): compared through the record, not byte for byte.
VOLATILE = ("manifest.json", "report.html")


@dataclass
class FaultStack:
    redis: RedisServer
    s3: S3Server
    api: ApiServer
    env: dict[str, str]
    base: Path
    workers: dict[str, ManagedProcess] = field(default_factory=dict)

    @property
    def address(self) -> str:
        return self.api.address

    def start_worker(self, name: str, env: dict[str, str] | None = None, concurrency: int = 1, *,
                     sandbox_ready: bool = False) -> ManagedProcess:
        """Start worker `name`, stopping first a process of that name still running (a test cut
        short before its worker exited must not leave it untracked). `sandbox_ready`: return only
        once its warm sandbox is up (`wait_sandbox_ready`), so that what a test times next is
        the job, not the sandbox's start."""
        old = self.workers.get(name)
        if old is not None and old.alive():
            old.stop()
        log = self.base / f"{name}.log"
        offset = log.stat().st_size if log.exists() else 0  # a restarted worker appends to its log
        self.workers[name] = start_worker(self.base, {**self.env, **(env or {})}, "cpu", concurrency=concurrency,
                                          name=name)
        if sandbox_ready:
            wait_sandbox_ready(self.workers[name], offset)
        return self.workers[name]

    def kill_worker(self, name: str) -> None:
        """kill -9 of the worker, its pool and its sandboxes together (a node loss)."""
        kill_tree(self.workers[name])

    def stop_worker(self, name: str) -> None:
        self.workers[name].stop()

    def client(self, **kw: Any):  # noqa: ANN201
        from fxport.client import Client

        return Client(self.address, **kw)

    @property
    def broker_url(self) -> str:
        return self.env["FXPORT_BROKER_URL"]

    def job_store(self):  # noqa: ANN201
        from fxport.jobs import RedisJobStore

        return RedisJobStore(self.broker_url)

    def artifact_store(self):  # noqa: ANN201
        from fxport.storage import S3Store

        bucket, _, prefix = self.env["FXPORT_STORE"][len("s3://"):].partition("/")
        return S3Store(bucket, prefix, endpoint_url=self.s3.endpoint, retry_s=30)

    def logs(self) -> str:
        from tests.fixtures.servers import tail

        return "\n".join(f"== {p.name} ==\n{tail(p.log, 3000)}" for p in [self.api.process, *self.workers.values()])

    def worker_log_marks(self) -> dict[Path, int]:
        """Where each worker's log ends now, for `worker_log_since` (a restarted worker appends)."""
        return {p.log: p.log.stat().st_size for p in self.workers.values() if p.log.exists()}

    def worker_log_since(self, marks: dict[Path, int]) -> list[str]:
        lines = []
        for log in {p.log for p in self.workers.values()}:
            with contextlib.suppress(OSError), log.open("rb") as f:
                f.seek(marks.get(log, 0))
                lines += f.read().decode("utf-8", "replace").splitlines()
        return lines

    def stop(self) -> None:
        # All at once: a worker's cold shutdown takes a few seconds, no need to pay it per worker.
        procs = [*self.workers.values(), self.api.process]
        threads = [threading.Thread(target=p.stop) for p in procs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=scaled(60))


@pytest.fixture(scope="session")
def fault_stack(tmp_path_factory):
    base = tmp_path_factory.mktemp("faults")
    redis = start_redis(base / "redis", appendonly=True)
    s3 = start_seaweed(base / "seaweed", bucket="fxport-faults")
    saved = {k: os.environ.get(k) for k in s3.env()}
    os.environ.update(s3.env())  # for the S3Store this process opens (same test credentials)
    stack = None
    try:
        env = {**distributed_env(redis, s3, base, prefix="faults"), **FAULT_ENV}
        stack = FaultStack(redis, s3, start_api(base, env), env, base)
        stack.start_worker("w1")
        stack.start_worker("w2")
        for worker in stack.workers.values():  # the sandbox start every later one is measured by
            wait_sandbox_ready(worker, 0)
        yield stack
    finally:
        if stack is not None:
            stack.stop()
        s3.stop()
        redis.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# How long the stack's first workers took to start their warm sandboxes (the zygote imports the ML
# stack and runs a whole conversion to warm its caches), and the machine's pace then: what a
# restarted worker's wait is bounded by.
_SANDBOX_START: list[tuple[float, float]] = []  # (seconds, slowdown() when measured)
_SANDBOX_READY = re.compile(r"warm sandbox ready in ([0-9.]+) s")


def sandbox_start_bound() -> float:
    """MARGIN times the slowest warm-sandbox start measured at the session's start, stretched if
    the machine got busier since; 0 before one was measured."""
    if not _SANDBOX_START:
        return 0.0
    took, pace = max(_SANDBOX_START)
    return MARGIN * max(1.0, slowdown() / pace) * took


def wait_sandbox_ready(worker: ManagedProcess, offset: int) -> float:
    """Wait until `worker` logs (past `offset` in its log) that its warm sandbox is ready, and
    return how long the sandbox said its start took. The bound is MARGIN times the slowest start
    measured at the session's start, stretched again if the machine got busier since (as
    `deadline` does); before any was measured (the stack's own first workers, which this
    measures), a generous scaled bound."""
    def ready() -> float | None:
        with worker.log.open("rb") as f:
            f.seek(offset)
            found = _SANDBOX_READY.search(f.read().decode("utf-8", "replace"))
        return float(found.group(1)) if found else None

    if _SANDBOX_START:
        bound = sandbox_start_bound()
        what = f"the warm sandbox of {worker.name} (measured start: {max(_SANDBOX_START)[0]:.1f} s)"
    else:
        bound, what = scaled(180), f"the warm sandbox of {worker.name}"
    started = wait_until(ready, bound, what, every=0.1)
    if len(_SANDBOX_START) < 2:  # the stack's first two workers
        _SANDBOX_START.append((max(started, 0.01), slowdown()))
    return started


@pytest.fixture(scope="session")
def side_stack(fault_stack):
    """A second API on Redis database 1 of the same server (its own queues and job store),
    same object store, no worker: a test starts the oddly configured worker it needs."""
    env = {**fault_stack.env, "FXPORT_BROKER_URL": fault_stack.redis.url.rsplit("/", 1)[0] + "/1"}
    stack = FaultStack(fault_stack.redis, fault_stack.s3, start_api(fault_stack.base, env, name="side-api"), env,
                       fault_stack.base)
    yield stack
    stack.stop()


def _run_pair(stack: FaultStack, tiny_pt2: Path, key: str, timeout: float) -> tuple[list[dict[str, str]], float]:
    """Two reference jobs at once (one per worker, as both are idle) until both succeed: their
    artifact digests and the wall time it took."""
    t0 = time.monotonic()
    with stack.client() as c:
        jobs = [c.submit(tiny_pt2, SPEC, idempotency_key=f"{key}-{i}") for i in range(2)]
        for job in jobs:
            job.wait(timeout=max(1.0, t0 + timeout - time.monotonic()))
            assert job.state == "SUCCEEDED", (job.error, stack.logs())
    took = time.monotonic() - t0
    digests = []
    for job in jobs:
        rec = stack.job_store().get(job.id)
        assert rec.attempts == 1
        digests.append({a.name: a.sha256 for a in rec.artifacts if a.name not in VOLATILE})
    return digests, took


@dataclass(frozen=True)
class JobPace:
    """The reference job (SPEC on tiny_pt2, two at once on the stack's two workers), timed at
    the start of the session: what a job costs on this machine as busy as it is."""

    cold_s: float  # on workers that just started: each starts its sandbox zygote (imports torch) first
    warm_s: float  # the same once the zygotes run
    slowdown: float  # tests.fixtures.servers.slowdown() when measured


_PACE: list[JobPace] = []  # set once, by `job_pace`
# How many times its measured self a job may take here before a wait gives up: load that
# comes and goes within a session (another test suite starting beside this one) stays inside
# it, a job that hangs or never comes back does not.
MARGIN = 4.0


def deadline(jobs: float, *, cold: float = 0, plus: float = 0.0) -> float:
    """Seconds to wait for `jobs` reference jobs run one after another on warm workers, after
    `cold` worker starts (a killed worker's replacement starts its zygote with its first job),
    plus `plus`: a bound the stack's settings give (a redelivery, a retry budget), not stretched.
    MARGIN times the measured times, stretched again if the machine got busier since."""
    assert _PACE, "deadline() needs the job_pace fixture (any test on fault_stack or side_stack gets it)"
    pace = _PACE[-1]
    stretch = max(1.0, slowdown() / pace.slowdown)
    return plus + MARGIN * stretch * (jobs * pace.warm_s + cold * pace.cold_s)


@pytest.fixture(scope="session")
def _first_pair(fault_stack, tiny_pt2) -> tuple[list[dict[str, str]], float]:
    """The stack's first two jobs, one per fresh worker: each worker starts its sandbox zygote."""
    return _run_pair(fault_stack, tiny_pt2, "clean-run", timeout=scaled(120))


@pytest.fixture(scope="session")
def clean_run(_first_pair) -> dict[str, str]:
    """Artifact digests of a run with no fault: what every faulted run must reproduce. Two
    jobs at once, so both workers warm their sandboxes now; the two must agree."""
    digests, _ = _first_pair
    assert digests[0] == digests[1], "two clean runs of one job differ: the conversion is not deterministic"
    return digests[0]


@pytest.fixture(scope="session")
def job_pace(fault_stack, tiny_pt2, _first_pair) -> JobPace:
    """The reference job timed on the fault stack now: cold (the stack's first pair of jobs),
    then warm (one more pair)."""
    measured_at = slowdown()
    digests, warm_s = _run_pair(fault_stack, tiny_pt2, f"pace-{uuid.uuid4().hex[:8]}", timeout=scaled(120))
    assert digests[0] == digests[1] == _first_pair[0][0], "warm and cold runs of one job differ"
    pace = JobPace(cold_s=_first_pair[1], warm_s=warm_s, slowdown=measured_at)
    _PACE.append(pace)
    return pace


@pytest.fixture(autouse=True)
def _paced(request):  # noqa: ANN001, ANN202
    """Every test on the fault-injection stack waits by `deadline`: measure the pace first."""
    if {"fault_stack", "side_stack"} & set(request.fixturenames):
        request.getfixturevalue("job_pace")


def assert_like_clean_run(stack: FaultStack, job_id: str, clean: dict[str, str]) -> None:
    """SUCCEEDED, the same artifacts with the same digests as the clean run, and the store
    holding exactly the recorded objects with the recorded digests (no stale or partial file)."""
    from fxport.storage import job_prefix

    rec = stack.job_store().get(job_id)
    assert rec.state.value == "SUCCEEDED", (job_id, rec.error, rec.message)
    got = {a.name: a.sha256 for a in rec.artifacts}
    differ = {n: (got.get(n, "")[:12], clean.get(n, "")[:12]) for n in {*clean, *got} - set(VOLATILE)
              if got.get(n) != clean.get(n)}
    assert not differ, f"{job_id} (worker {rec.worker}, attempt {rec.attempts}): got vs clean {differ}"
    assert set(VOLATILE) <= set(got)
    store = stack.artifact_store()
    stored = {o.key: o.sha256 for o in store.list_prefix(job_prefix(rec.tenant, rec.id))}
    assert stored == {a.key: a.sha256 for a in rec.artifacts}, f"store and record differ for {job_id}"
    # The manifest the job published lists the same model files as the clean run.
    manifest = json.loads(b"".join(store.iter_chunks(next(a.key for a in rec.artifacts if a.name == "manifest.json"))))
    assert {a["path"]: a["sha256"] for a in manifest["artifacts"]} == {
        n: s for n, s in clean.items() if n in {a["path"] for a in manifest["artifacts"]}}


def attempt_history(stack: FaultStack, job_id: str) -> list[tuple[int, str | None]]:
    """(attempt, worker) of each run of the job, in event order, asserting that attempts
    never interleave: once attempt n+1 wrote an event, attempt n never wrote again, and each
    attempt ran on one worker."""
    events = stack.job_store().read_events(job_id, 0)
    runs: list[tuple[int, str | None]] = []
    for ev in events:
        if ev.attempt == 0:
            continue
        if not runs or runs[-1][0] != ev.attempt:
            assert not runs or ev.attempt > runs[-1][0], f"attempt {ev.attempt} wrote after a later one: {runs}"
            runs.append((ev.attempt, ev.worker))
        else:
            assert ev.worker == runs[-1][1], f"attempt {ev.attempt} of {job_id} written by two workers"
    return runs


# ---------------------------------------------------------------------------------------
# Steering: which worker takes the next job, freezing a job mid-run
# ---------------------------------------------------------------------------------------


def node_name(worker_name: str) -> str:
    """Celery node name of a worker started by tests.fixtures.servers.start_worker."""
    return f"{worker_name}-{os.getpid()}@{socket.gethostname()}"


class QueueControl:
    """Celery remote control over the stack's workers: stop or resume taking jobs from `cpu`."""

    def __init__(self, broker_url: str) -> None:
        from fxport.config import Settings
        from fxport.task_queue import create_celery_app

        self.app = create_celery_app(Settings(broker_url=broker_url))

    def pause(self, *workers: str) -> None:
        replies = self.app.control.cancel_consumer("cpu", destination=[node_name(w) for w in workers],
                                                   reply=True, timeout=scaled(5))
        assert len(replies) == len(workers), f"pause: replies {replies}"

    def resume(self, *workers: str) -> None:
        replies = self.app.control.add_consumer("cpu", destination=[node_name(w) for w in workers],
                                                reply=True, timeout=scaled(5))
        assert len(replies) == len(workers), f"resume: replies {replies}"

    def close(self) -> None:
        self.app.close()


@pytest.fixture()
def queue_control(fault_stack):
    control = QueueControl(fault_stack.broker_url)
    yield control
    # Whatever a test paused takes jobs again (add_consumer on a consuming worker is a no-op).
    alive = [n for n, w in fault_stack.workers.items() if w.alive()]
    if alive:
        control.resume(*alive)
    control.close()


def pool_pid(rec: Any) -> int:
    """The pool process running a job, from the record's worker name (host:pid by default)."""
    return int(rec.worker.rsplit(":", 1)[1])


def worker_running(stack: FaultStack, rec: Any) -> str:
    from tests.fixtures.servers import descendants

    pid = pool_pid(rec)
    for name, proc in stack.workers.items():
        if proc.alive() and pid in descendants(proc.pid):
            return name
    raise AssertionError(f"no worker of the stack runs pool process {pid}")


class Frozen:
    """A job's sandbox stopped with SIGSTOP: the job is mid-run for as long as the test wants."""

    def __init__(self, job_id: str, pgid: int) -> None:
        self.job_id, self.pgid = job_id, pgid

    def thaw(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pgid, signal.SIGCONT)

    def alive(self) -> bool:
        try:
            os.killpg(self.pgid, 0)
        except ProcessLookupError:
            return False
        # A stopped group whose members all exited leaves only zombies; treat as gone.
        return any(process_state(pid) not in ("Z", "X", None) for pid in _group_members(self.pgid))

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pgid, signal.SIGKILL)


def _group_members(pgid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int(entry.joinpath("stat").read_text().rsplit(")", 1)[1].split()[2]) == pgid:
                    out.append(int(entry.name))
            except (OSError, ValueError, IndexError):
                continue
    return out


class SandboxMissed(AssertionError):
    """The job ended before its sandbox was seen running: the whole sandbox fit between two polls."""


def freeze_sandbox(stack: FaultStack, job_id: str, timeout: float | None = None) -> Frozen:
    """Wait for the job's sandbox to start (by default for a job's time on a worker that may
    have just started), then SIGSTOP its process group."""
    from tests.fixtures.servers import sandbox_pids

    jobs = stack.job_store()

    def found() -> int | None:
        rec = jobs.get(job_id)
        assert rec is not None, f"no job {job_id}"
        if rec.terminal:
            raise SandboxMissed(f"job {job_id} ended before its sandbox was caught: {rec}")
        if rec.worker is None or rec.state.value != "RUNNING":
            return None
        try:
            pids = sandbox_pids(pool_pid(rec), job_id)
        except OSError:
            return None
        return pids[0] if pids else None

    # by default: a job on a worker that may have just started, and so may be starting its sandbox
    bound = deadline(1, cold=1) + sandbox_start_bound() if timeout is None else timeout
    pid = wait_until(found, bound, f"the sandbox of {job_id}",
                     every=0.02)
    pgid = os.getpgid(pid)
    assert pgid == pid, "the sandbox is expected to lead its own process group (it calls setsid)"
    os.killpg(pgid, signal.SIGSTOP)
    return Frozen(job_id, pgid)


def submit_frozen(stack: FaultStack, submit: Callable[[], Any], tries: int = 3) -> tuple[Any, Frozen]:
    """`submit()` a job and freeze its sandbox mid-run. A tiny job's sandbox lives a second or
    two; on a machine so busy that this process is not scheduled for that long, the job can end
    between two polls: then another job is submitted (at most `tries` in all), since what the
    test needs is a job held mid-run, not that one."""
    for attempt in range(1, tries + 1):
        job = submit()
        try:
            return job, freeze_sandbox(stack, job.id)
        except SandboxMissed:
            if attempt == tries:
                raise
    raise AssertionError("unreachable")


def wait_terminal(stack: FaultStack, job_ids: list[str], timeout: float) -> dict[str, Any]:
    """The jobs' records once all are terminal (read from the job store); `timeout`: a
    `deadline(...)` or `scaled(...)` bound."""
    jobs = stack.job_store()
    end = time.monotonic() + timeout
    pending = set(job_ids)
    while True:
        for job_id in list(pending):
            rec = jobs.get(job_id)
            if rec is not None and rec.terminal:
                pending.discard(job_id)
        if not pending or time.monotonic() >= end:
            break
        time.sleep(0.2)
    assert not pending, (f"{len(pending)} job(s) not finished after {timeout:.1f} s (machine {slowdown():.1f}x "
                         f"slower than idle): {sorted(pending)[:5]}\n{stack.logs()}")
    return {j: jobs.get(j) for j in job_ids}


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def pytest_terminal_summary(terminalreporter) -> None:  # noqa: ANN001
    for pace in _PACE:
        terminalreporter.write_line(
            f"reliability job pace: a pair of reference jobs took {pace.cold_s:.1f} s on fresh workers, "
            f"{pace.warm_s:.1f} s warm (machine {pace.slowdown:.1f}x slower than idle then)")
