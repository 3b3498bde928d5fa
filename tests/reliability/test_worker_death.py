"""Worker death: kill -9 of a pool child or of a whole worker mid-job; a job outliving the
visibility timeout. Each job completes once, with the clean run's artifacts."""

from __future__ import annotations

import os
import random
import signal
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest

from fxport.workers.celery_app import MessageVisibility
from tests.fixtures.servers import scaled
from tests.reliability.conftest import (
    REDELIVERY_BOUND_S,
    SPEC,
    assert_like_clean_run,
    attempt_history,
    deadline,
    pool_pid,
    submit_frozen,
    wait_terminal,
    wait_until,
    worker_running,
)

pytestmark = pytest.mark.slow

JOBS, KILLS = 30, 5
ENGINE_STAGES = ("load", "capture", "passes", "export")


def test_thirty_jobs_survive_five_random_worker_kills(fault_stack, clean_run, tiny_pt2):
    """3 pool-child kills (requeued at once) and 2 whole-worker kills (redelivered after the
    visibility timeout, the worker restarted), at random moments, on random running jobs."""
    rng = random.Random(20240505)
    kinds = ["pool child"] * 3 + ["whole worker"] * 2
    rng.shuffle(kinds)
    label = f"kills-{uuid.uuid4().hex[:8]}"
    with fault_stack.client() as client:
        ids = [client.submit(tiny_pt2, {**SPEC, "labels": {"suite": label}}).id for _ in range(JOBS)]
    jobs = fault_stack.job_store()

    hits: Counter[str] = Counter()
    for kind in kinds:
        def running_job():  # noqa: ANN202
            # A record still naming a killed pool process is waiting for its rerun: not a target;
            # nor is a job hit before (a third death of one job fails it, by design: MAX_ATTEMPTS).
            found = [rec for rec in map(jobs.get, ids)
                     if rec.state.value == "RUNNING" and rec.stage in ENGINE_STAGES and rec.worker
                     and not hits[rec.id] and Path(f"/proc/{pool_pid(rec)}").exists()]
            return rng.choice(found) if found else None

        # The next job to run may be one a killed worker had taken: it comes back after the redelivery bound.
        rec = wait_until(running_job, deadline(1, cold=1, plus=REDELIVERY_BOUND_S), "a running job to kill",
                         every=0.05)
        if kind == "pool child":
            os.kill(pool_pid(rec), signal.SIGKILL)
        else:
            name = worker_running(fault_stack, rec)
            fault_stack.kill_worker(name)
            fault_stack.start_worker(name)
        hits[rec.id] += 1
        time.sleep(rng.uniform(0.2, 1.5))  # the scenario: kills at random moments, not a wait

    # Two workers through the jobs and their reruns, two of them restarted cold, two jobs
    # waiting out the redelivery bound.
    records = wait_terminal(fault_stack, ids, timeout=deadline(JOBS / 2 + KILLS, cold=2, plus=2 * REDELIVERY_BOUND_S))
    assert [r.state.value for r in records.values()] == ["SUCCEEDED"] * JOBS, fault_stack.logs()
    # No duplicate jobs: exactly the submitted ones carry the label.
    with fault_stack.client() as client:
        assert sorted(j.id for j in client.iter_jobs(labels={"suite": label})) == sorted(ids)
    reruns = 0
    for job_id, rec in records.items():
        history = attempt_history(fault_stack, job_id)  # asserts attempts never overlapped
        assert [a for a, _ in history] == list(range(1, rec.attempts + 1)), (job_id, history)
        # Each rerun is explained by a kill that hit the job; none comes from a second worker
        # starting a job that was still running.
        assert rec.attempts <= 1 + hits[job_id], (job_id, rec.attempts, hits[job_id], history)
        reruns += rec.attempts - 1
        assert_like_clean_run(fault_stack, job_id, clean_run)
    assert reruns >= KILLS - 1, f"only {reruns} reruns for {KILLS} kills: the kills missed their jobs"


