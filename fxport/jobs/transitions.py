"""The job state machine: how a job record may change, and the event each change appends.

Every change of a job goes through `JobStore.transition` (fxport/jobs/store.py), which applies
`apply_update` and appends `event_for` the result in the same atomic step, so WatchJob never
sees a state the record did not have, and a replayed or late update can never move a finished
job backwards.
"""

from __future__ import annotations

import time
from typing import Any

from fxport.errors import ErrorRecord
from fxport.jobs.records import (
    TERMINAL_STATES,
    JobEvent,
    JobRecord,
    JobState,
    StageTiming,
    StoredArtifact,
)

_UNSET: Any = object()

# Which states a record in each non-terminal state may move to (a terminal one never moves).
_ALLOWED = {
    JobState.QUEUED: {JobState.QUEUED, JobState.RUNNING, *TERMINAL_STATES},
    JobState.RUNNING: {JobState.QUEUED, JobState.RUNNING, *TERMINAL_STATES},
}


def apply_update(
    record: JobRecord,
    *,
    state: JobState | None = None,
    stage: str | None = _UNSET,
    progress: float | None = None,
    message: str | None = None,
    error: ErrorRecord | None = None,
    artifacts: list[StoredArtifact] | None = None,
    staged: StoredArtifact | None = None,
    worker: str | None = None,
    new_attempt: bool = False,
    task_id: str | None = None,
    cache_hit: bool | None = None,
    expect_attempt: int | None = None,
    expect_state: JobState | None = None,
    now: float | None = None,
) -> JobRecord | None:
    """The job state machine. Returns the updated copy, or None if the update is refused.

    QUEUED → RUNNING → SUCCEEDED | FAILED | CANCELLED; QUEUED → CANCELLED | FAILED;
    RUNNING → QUEUED (requeued after a restart); RUNNING → RUNNING (a redelivered task).
    A terminal record never changes again: a replayed or late update is refused, which is
    what makes at-least-once task delivery harmless.

    `expect_attempt` fences a worker: its updates apply only while the record is still on
    its attempt, so a worker that lost its job to a newer attempt can no longer write.
    `expect_state`: apply only if the record is in that state (compare-and-set).
    """
    if not _accepts(record, state, expect_attempt, expect_state):
        return None
    now = time.time() if now is None else now
    rec = record.model_copy(deep=True)
    if state is not None:
        if state is JobState.RUNNING and rec.started_at is None:
            rec.started_at = now
        rec.state = state
    if new_attempt:
        rec.attempts += 1
    if stage is not _UNSET and stage != rec.stage:
        _enter_stage(rec, stage, reset_progress=progress is None, now=now)
    if progress is not None:
        rec.progress = max(0.0, min(1.0, float(progress)))
    if staged is not None:
        if rec.state is not JobState.RUNNING:
            return None  # stored for an attempt that is over: nothing to offer
        rec.staged = [a for a in rec.staged if a.name != staged.name] + [staged]
    if rec.state is not JobState.RUNNING or new_attempt:
        rec.staged = []  # another attempt re-uploads; an ended job offers its `artifacts` only
    given = {"message": message, "error": error, "artifacts": None if artifacts is None else list(artifacts),
             "worker": worker, "task_id": task_id, "cache_hit": cache_hit}
    for name, value in given.items():
        if value is not None:
            setattr(rec, name, value)
    if rec.state.terminal:
        _finish(rec, now)
    rec.updated_at = now
    return rec


def _accepts(record: JobRecord, state: JobState | None, expect_attempt: int | None,
             expect_state: JobState | None) -> bool:
    """Whether an update may apply at all: the record is not finished, is on the expected attempt
    and in the expected state, and may move to `state`."""
    if record.terminal:
        return False
    if expect_attempt is not None and record.attempts != expect_attempt:
        return False
    if expect_state is not None and record.state is not expect_state:
        return False
    return state is None or state in _ALLOWED[record.state]


def _enter_stage(rec: JobRecord, stage: str | None, *, reset_progress: bool, now: float) -> None:
    """End the timing of the stage `rec` was in, start `stage`'s (None: no stage now)."""
    if rec.stage in rec.stage_timings and rec.stage_timings[rec.stage].finished_at is None:
        rec.stage_timings[rec.stage].finished_at = now
    if stage is not None:
        rec.stage_timings[stage] = StageTiming(started_at=now)
    rec.stage = stage
    if reset_progress:
        rec.progress = 0.0


def _finish(rec: JobRecord, now: float) -> None:
    """A record that just reached a terminal state: its end time, its last stage's, full progress if it succeeded."""
    rec.finished_at = now
    if rec.stage in rec.stage_timings and rec.stage_timings[rec.stage].finished_at is None:
        rec.stage_timings[rec.stage].finished_at = now
    if rec.state is JobState.SUCCEEDED:
        rec.progress = 1.0


def event_for(rec: JobRecord, seq: int, staged: StoredArtifact | None = None) -> JobEvent:
    """The event a change appends: the record as the change left it."""
    return JobEvent(
        seq=seq, job_id=rec.id, time=rec.updated_at, state=rec.state, stage=rec.stage,
        progress=rec.progress, message=rec.message, attempt=rec.attempts, worker=rec.worker, staged=staged,
    )
