"""Idempotency: the same key is the same job; a client whose response got lost retries into
the same job; replayed deliveries and transitions cannot move a finished job."""

from __future__ import annotations

import uuid

import grpc
import pytest

from fxport.jobs import JobState
from fxport.task_queue import RUN_JOB
from fxport.workers.celery_app import MessageVisibility
from tests.fixtures.servers import scaled
from tests.reliability.conftest import (
    SPEC,
    QueueControl,
    assert_like_clean_run,
    deadline,
    wait_terminal,
    wait_until,
)

pytestmark = pytest.mark.slow


class _LostResponse(grpc.RpcError):
    """What a client sees when the connection drops after the server has done the work."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "Connection reset by peer"

    def trailing_metadata(self) -> tuple:
        return ()


def test_retry_after_a_lost_response_gives_the_same_job(fault_stack, clean_run, tiny_pt2):
    label = f"lost-{uuid.uuid4().hex[:8]}"
    spec = {**SPEC, "labels": {"suite": label}}
    with fault_stack.client() as client:
        # The same key, twice: one job.
        first = client.submit(tiny_pt2, spec, idempotency_key=f"{label}-k")
        assert client.submit(tiny_pt2, spec, idempotency_key=f"{label}-k").id == first.id

        # No key given: the client makes one up, so its own retry after a lost response
        # finds the job the server did create.
        real, created = client._stub.SubmitJob, []

        def submit_then_drop(requests, **kw):  # noqa: ANN001, ANN003, ANN202
            msg = real(requests, **kw)
            if not created:
                created.append(msg.id)
                raise _LostResponse()
            return msg

        client._stub.SubmitJob = submit_then_drop
        try:
            second = client.submit(tiny_pt2, spec)
        finally:
            client._stub.SubmitJob = real
        assert created and second.id == created[0]
        assert sorted(j.id for j in client.iter_jobs(labels={"suite": label})) == sorted([first.id, second.id])
    for rec in wait_terminal(fault_stack, [first.id, second.id], timeout=deadline(2)).values():
        assert rec.attempts == 1
        assert_like_clean_run(fault_stack, rec.id, clean_run)


def test_replays_cannot_move_a_finished_job(fault_stack, clean_run, tiny_pt2):
    jobs = fault_stack.job_store()
    with fault_stack.client() as client:
        job = client.submit(tiny_pt2, SPEC).wait(timeout=deadline(1))
    assert job.state == "SUCCEEDED", job.error
    before = jobs.get(job.id)

    # A replayed delivery (the broker handing out the message again) does nothing.
    replays = 2
    control = QueueControl(fault_stack.broker_url)
    logs = fault_stack.worker_log_marks()
    try:
        for _ in range(replays):
            control.app.send_task(RUN_JOB, args=[job.id], task_id=job.id)
        visibility = MessageVisibility(control.app, job.id)
        redis = visibility._client()
        wait_until(lambda: redis.llen("cpu") == 0 and not visibility.tags(), scaled(30), "the replays to be consumed")

        # Each replay ran to its end (Celery logs the task's return): whatever a replay would
        # write, it has written by now.
        def replays_done() -> bool:
            done = [line for line in fault_stack.worker_log_since(logs)
                    if f"fxport.run_job[{job.id}]" in line and (" succeeded in " in line or " raised " in line)]
            return len(done) >= replays

        wait_until(replays_done, scaled(30), f"the workers to log the end of {replays} replayed tasks")
    finally:
        control.close()
    assert sum("a replayed task" in line and job.id in line for line in fault_stack.worker_log_since(logs)) == replays

    # Replayed or stale transitions are refused: terminal never moves, old attempts are fenced.
    for changes in ({"state": JobState.RUNNING, "new_attempt": True}, {"state": JobState.FAILED},
                    {"state": JobState.QUEUED}, {"stage": "export", "progress": 0.5}):
        rec, changed = jobs.transition(job.id, **changes)
        assert not changed and rec.state is JobState.SUCCEEDED
    assert jobs.get(job.id) == before
    assert jobs.read_events(job.id, before.last_seq) == []
    assert_like_clean_run(fault_stack, job.id, clean_run)
