"""The job lease (workers/job_lease.py): one live worker per job; a worker that lost its job
writes nothing more. Against SQLite + FileStore; the multi-worker behaviour runs for real in
tests/reliability."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

import pytest

from fxport.jobs import JobState
from fxport.workers.job_lease import (
    AttemptFence,
    JobLease,
    LeaseHeld,
    LeaseLost,
    _pid_namespace,
    holder_is_dead,
    lease_owner_name,
)
from fxport.workers.jobs import execute_job
from tests.workers import test_jobs
from tests.workers.test_jobs import make_job, ok_engine

ctx = test_jobs.ctx  # the fixture, under its name here (the tests below take it as a parameter)


def test_a_live_holder_makes_a_duplicate_wait(ctx):
    rec = make_job(ctx)
    ctx.jobs.acquire_lease(rec.id, "elsewhere:1:1:ab", 30)
    with pytest.raises(LeaseHeld) as held:
        with JobLease(ctx.jobs, rec.id, 4):
            pass
    assert held.value.holder == "elsewhere:1:1:ab" and held.value.retry_in_s == 2
    # The duplicate delivery never touched the job.
    ctx.lease_s = 4
    with pytest.raises(LeaseHeld):
        execute_job(rec.id, ctx)
    assert ctx.jobs.get(rec.id).attempts == 0 and ctx.jobs.get(rec.id).state is JobState.QUEUED


def test_a_dead_holder_on_this_host_is_broken_at_once(ctx):
    rec = make_job(ctx)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    holder = f"{socket.gethostname()}:{gone.pid}:{_pid_namespace()}:dead"
    assert holder_is_dead(holder) and not holder_is_dead(lease_owner_name())
    assert not holder_is_dead(f"another-host:{gone.pid}:{_pid_namespace()}:x")  # can't tell: wait it out
    ctx.jobs.acquire_lease(rec.id, holder, 30)
    with JobLease(ctx.jobs, rec.id, 4) as lease:
        assert ctx.jobs.lease_holder(rec.id) == lease.owner
    assert ctx.jobs.lease_holder(rec.id) is None


def test_heartbeat_renews_and_calls_the_hook(ctx):
    rec = make_job(ctx)
    beats: list[float] = []
    with JobLease(ctx.jobs, rec.id, 0.4, on_heartbeat=lambda: beats.append(time.monotonic())) as lease:
        time.sleep(1.0)  # 2.5 × the TTL: alive only because it is renewed
        assert ctx.jobs.lease_holder(rec.id) == lease.owner
    assert len(beats) >= 4  # at entry, then every ttl/4


def test_a_lost_lease_stops_every_write_of_the_attempt(ctx, tmp_path):
    rec = make_job(ctx)
    lost = threading.Event()
    with JobLease(ctx.jobs, rec.id, 0.4, on_lost=lost.set) as lease:
        jobs, store = AttemptFence(ctx.jobs, lease), AttemptFence(ctx.artifacts, lease)
        jobs.transition(rec.id, state=JobState.RUNNING, new_attempt=True, worker="me")
        assert jobs.attempt == 1
        # Another worker's attempt takes over (as after a broker outage longer than the TTL).
        ctx.jobs.release_lease(rec.id, lease.owner)
        ctx.jobs.acquire_lease(rec.id, "thief:1:1:x", 30)
        assert lost.wait(2) and lease.lost.is_set()
        _, changed = jobs.transition(rec.id, state=JobState.SUCCEEDED)
        assert not changed and ctx.jobs.get(rec.id).state is JobState.RUNNING
        src = tmp_path / "f"
        src.write_bytes(b"x")
        with pytest.raises(LeaseLost):
            store.put_file("default/jobs/" + rec.id + "/model.onnx", src)
        with pytest.raises(LeaseLost):
            store.delete_prefix(f"default/jobs/{rec.id}/")
    assert ctx.jobs.lease_holder(rec.id) == "thief:1:1:x"  # not released by the loser


def test_the_fence_follows_the_attempt(ctx):
    rec = make_job(ctx)
    with JobLease(ctx.jobs, rec.id, 4) as lease:
        jobs = AttemptFence(ctx.jobs, lease)
        jobs.transition(rec.id, state=JobState.RUNNING, new_attempt=True)
        ctx.jobs.transition(rec.id, state=JobState.RUNNING, new_attempt=True)  # a newer attempt
        _, changed = jobs.transition(rec.id, stage="export")
        assert not changed


def test_execute_job_under_a_lease_runs_and_releases_it(ctx):
    rec = make_job(ctx)
    ctx.lease_s = 4
    ctx.engine = ok_engine([])
    done = execute_job(rec.id, ctx)
    assert done.state is JobState.SUCCEEDED and done.attempts == 1
    assert ctx.jobs.lease_holder(rec.id) is None and ctx.jobs.last_heartbeat(rec.id) is not None
