"""Redis (broker + job store, AOF as in production) restarts mid-run: queued and running jobs
complete afterwards, the API answers UNAVAILABLE meanwhile and recovers by itself, and a
client retrying through the outage (a read, a submit under its idempotency key) gets its
answer once Redis is back, with no duplicate job."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from fxport.client import ServerUnreachable
from tests.fixtures.servers import scaled
from tests.reliability.conftest import (
    SPEC,
    assert_like_clean_run,
    attempt_history,
    deadline,
    wait_terminal,
    wait_until,
)

pytestmark = pytest.mark.slow

OUTAGE_S = 3.0  # the scenario: how long Redis stays down


def test_redis_restart_with_aof_loses_no_job(fault_stack, clean_run, tiny_pt2):
    jobs = fault_stack.job_store()
    key = f"during-outage-{uuid.uuid4().hex[:8]}"
    with fault_stack.client() as client:
        ids = [client.submit(tiny_pt2, SPEC).id for _ in range(6)]
        wait_until(lambda: any(jobs.get(j).state.value == "RUNNING" for j in ids), deadline(1), "a running job")

        fault_stack.redis.stop()  # SIGTERM, as a pod restart: the AOF is flushed
        down_at = time.monotonic()
        answers: dict[str, object] = {}
        try:
            # Meanwhile: UNAVAILABLE naming the backend, at once for a client that won't wait.
            with fault_stack.client(retry_s=0) as impatient:
                t0 = time.monotonic()
                with pytest.raises(ServerUnreachable, match=r"job store \(Redis\) unavailable"):
                    impatient.get(ids[0])
                assert time.monotonic() - t0 < OUTAGE_S

            # A patient client's read and submit, both started during the outage, retry through it.
            def read() -> None:
                answers["read"] = client.get(ids[-1]).id

            def submit() -> None:
                answers["submit"] = client.submit(tiny_pt2, SPEC, idempotency_key=key).id

            threads = [threading.Thread(target=read), threading.Thread(target=submit)]
            for t in threads:
                t.start()
            time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - down_at)))
            assert all(t.is_alive() for t in threads), "the retrying calls should still be waiting"
        finally:
            fault_stack.redis.start_again()  # same port; replays the AOF
        for t in threads:  # they end on Redis being back (the API reconnects, the client's retry gets through)
            t.join(timeout=scaled(40))
            assert not t.is_alive(), "a call retrying through the outage did not get its answer once Redis was back"
        assert answers.get("read") == ids[-1]
        submitted = answers.get("submit")
        assert isinstance(submitted, str)
        # The same key again: the same job; no second one was created by the retries.
        assert client.submit(tiny_pt2, SPEC, idempotency_key=key).id == submitted

    records = wait_terminal(fault_stack, [*ids, submitted], timeout=deadline(len(ids) + 1))
    for job_id, rec in records.items():
        assert rec.state.value == "SUCCEEDED", (job_id, rec.error, fault_stack.logs())
        history = attempt_history(fault_stack, job_id)
        assert [a for a, _ in history] == list(range(1, rec.attempts + 1))
        assert_like_clean_run(fault_stack, job_id, clean_run)
    assert jobs.find_idempotent("default", key).id == submitted
