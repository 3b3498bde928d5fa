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

Every wait in these tests has a deadline; every process is stopped by PID.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.servers import (
    ApiServer, ManagedProcess, RedisServer, S3Server, distributed_env, kill_tree, process_state, start_api,
    start_redis, start_seaweed, start_worker, wait_until,
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

    def start_worker(self, name: str, env: dict[str, str] | None = None, concurrency: int = 1) -> ManagedProcess:
        self.workers[name] = start_worker(self.base, {**self.env, **(env or {})}, "cpu", concurrency=concurrency,
                                          name=name)
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

    def stop(self) -> None:
        # All at once: a worker's cold shutdown takes a few seconds, no need to pay it per worker.
        procs = [*self.workers.values(), self.api.process]
        threads = [threading.Thread(target=p.stop) for p in procs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)


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


@pytest.fixture(scope="session")
def side_stack(fault_stack):
    """A second API on Redis database 1 of the same server (its own queues and job store),
    same object store, no worker: a test starts the oddly configured worker it needs."""
    env = {**fault_stack.env, "FXPORT_BROKER_URL": fault_stack.redis.url.rsplit("/", 1)[0] + "/1"}
    stack = FaultStack(fault_stack.redis, fault_stack.s3, start_api(fault_stack.base, env, name="side-api"), env,
                       fault_stack.base)
    yield stack
    stack.stop()


@pytest.fixture(scope="session")
def clean_run(fault_stack, tiny_pt2) -> dict[str, str]:
    """Artifact digests of a run with no fault: what every faulted run must reproduce. Two
    jobs at once, so both workers warm their sandboxes now; the two must agree."""
    with fault_stack.client() as c:
        jobs = [c.submit(tiny_pt2, SPEC, idempotency_key=f"clean-run-{i}") for i in range(2)]
        for job in jobs:
            job.wait(timeout=120)
            assert job.state == "SUCCEEDED", (job.error, fault_stack.logs())
    digests = []
    for job in jobs:
        rec = fault_stack.job_store().get(job.id)
        assert rec.attempts == 1
        digests.append({a.name: a.sha256 for a in rec.artifacts if a.name not in VOLATILE})
    assert digests[0] == digests[1], "two clean runs of one job differ: the conversion is not deterministic"
    return digests[0]


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
        from fxport.workers.celery_app import create_celery_app

        self.app = create_celery_app(Settings(broker_url=broker_url))

    def pause(self, *workers: str) -> None:
        replies = self.app.control.cancel_consumer("cpu", destination=[node_name(w) for w in workers],
                                                   reply=True, timeout=5)
        assert len(replies) == len(workers), f"pause: replies {replies}"

    def resume(self, *workers: str) -> None:
        replies = self.app.control.add_consumer("cpu", destination=[node_name(w) for w in workers],
                                                reply=True, timeout=5)
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


def freeze_sandbox(stack: FaultStack, job_id: str, timeout: float = 30) -> Frozen:
    """Wait for the job's sandbox to start, then SIGSTOP its process group."""
    from tests.fixtures.servers import sandbox_pids

    jobs = stack.job_store()

    def found() -> int | None:
        rec = jobs.get(job_id)
        assert rec is not None and not rec.terminal, f"job {job_id} ended before its sandbox was caught: {rec}"
        if rec.worker is None or rec.state.value != "RUNNING":
            return None
        try:
            pids = sandbox_pids(pool_pid(rec), job_id)
        except OSError:
            return None
        return pids[0] if pids else None

    pid = wait_until(found, timeout, f"the sandbox of {job_id}", every=0.02)
    pgid = os.getpgid(pid)
    assert pgid == pid, "the sandbox is expected to lead its own process group (it calls setsid)"
    os.killpg(pgid, signal.SIGSTOP)
    return Frozen(job_id, pgid)


def wait_terminal(stack: FaultStack, job_ids: list[str], timeout: float) -> dict[str, Any]:
    jobs = stack.job_store()
    deadline = time.monotonic() + timeout
    pending = set(job_ids)
    while pending and time.monotonic() < deadline:
        for job_id in list(pending):
            rec = jobs.get(job_id)
            if rec is not None and rec.terminal:
                pending.discard(job_id)
        time.sleep(0.2)
    assert not pending, f"{len(pending)} job(s) not finished after {timeout} s: {sorted(pending)[:5]}\n{stack.logs()}"
    return {j: jobs.get(j) for j in job_ids}


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
