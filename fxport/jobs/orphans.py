"""The orphan sweep: RUNNING jobs whose worker died and that no redelivery picked up.

The API server runs `sweep_orphans` every FXPORT_ORPHAN_SWEEP_INTERVAL_S; it requeues such a
job, or fails it (code `worker_lost`) once it has lost its worker MAX_ATTEMPTS times.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fxport.errors import ErrorRecord
from fxport.jobs.records import JobState
from fxport.jobs.store import JobStore

MAX_ATTEMPTS = 3  # a job that loses its worker this many times fails instead of looping
SWEEPER_LEASE = "orphan-sweeper"  # one sweep at a time across API replicas


@dataclass
class SweepResult:
    requeued: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)


def sweep_orphans(
    store: JobStore,
    requeue: Callable[[str], Any],
    *,
    orphan_after_s: float,
    max_attempts: int = MAX_ATTEMPTS,
    owner: str = "sweeper",
) -> SweepResult:
    """Find RUNNING jobs whose worker is gone and that no redelivery picked up; requeue them.

    An orphan: no worker holds its lease, and neither a lease renewal nor any update has
    touched it for `orphan_after_s` (longer than a redelivery takes, so the broker had its
    chance: a job lost with its message, or a message lost in a broker crash). Requeued
    (RUNNING → QUEUED, then `requeue(job_id)`): it reruns from the start, which is safe
    because tasks are idempotent and a duplicate message finds the lease or a finished job.
    A job that already used `max_attempts` is FAILED instead (code `worker_lost`).

    Skipped: jobs handed to the `tensorrt` stage (they wait in queue "gpu" holding no lease,
    for as long as no GPU worker runs). Transitions are compare-and-set on (state, attempt),
    so a worker that resumes meanwhile, or a second sweeper, wins cleanly.
    """
    result = SweepResult()
    if store.acquire_lease(SWEEPER_LEASE, owner, max(1.0, orphan_after_s / 2)) is not None:
        return result  # another replica is sweeping
    try:
        now = store.clock()
        for job_id in store.running_ids():
            rec = store.get(job_id)
            if rec is None or rec.state is not JobState.RUNNING or rec.stage == "tensorrt":
                continue
            if store.lease_holder(job_id) is not None:
                continue
            last = max(rec.updated_at, store.last_heartbeat(job_id) or 0.0)
            if now - last < orphan_after_s:
                continue
            gone = (f"its worker {rec.worker or '?'} stopped (no heartbeat for {now - last:.0f} s) "
                    "and no redelivery picked it up")
            if rec.attempts >= max_attempts:
                error = ErrorRecord(stage=rec.stage, code="worker_lost",
                                     message=f"{gone}; it already ran {rec.attempts} times, so it is not requeued")
                _, changed = store.transition(job_id, state=JobState.FAILED, error=error, message=error.message,
                                              expect_state=JobState.RUNNING, expect_attempt=rec.attempts)
                if changed:
                    result.failed.append(job_id)
                continue
            _, changed = store.transition(job_id, state=JobState.QUEUED, stage=None, message=f"requeued: {gone}",
                                          expect_state=JobState.RUNNING, expect_attempt=rec.attempts)
            if changed:
                requeue(job_id)
                result.requeued.append(job_id)
    finally:
        store.release_lease(SWEEPER_LEASE, owner)
    return result
