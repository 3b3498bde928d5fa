"""The orphan sweep: a RUNNING job whose worker is gone and whose message is gone too (so no
redelivery will ever come) is requeued by the API server's sweeper and completes."""

from __future__ import annotations

import time

import pytest

from fxport.digest import sha256_file
from fxport.jobs import InputRef, JobRecord, JobState, new_job_id
from fxport.spec import parse_spec
from fxport.storage import input_key
from tests.fixtures.servers import scaled
from tests.reliability.conftest import (
    REDELIVERY_BOUND_S,
    SPEC,
    assert_like_clean_run,
    attempt_history,
    deadline,
    wait_terminal,
    wait_until,
)

pytestmark = pytest.mark.slow

ORPHAN_AFTER_S = 2 * REDELIVERY_BOUND_S  # the API's rule (service/server.py OrphanSweeper)


def test_a_job_lost_with_its_worker_and_message_is_requeued_and_completes(fault_stack, clean_run, tiny_pt2):
    jobs, store = fault_stack.job_store(), fault_stack.artifact_store()
    sha, size = sha256_file(tiny_pt2)
    store.put_file(input_key("default", sha), tiny_pt2)
    spec = parse_spec(SPEC)
    rec = JobRecord(id=new_job_id(), tenant="default", spec=spec, spec_digest=spec.digest(),
                    model=InputRef(sha256=sha, bytes=size, filename="tiny.pt2", key=input_key("default", sha)),
                    message="queued")
    jobs.create(rec)
    # Its worker took it, then vanished with the message (a broker crash losing its last
    # second, a message purged by hand): no lease, no heartbeat, nothing left to redeliver.
    went_silent = time.time() - (ORPHAN_AFTER_S - 3)  # most of the silence already behind it
    jobs.transition(rec.id, state=JobState.RUNNING, stage="export", new_attempt=True, worker="gone-host:4242",
                    message="fetching inputs", now=went_silent)
    assert jobs.lease_holder(rec.id) is None

    # The rest of its silence (3 s), the next sweep (every 1 s), the requeue and a worker taking it.
    requeued = wait_until(lambda: jobs.get(rec.id).attempts == 2 or jobs.get(rec.id).terminal,
                          3 + 1 + scaled(10), "the sweeper to requeue the orphan")
    assert requeued
    silent_for = time.time() - went_silent
    assert silent_for >= ORPHAN_AFTER_S - 1, f"swept after {silent_for:.1f} s: too early"
    (done,) = wait_terminal(fault_stack, [rec.id], timeout=deadline(1)).values()
    assert done.state is JobState.SUCCEEDED and done.attempts == 2
    history = attempt_history(fault_stack, rec.id)
    assert history[0] == (1, "gone-host:4242") and history[1][0] == 2
    messages = [ev.message for ev in jobs.read_events(rec.id, 0)]
    assert any(m.startswith("requeued: its worker gone-host:4242 stopped") for m in messages), messages
    assert_like_clean_run(fault_stack, rec.id, clean_run)
