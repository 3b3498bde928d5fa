"""Time limits: the soft limit ends a job as a clean FAILED naming its stage, with its sandbox
stopped and the worker's pool process alive. (The hard limit kills the pool process; that
the job is then recorded FAILED is tests/workers/test_celery_app.py's
test_hard_time_limit_marks_the_job_failed.)"""

from __future__ import annotations

import pytest

from fxport.jobs import STAGES
from fxport.storage import job_prefix
from tests.fixtures.servers import pool_children, scaled
from tests.reliability.conftest import deadline, freeze_sandbox, wait_terminal, wait_until

pytestmark = pytest.mark.slow

SOFT_S = 3


def test_soft_limit_fails_the_job_naming_its_stage(side_stack, tiny_pt2):
    side_stack.start_worker("softlimit", {"FXPORT_JOB_SOFT_TIME_LIMIT_S": str(SOFT_S),
                                          "FXPORT_JOB_HARD_TIME_LIMIT_S": "60"})
    try:
        with side_stack.client() as client:
            job = client.submit(tiny_pt2, {"targets": ["onnx"]})
            try:
                # Frozen, the job cannot finish before its limit (a warm-up may even outlast it).
                frozen = freeze_sandbox(side_stack, job.id)
            except AssertionError:
                frozen = None  # it hit the limit before its sandbox was caught: fine too
            (rec,) = wait_terminal(side_stack, [job.id], timeout=deadline(1, cold=1, plus=SOFT_S)).values()
            if frozen is not None:
                wait_until(lambda: not frozen.alive(), scaled(10), "the sandbox to be stopped")
            # The soft limit is an exception in the task, not a kill: the pool process lives on, and
            # the task lets go of the job's lease as it ends (just after it records the job FAILED).
            wait_until(lambda: side_stack.job_store().lease_holder(job.id) is None, scaled(10),
                       "the task to release the job's lease")
            worker = side_stack.workers["softlimit"]
            assert worker.alive() and len(pool_children(worker)) == 1
    finally:
        side_stack.stop_worker("softlimit")
    assert rec.state.value == "FAILED"
    # Whichever clock fires first: Celery's soft limit in the task ("timeout"), or the sandbox's
    # wall clock, which the worker caps at the same soft limit ("resource_limit").
    assert rec.error.code in ("timeout", "resource_limit") and rec.error.stage in STAGES, rec.error
    assert f"{SOFT_S} s" in rec.error.message and f"limit during {rec.error.stage}" in rec.error.message
    # What a failed job keeps: at most its manifest and report, recorded as stored.
    assert {a.name for a in rec.artifacts} <= {"manifest.json", "report.html"}
    stored = {o.key: o.sha256 for o in side_stack.artifact_store().list_prefix(job_prefix(rec.tenant, rec.id))}
    assert stored == {a.key: a.sha256 for a in rec.artifacts}
