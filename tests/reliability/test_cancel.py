"""Cancel: a queued job never runs; a running one stops within seconds, its sandbox killed
and its partial artifacts deleted; the worker then takes the next job."""

from __future__ import annotations

import time

import pytest

from fxport.storage import artifact_key, job_prefix
from tests.fixtures.servers import scaled
from tests.reliability.conftest import (
    SPEC,
    assert_like_clean_run,
    deadline,
    pool_pid,
    submit_frozen,
    wait_terminal,
    wait_until,
)

# "Within seconds": from CancelJob to its sandbox killed and its partial artifacts gone, on the
# idle build machine; a worker on a busy one is given proportionally longer.
CANCEL_BOUND_S = 10.0

pytestmark = pytest.mark.slow


def test_cancel_a_queued_job(fault_stack, clean_run, tiny_pt2, queue_control):
    jobs = fault_stack.job_store()
    queue_control.pause("w1", "w2")
    with fault_stack.client() as client:
        job = client.submit(tiny_pt2, SPEC)
        assert job.state == "QUEUED"
        cancelled = job.cancel()
        assert cancelled.state == "CANCELLED" and cancelled.error["code"] == "cancelled"
        queue_control.resume("w1", "w2")
        # The revoked message reaches a worker and is dropped; a job submitted after it runs.
        nxt = client.submit(tiny_pt2, SPEC).wait(timeout=deadline(2))
    assert nxt.state == "SUCCEEDED", nxt.error
    assert_like_clean_run(fault_stack, nxt.id, clean_run)
    rec = jobs.get(job.id)
    assert rec.state.value == "CANCELLED" and rec.attempts == 0 and rec.artifacts == []
    assert all(ev.attempt == 0 for ev in jobs.read_events(job.id, 0)), "a cancelled queued job started"
    assert fault_stack.artifact_store().list_prefix(job_prefix(rec.tenant, rec.id)) == []


def test_cancel_a_running_job(fault_stack, clean_run, tiny_pt2, tmp_path):
    jobs, store = fault_stack.job_store(), fault_stack.artifact_store()
    with fault_stack.client() as client:
        # mid-run for as long as the test needs
        job, frozen = submit_frozen(fault_stack, lambda: client.submit(tiny_pt2, SPEC))
        rec = jobs.get(job.id)
        worker_pid = pool_pid(rec)
        # A partial upload, as if the job had been cancelled while uploading.
        partial = tmp_path / "partial.onnx"
        partial.write_bytes(b"half a model")
        store.put_file(artifact_key(rec.tenant, rec.id, "model.onnx"), partial)
        bound = scaled(CANCEL_BOUND_S)
        try:
            t0 = time.monotonic()
            assert job.cancel().state == "CANCELLED"
            wait_until(lambda: not frozen.alive(), bound, "the sandbox to be killed")
            wait_until(lambda: store.list_prefix(job_prefix(rec.tenant, rec.id)) == [], bound,
                       "the partial artifacts to be deleted")
            took = time.monotonic() - t0
        finally:
            frozen.kill()
        assert took < bound
        # The worker's pool process survived the cancel and takes the next job.
        nxt = client.submit(tiny_pt2, SPEC).wait(timeout=deadline(2))
    assert nxt.state == "SUCCEEDED", nxt.error
    assert_like_clean_run(fault_stack, nxt.id, clean_run)
    (done,) = wait_terminal(fault_stack, [job.id], timeout=scaled(5)).values()  # CANCELLED since cancel()
    assert done.state.value == "CANCELLED" and done.attempts == 1 and done.artifacts == []
    assert done.error.code == "cancelled"
    assert jobs.lease_holder(job.id) is None, "the cancelled attempt kept its lease"
    assert store.list_prefix(job_prefix(rec.tenant, rec.id)) == []
    assert worker_pid  # (the record named the pool process that ran it)
