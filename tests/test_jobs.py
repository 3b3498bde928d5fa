"""JobStore on both backends (a real Redis, SQLite): idempotent create, guarded transitions,
resumable events, paging."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from fxport.errors import ErrorRecord
from fxport.jobs import (
    IdempotencyConflict,
    InputRef,
    JobRecord,
    JobState,
    RedisJobStore,
    SqliteJobStore,
    apply_update,
    decode_page_token,
    new_job_id,
)


@pytest.fixture(params=["sqlite", "redis"])
def jobs(request, tmp_path):
    if request.param == "sqlite":
        store = SqliteJobStore(tmp_path / "jobs.db")
    else:
        store = RedisJobStore(request.getfixturevalue("redis_server").url, namespace=f"t{uuid.uuid4().hex[:8]}")
    yield store
    store.close()


def record(tenant: str = "default", **kw) -> JobRecord:
    return JobRecord(id=new_job_id(), tenant=tenant, spec_digest=kw.pop("spec_digest", "d1"),
                     model=InputRef(sha256=kw.pop("sha", "a" * 64), bytes=1, key="k"), **kw)


def test_create_get_and_idempotency_key(jobs):
    first, created = jobs.create(record(idempotency_key="ci-run-42"))
    assert created and first.last_seq == 1 and jobs.get(first.id) == first
    again, created = jobs.create(record(idempotency_key="ci-run-42"))
    assert not created and again.id == first.id
    assert jobs.find_idempotent("default", "ci-run-42").id == first.id
    # Same key, other tenant: a different job. Same key, other spec: refused.
    other, created = jobs.create(record(tenant="other", idempotency_key="ci-run-42"))
    assert created and other.id != first.id
    with pytest.raises(IdempotencyConflict):
        jobs.create(record(idempotency_key="ci-run-42", spec_digest="d2"))
    assert jobs.get(new_job_id()) is None


def test_transitions_are_guarded_and_replays_harmless(jobs):
    rec, _ = jobs.create(record())
    rec, changed = jobs.transition(rec.id, state=JobState.RUNNING, stage="load", new_attempt=True, worker="w1")
    assert changed and rec.state is JobState.RUNNING and rec.attempts == 1 and rec.started_at
    rec, _ = jobs.transition(rec.id, stage="capture", progress=0.5, message="fx")
    assert rec.stage_timings["load"].finished_at and rec.stage_timings["capture"].started_at
    done, changed = jobs.transition(rec.id, state=JobState.SUCCEEDED)
    assert changed and done.finished_at and done.progress == 1.0
    # A late progress event, a replayed FAILED, a cancel, a requeue: none move a finished job.
    for late in ({"stage": "verify", "progress": 0.1}, {"state": JobState.FAILED},
                 {"state": JobState.CANCELLED}, {"state": JobState.QUEUED}, {"state": JobState.RUNNING}):
        after, changed = jobs.transition(done.id, **late)
        assert not changed and after == done
    assert jobs.get(done.id) == done
    assert jobs.transition(new_job_id(), state=JobState.RUNNING) == (None, False)


def test_events_are_sequenced_and_resumable(jobs):
    rec, _ = jobs.create(record())
    jobs.transition(rec.id, state=JobState.RUNNING, stage="load")
    jobs.transition(rec.id, stage="capture", progress=0.3)
    jobs.transition(rec.id, state=JobState.FAILED, error=ErrorRecord(stage="capture", code="capture_failed",
                                                                        message="no"))
    events = jobs.read_events(rec.id, 0)
    assert [e.seq for e in events] == [1, 2, 3, 4]
    assert [e.state for e in events] == [JobState.QUEUED, JobState.RUNNING, JobState.RUNNING, JobState.FAILED]
    assert events[2].stage == "capture" and events[2].progress == pytest.approx(0.3)
    assert [e.seq for e in jobs.read_events(rec.id, 2)] == [3, 4]  # resume after seq 2
    assert jobs.read_events(rec.id, 4, timeout=0.2) == []


def test_read_events_wakes_on_a_new_event(jobs):
    rec, _ = jobs.create(record())
    timer = threading.Timer(0.3, lambda: jobs.transition(rec.id, state=JobState.RUNNING))
    timer.start()
    t0 = time.monotonic()
    events = jobs.read_events(rec.id, 1, timeout=5)
    timer.join()
    assert [e.seq for e in events] == [2] and time.monotonic() - t0 < 2.5


def test_list_pages_newest_first_with_filters(jobs):
    made = []
    for i in range(5):
        rec, _ = jobs.create(record(labels={"team": "vision" if i % 2 == 0 else "nlp"}))
        made.append(rec.id)
        time.sleep(0.002)
    jobs.create(record(tenant="someone-else"))
    jobs.transition(made[4], state=JobState.CANCELLED)

    page1, tok = jobs.list("default", page_size=2)
    page2, tok2 = jobs.list("default", page_size=2, page_token=tok)
    page3, tok3 = jobs.list("default", page_size=2, page_token=tok2)
    assert [r.id for r in page1 + page2 + page3] == made[::-1] and tok3 is None
    vision, _ = jobs.list("default", labels={"team": "vision"})
    assert [r.id for r in vision] == [made[4], made[2], made[0]]
    queued_vision, _ = jobs.list("default", labels={"team": "vision"}, states=[JobState.QUEUED])
    assert [r.id for r in queued_vision] == [made[2], made[0]]
    with pytest.raises(ValueError, match="page_token"):
        jobs.list("default", page_token="not-a-token")


def test_a_filtered_list_examines_a_bounded_share_per_call_and_pages_on(jobs, monkeypatch):
    """A filter few jobs match returns a short page (even an empty one) with a token once the call
    examined LIST_SCAN_LIMIT records, instead of reading the tenant's whole history in one call.
    The records it skips unparsed are only those that cannot match: labels the serializer escapes
    still match."""
    monkeypatch.setattr(type(jobs), "LIST_SCAN_LIMIT", 30)
    odd = {"run": 'vé "quoted" <\\ / 7>'}
    now = time.time()
    match, _ = jobs.create(record(labels=odd).model_copy(update={"id": new_job_id(now - 100)}))
    jobs.transition(match.id, state=JobState.FAILED)
    for i in range(40):
        jobs.create(record(labels={"run": str(i)}).model_copy(update={"id": new_job_id(now - 50 + i)}))

    page, token = jobs.list("default", labels=odd)
    assert page == [] and token  # 30 of the 41 examined, none of them a match
    page, token = jobs.list("default", labels=odd, page_token=token)
    assert [r.id for r in page] == [match.id] and token is None
    page, token = jobs.list("default", states=[JobState.FAILED])
    page += jobs.list("default", states=[JobState.FAILED], page_token=token)[0]
    assert [r.id for r in page] == [match.id]
    # an unfiltered page fills from the newest as before
    assert len(jobs.list("default", page_size=25)[0]) == 25


def test_ids_in_states_for_recovery(jobs):
    a, _ = jobs.create(record())
    b, _ = jobs.create(record())
    jobs.transition(b.id, state=JobState.RUNNING)
    c, _ = jobs.create(record())
    jobs.transition(c.id, state=JobState.SUCCEEDED)
    assert set(jobs.ids_in_states([JobState.QUEUED, JobState.RUNNING])) >= {a.id, b.id}
    assert c.id not in jobs.ids_in_states([JobState.QUEUED, JobState.RUNNING])


def test_state_machine_table():
    base = record()
    running = apply_update(base, state=JobState.RUNNING)
    assert apply_update(base, state=JobState.CANCELLED).state is JobState.CANCELLED
    assert apply_update(running, state=JobState.QUEUED).state is JobState.QUEUED  # requeued after restart
    for terminal in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED):
        done = apply_update(running, state=terminal)
        assert all(apply_update(done, state=s) is None for s in JobState)


def test_job_ids_sort_by_time_and_tokens_roundtrip():
    a = new_job_id(1_000.0)
    b = new_job_id(1_000.002)
    assert a < b and len(a) == 26
    from fxport.jobs import encode_page_token

    assert decode_page_token(encode_page_token(a)) == a


def test_fenced_updates_apply_only_to_their_attempt(jobs):
    rec, _ = jobs.create(record())
    jobs.transition(rec.id, state=JobState.RUNNING, new_attempt=True, worker="w1")
    jobs.transition(rec.id, state=JobState.RUNNING, new_attempt=True, worker="w2")  # a redelivery took over
    stale, changed = jobs.transition(rec.id, state=JobState.SUCCEEDED, expect_attempt=1)
    assert not changed and stale.state is JobState.RUNNING
    now, changed = jobs.transition(rec.id, stage="export", expect_attempt=2, expect_state=JobState.RUNNING)
    assert changed and now.stage == "export"
    _, changed = jobs.transition(rec.id, state=JobState.QUEUED, expect_state=JobState.QUEUED)
    assert not changed
    # Events say which attempt (and worker) wrote them.
    assert [(e.attempt, e.worker) for e in jobs.read_events(rec.id, 0)] == [
        (0, None), (1, "w1"), (2, "w2"), (2, "w2")]


def test_job_lease_is_exclusive_renewable_and_expires(jobs):
    job_id = new_job_id()
    assert jobs.acquire_lease(job_id, "a", 0.5) is None
    assert jobs.acquire_lease(job_id, "a", 0.5) is None  # already ours: fine
    assert jobs.acquire_lease(job_id, "b", 0.5) == "a"
    assert jobs.lease_holder(job_id) == "a" and jobs.last_heartbeat(job_id) is not None
    beat = jobs.last_heartbeat(job_id)
    time.sleep(0.3)
    assert jobs.renew_lease(job_id, "a", 0.5) and not jobs.renew_lease(job_id, "b", 0.5)
    assert jobs.last_heartbeat(job_id) > beat
    time.sleep(0.3)
    assert jobs.lease_holder(job_id) == "a"  # renewed: not expired at 0.6 s
    time.sleep(0.4)
    assert jobs.lease_holder(job_id) is None  # expired: its holder stopped renewing
    assert not jobs.renew_lease(job_id, "a", 0.5)
    assert jobs.acquire_lease(job_id, "b", 0.5) is None
    assert not jobs.release_lease(job_id, "a") and jobs.release_lease(job_id, "b")
    assert jobs.lease_holder(job_id) is None and abs(jobs.clock() - time.time()) < 5


def test_sweep_orphans_requeues_or_fails_only_silent_unleased_running_jobs(jobs):
    from fxport.jobs import sweep_orphans

    old = time.time() - 600

    def running(attempts: int = 1, stage: str = "export", at: float = old) -> str:
        rec, _ = jobs.create(record())
        for _ in range(attempts):
            jobs.transition(rec.id, state=JobState.RUNNING, stage=stage, new_attempt=True, worker="gone:1", now=at)
        return rec.id

    orphan, exhausted, recent, leased, waiting_gpu = (
        running(), running(attempts=3), running(at=time.time()), running(), running(stage="tensorrt"))
    queued, _ = jobs.create(record())
    jobs.acquire_lease(leased, "alive:2", 30)
    requeued: list[str] = []
    result = sweep_orphans(jobs, requeued.append, orphan_after_s=60)
    assert result.requeued == requeued == [orphan] and result.failed == [exhausted]
    assert jobs.get(orphan).state is JobState.QUEUED
    assert jobs.get(orphan).message.startswith("requeued: its worker gone:1")
    failed = jobs.get(exhausted)
    assert failed.state is JobState.FAILED and failed.error.code == "worker_lost" and "3 times" in failed.error.message
    for untouched in (recent, leased, waiting_gpu):
        assert jobs.get(untouched).state is JobState.RUNNING
    assert jobs.get(queued.id).state is JobState.QUEUED
    # A second sweeper at the same moment does nothing twice.
    assert sweep_orphans(jobs, requeued.append, orphan_after_s=60).requeued == []
    assert set(jobs.running_ids()) == {recent, leased, waiting_gpu}


def test_count_in_flight_follows_every_transition(jobs):
    """What per-tenant admission asks on every submit (service/limits.py): QUEUED or RUNNING jobs."""
    made = [jobs.create(record(tenant="counted"))[0].id for _ in range(6)]
    jobs.transition(made[0], state=JobState.RUNNING)
    jobs.transition(made[4], state=JobState.FAILED)
    jobs.transition(made[5], state=JobState.RUNNING)
    jobs.create(record(tenant="someone-else"))
    assert jobs.count_in_flight("counted") == 5
    jobs.transition(made[1], state=JobState.CANCELLED)
    jobs.transition(made[0], state=JobState.SUCCEEDED)
    jobs.transition(made[5], state=JobState.QUEUED)  # requeued: still in flight
    assert jobs.count_in_flight("counted") == 3
    assert jobs.count_in_flight("counted", exact=True) == 3
    assert jobs.count_in_flight("someone-else") == 1
    assert jobs.count_in_flight("nobody") == 0
    jobs.create(record(tenant="cached", state=JobState.SUCCEEDED))  # a cache hit is born finished
    assert jobs.count_in_flight("cached") == 0


def test_in_flight_index_is_checked_against_the_records(redis_server):
    """The Redis index is a set kept beside the records: one that is out of step (a job recorded
    before the index existed, or a member left behind) is counted right by `exact`, which repairs it."""
    jobs = RedisJobStore(redis_server.url, namespace=f"t{uuid.uuid4().hex[:8]}")
    try:
        queued = jobs.create(record(tenant="t"))[0].id
        finished = jobs.create(record(tenant="t"))[0].id
        jobs.transition(finished, state=JobState.FAILED)
        jobs.r.sadd(jobs._in_flight("t"), finished)  # left behind
        jobs.r.srem(jobs._in_flight("t"), queued)  # recorded before the index
        assert jobs.count_in_flight("t") == 1  # the stale member, not the queued job
        assert jobs.count_in_flight("t", exact=True) == 0  # the stale member dropped; the queued job not indexed yet
        assert jobs.count_in_flight("t") == 0
        assert not jobs.r.sismember(jobs._in_flight("t"), finished)
        jobs.transition(queued, state=JobState.RUNNING)  # its next update enters it
        assert jobs.count_in_flight("t") == 1
    finally:
        jobs.close()


def test_an_unreachable_redis_is_retried_for_retry_s_then_raises():
    """RedisJobStore's `retry_s` is a deadline (fxport/retry.py through fxport/jobs/redis_retry.py):
    no try starts past it, and 0 means one try."""
    import redis

    from tests.fixtures.servers import free_port

    dead = f"redis://127.0.0.1:{free_port()}/0"
    for budget, at_least in ((0.0, 0.0), (1.5, 0.3)):
        jobs = RedisJobStore(dead, retry_s=budget)
        t0 = time.monotonic()
        with pytest.raises(redis.ConnectionError):
            jobs.get(new_job_id())
        took = time.monotonic() - t0
        assert at_least <= took <= budget + 0.5, (budget, took)
        jobs.close()
