"""The object store stops for ~10 s while jobs need it: their downloads and uploads retry with
backoff and the jobs complete. A store that stays away past the retry budget fails the job
with a reason naming the endpoint."""

from __future__ import annotations

import re
import time

import pytest

from fxport.storage import job_prefix
from tests.fixtures.servers import free_port
from tests.reliability.conftest import (
    REDELIVERY_BOUND_S,
    SPEC,
    assert_like_clean_run,
    attempt_history,
    deadline,
    submit_frozen,
    wait_terminal,
    wait_until,
)

pytestmark = pytest.mark.slow

OUTAGE_S = 10.0  # the scenario: how long the store stays down (FXPORT_STORE_RETRY_S=30 outlasts it)


def test_s3_outage_mid_job_is_ridden_out(fault_stack, clean_run, tiny_pt2, queue_control):
    """Job `up` has finished downloading and runs its engine when S3 stops, so its upload
    meets the outage; job `down` starts during the outage, so its download does."""
    jobs = fault_stack.job_store()
    with fault_stack.client() as client:
        queue_control.pause("w2")
        # to w1, the only worker taking jobs
        up, frozen = submit_frozen(fault_stack, lambda: client.submit(tiny_pt2, SPEC))
        queue_control.pause("w1")
        down = client.submit(tiny_pt2, SPEC)  # held in the queue: nobody takes jobs
    try:
        fault_stack.s3.stop()
        stopped_at = time.monotonic()
        frozen.thaw()  # `up` finishes its engine and starts uploading into the outage
        queue_control.resume("w2")  # `down` starts and tries to download
        wait_until(lambda: jobs.get(down.id).state.value == "RUNNING", deadline(1), "the second job to start")
        time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - stopped_at)))
        for job_id in (up.id, down.id):
            assert not jobs.get(job_id).terminal, "a job ended while the store was down"
    finally:
        fault_stack.s3.start_again()
    # Both finish once the store is back and their backoff lets them retry (at most a few s).
    records = wait_terminal(fault_stack, [up.id, down.id], timeout=deadline(2, plus=10))
    for job_id, rec in records.items():
        assert rec.state.value == "SUCCEEDED", (job_id, rec.error, fault_stack.logs())
        # Running for longer than the redelivery bound, the jobs kept their messages: one attempt.
        assert rec.attempts == 1 and len(attempt_history(fault_stack, job_id)) == 1
        assert_like_clean_run(fault_stack, job_id, clean_run)
    assert OUTAGE_S > REDELIVERY_BOUND_S


def test_store_down_past_the_budget_fails_the_job_naming_it(side_stack, tiny_pt2):
    """A worker whose object store never answers (a closed port) gives up after its budget
    (FXPORT_STORE_RETRY_S=3 here) and fails the job with the endpoint, tries and time."""
    dead = f"http://127.0.0.1:{free_port()}"
    side_stack.start_worker("deadstore", {"AWS_ENDPOINT_URL": dead, "FXPORT_STORE_RETRY_S": "3"})
    try:
        with side_stack.client() as client:
            job = client.submit(tiny_pt2, SPEC).wait(timeout=deadline(1, cold=1, plus=3))  # + its 3 s budget
    finally:
        side_stack.stop_worker("deadstore")
    assert job.state == "FAILED", job.error
    err = job.error
    assert err["code"] == "store_unreachable" and err["stage"] == "load", err
    m = re.search(r"object store unreachable at (\S+) after (\d+) attempts over ([\d.]+) s", err["message"])
    assert m, err["message"]
    # No attempt starts past the budget; the last one may run over it by its own length (botocore's
    # inner retry against a closed port sleeps up to 2.7 s: fxport/storage/s3_store.py S3Store._retry).
    assert m.group(1) == dead and int(m.group(2)) >= 3 and float(m.group(3)) <= 3.0 + 3.0
    rec = side_stack.job_store().get(job.id)
    assert rec.attempts == 1 and rec.artifacts == []
    assert side_stack.artifact_store().list_prefix(job_prefix(rec.tenant, rec.id)) == []