def test_a_job_running_past_the_visibility_timeout_is_not_started_twice(fault_stack, clean_run, tiny_pt2,
                                                                         queue_control):
    """Kombu redelivers a message un-acked longer than visibility_timeout_s; a live worker
    keeps its job's message fresh, so the idle worker never gets a copy."""
    with fault_stack.client() as client:
        job, frozen = submit_frozen(fault_stack, lambda: client.submit(tiny_pt2, SPEC))
    try:
        visibility = MessageVisibility(queue_control.app, job.id)
        # Nothing may happen for this long, and that is long enough to show it: a copy of the
        # message would be handed out REDELIVERY_BOUND_S after the job started (the stack's
        # visibility timeout plus its restore interval), and the idle worker would start it (a
        # second attempt in the record) within its pickup time, well under scaled(3).
        held_for = REDELIVERY_BOUND_S + scaled(3)
        held_until = time.monotonic() + held_for
        while time.monotonic() < held_until:
            rec = fault_stack.job_store().get(job.id)
            assert rec.attempts == 1 and rec.state.value == "RUNNING", rec
            assert visibility.tags(), "the running job's message left the unacked set"
            time.sleep(0.5)
    finally:
        frozen.thaw()
    (rec,) = wait_terminal(fault_stack, [job.id], timeout=deadline(1)).values()
    assert rec.attempts == 1 and len(attempt_history(fault_stack, job.id)) == 1
    assert_like_clean_run(fault_stack, job.id, clean_run)
    assert visibility.tags() == []  # acknowledged


def restore_lock_expiry_s(fault_stack) -> float:  # noqa: ANN001
    """How long the stack's workers hold kombu's restore-sweep lock: what a worker killed in
    the middle of its sweep leaves behind."""
    from kombu.transport.redis import Channel

    from fxport.config import Settings
    from fxport.task_queue import create_celery_app

    settings = Settings(broker_url=fault_stack.broker_url,
                        unacked_restore_interval_s=float(fault_stack.env["FXPORT_UNACKED_RESTORE_INTERVAL_S"]))
    options = create_celery_app(settings).conf.broker_transport_options
    return float(options.get("unacked_mutex_expire", Channel.unacked_mutex_expire))


@pytest.mark.parametrize("died_in_its_sweep", [False, True], ids=["killed", "killed mid-sweep"])
def test_a_killed_workers_job_is_back_within_the_redelivery_bound(fault_stack, clean_run, tiny_pt2,
                                                                  died_in_its_sweep):
    """The bound: visibility_timeout_s + unacked_restore_interval_s (+ pickup), also when the
    worker died inside its restore sweep, holding the sweep's Redis lock (the surviving worker
    cannot sweep until that lock expires; past the bound the API's orphan sweep, not the
    redelivery, would bring the job back)."""
    import redis

    with fault_stack.client() as client:
        job, frozen = submit_frozen(fault_stack, lambda: client.submit(tiny_pt2, SPEC))
    rec = fault_stack.job_store().get(job.id)
    name = worker_running(fault_stack, rec)
    fault_stack.kill_worker(name)
    if died_in_its_sweep:  # the lock as the killed worker would have left it (redis-py's Lock: SET NX PX)
        expiry_ms = int(restore_lock_expiry_s(fault_stack) * 1000)
        with redis.Redis.from_url(fault_stack.broker_url) as broker:  # NX: the surviving worker may hold it a moment
            wait_until(lambda: broker.set("unacked_mutex", "the-killed-workers-token", nx=True, px=expiry_ms),
                       scaled(5), "the restore lock to be free", every=0.01)
    frozen.kill()  # it was below the killed worker
    killed_at = time.monotonic()
    try:
        wait_until(lambda: fault_stack.job_store().get(job.id).attempts == 2, REDELIVERY_BOUND_S + scaled(5),
                   "the redelivered attempt to start", every=0.05)
        took = time.monotonic() - killed_at
    finally:
        fault_stack.start_worker(name)
    # The bound, plus the surviving worker's pickup (well under 3 s on an idle machine).
    assert took <= REDELIVERY_BOUND_S + scaled(3), f"redelivered after {took:.1f} s"
    wait_terminal(fault_stack, [job.id], timeout=deadline(2, cold=1))
    assert [a for a, _ in attempt_history(fault_stack, job.id)] == [1, 2]
    assert_like_clean_run(fault_stack, job.id, clean_run)
