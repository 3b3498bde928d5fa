"""Retention (fxport/retention.py) on both job stores, against the real backends.

Redis (its own database of the session's server, emptied first) with SeaweedFS S3 under a prefix
of its own, as the distributed stack runs it; SQLite with the file store, as `fxport serve`
embedded runs it. The sweep gets its clock (`now`) from the test, so "30 days later" takes no
waiting. The attack through the real API is tests/security/test_job_retention.py."""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from fxport.jobs import (
    InputAdmission,
    InputRef,
    JobRecord,
    JobState,
    JobStore,
    RedisJobStore,
    SharedArtifactsGone,
    SqliteJobStore,
    StoredArtifact,
    job_id_time,
    new_job_id,
)
from fxport.retention import RetentionPolicy, sweep_finished
from fxport.storage import ArtifactStore, FileStore, S3Store, StorageError, artifact_key, input_key

DAY = 86400.0
T0 = 1_780_000_000.0  # the test's epoch: every job is created relative to it
REDIS_DB = 12  # no other test uses it; emptied before each test


@dataclass
class Backends:
    jobs: JobStore
    artifacts: ArtifactStore
    tmp: Path

    def finished(self, tenant: str, at: float, *, state: JobState = JobState.SUCCEEDED, idem: str | None = None,
                 names: tuple[str, ...] = ("model.ts", "manifest.json")) -> JobRecord:
        """A job created and finished at `at`, with its artifacts stored."""
        job_id = new_job_id(at)
        arts = []
        for name in names:
            src = self.tmp / f"{job_id}-{name}"
            src.write_bytes(f"{job_id}/{name}".encode())
            obj = self.artifacts.put_file(artifact_key(tenant, job_id, name), src)
            arts.append(StoredArtifact(name=name, format="x", key=obj.key, bytes=obj.bytes, sha256=obj.sha256))
        rec = _record(tenant, job_id, at, state=state, artifacts=arts, idem=idem)
        return self.jobs.create(rec)[0]

    def cache_hit(self, tenant: str, source: JobRecord, at: float) -> JobRecord:
        """A job answered from the cache at `at`: it shares `source`'s artifacts (servicer._answer_from_cache)."""
        rec = _record(tenant, new_job_id(at), at, artifacts=source.artifacts).model_copy(
            update={"cache_hit": True, "artifacts_of": source.id})
        return self.jobs.create(rec)[0]

    def queued(self, tenant: str, at: float) -> JobRecord:
        rec = _record(tenant, new_job_id(at), at, state=JobState.QUEUED)
        return self.jobs.create(rec)[0]

    def stored(self, rec: JobRecord) -> list[bool]:
        return [self.artifacts.head(a.key) is not None for a in rec.artifacts]

    def input(self, tenant: str, data: bytes, keep_until: float) -> str:
        """An input stored and counted, as a submit stores it (servicer._store_input)."""
        sha = hashlib.sha256(data).hexdigest()
        src = self.tmp / sha
        src.write_bytes(data)
        self.artifacts.put_file(input_key(tenant, sha), src, sha256=sha)
        assert self.jobs.reserve_input(tenant, sha, len(data), keep_until, 0).admitted
        return sha

    def input_stored(self, tenant: str, sha: str) -> bool:
        return self.artifacts.head(input_key(tenant, sha)) is not None

    def with_model(self, tenant: str, at: float, sha: str, state: JobState) -> JobRecord:
        rec = _record(tenant, new_job_id(at), at, state=state)
        rec.model = InputRef(sha256=sha, bytes=1, key=input_key(tenant, sha))
        return self.jobs.create(rec)[0]


def _record(tenant: str, job_id: str, at: float, *, state: JobState = JobState.SUCCEEDED,
            artifacts: list[StoredArtifact] | None = None, idem: str | None = None) -> JobRecord:
    done = state.terminal
    return JobRecord(id=job_id, tenant=tenant, state=state, spec={"targets": ["torchscript"]}, spec_digest="d" * 64,
                     model=InputRef(sha256="a" * 64, bytes=1, key=f"{tenant}/inputs/{'a' * 64}"),
                     artifacts=artifacts or [], idempotency_key=idem, created_at=at, updated_at=at,
                     finished_at=at if done else None)


@pytest.fixture(params=["redis+s3", "sqlite+file"])
def backends(request, tmp_path) -> Iterator[Backends]:
    if request.param == "redis+s3":
        redis_server = request.getfixturevalue("redis_server")
        s3 = request.getfixturevalue("s3_server")
        url = redis_server.url.rsplit("/", 1)[0] + f"/{REDIS_DB}"
        jobs: JobStore = RedisJobStore(url)
        jobs.r.flushdb()  # type: ignore[attr-defined]
        artifacts: ArtifactStore = S3Store(s3.bucket, f"retention-{uuid.uuid4().hex[:8]}", endpoint_url=s3.endpoint)
    else:
        jobs = SqliteJobStore(tmp_path / "jobs.db")
        artifacts = FileStore(tmp_path / "store")
    try:
        yield Backends(jobs, artifacts, tmp_path)
    finally:
        jobs.close()


def test_job_ids_carry_their_creation_time():
    assert job_id_time(new_job_id(T0)) == T0
    assert job_id_time("not-a-job-id") is None


def test_finished_jobs_past_the_age_limit_go_with_their_artifacts(backends):
    old = backends.finished("alice", T0, idem="ci-run-1")
    failed = backends.finished("alice", T0 + 1, state=JobState.FAILED)
    fresh = backends.finished("alice", T0 + 20 * DAY)
    stuck = backends.queued("alice", T0 - DAY)  # older than all, never finished
    policy = RetentionPolicy(retention_s=30 * DAY, keep_per_tenant=0)

    result = sweep_finished(backends.jobs, backends.artifacts, policy, now=T0 + 31 * DAY)

    assert sorted(result.removed_age) == sorted([old.id, failed.id]) and not result.removed_count
    assert backends.jobs.get(old.id) is None and backends.jobs.get(failed.id) is None
    assert backends.stored(old) == [False, False] and backends.stored(failed) == [False, False]
    assert backends.jobs.get(fresh.id) is not None and backends.stored(fresh) == [True, True]
    assert backends.jobs.get(stuck.id) is not None  # QUEUED jobs are never removed
    # everything else of the removed job is gone too: its events, its index entry, its idempotency key
    assert backends.jobs.read_events(old.id) == []
    assert [r.id for r in backends.jobs.list("alice")[0]] == [fresh.id, stuck.id]
    assert backends.jobs.find_idempotent("alice", "ci-run-1") is None
    assert backends.jobs.pending_deletions() == []


def test_a_tenant_past_its_count_keeps_its_newest_and_other_tenants_keep_theirs(backends):
    alice = [backends.finished("alice", T0 + i, names=("model.ts",)) for i in range(7)]
    queued = backends.queued("alice", T0 - 1)  # the oldest, in flight: kept, and counted
    bob = [backends.finished("bob", T0 + i, names=("model.ts",)) for i in range(3)]
    policy = RetentionPolicy(retention_s=30 * DAY, keep_per_tenant=4)

    result = sweep_finished(backends.jobs, backends.artifacts, policy, now=T0 + DAY)

    assert result.removed_count == [r.id for r in alice[:4]] and not result.removed_age
    assert backends.jobs.count_jobs("alice") == 4
    assert [r.id for r in backends.jobs.list("alice")[0]] == [r.id for r in reversed(alice[4:])] + [queued.id]
    assert all(backends.stored(r) == [False] for r in alice[:4])
    assert all(backends.stored(r) == [True] for r in alice[4:])
    assert [backends.jobs.get(r.id) is not None for r in bob] == [True] * 3


def test_shared_artifacts_stay_until_the_last_job_sharing_them_goes(backends):
    source = backends.finished("alice", T0)
    hit = backends.cache_hit("alice", source, T0 + 25 * DAY)  # answered from the cache 25 days later
    policy = RetentionPolicy(retention_s=30 * DAY, keep_per_tenant=0)

    result = sweep_finished(backends.jobs, backends.artifacts, policy, now=T0 + 31 * DAY)

    # the job that made them is gone, but the cache hit still serves its artifacts
    assert result.removed_age == [source.id] and not result.deleted_prefixes
    assert backends.jobs.get(source.id) is None and backends.jobs.get(hit.id) is not None
    assert backends.stored(hit) == [True, True]
    # nothing can share them any more: the source is gone
    with pytest.raises(SharedArtifactsGone):
        backends.cache_hit("alice", source, T0 + 31 * DAY)

    result = sweep_finished(backends.jobs, backends.artifacts, policy, now=T0 + 56 * DAY)

    # the cache hit's own prefix (empty) and, now that it was the last to share them, the source's
    assert result.removed_age == [hit.id]
    assert sorted(result.deleted_prefixes) == sorted([f"alice/jobs/{hit.id}/", f"alice/jobs/{source.id}/"])
    assert backends.stored(hit) == [False, False]
    assert backends.jobs.pending_deletions() == []


def test_a_source_outliving_its_cache_hits_keeps_its_artifacts_until_it_goes(backends):
    source = backends.finished("alice", T0 + 10 * DAY)
    hit = backends.cache_hit("bob", source, T0 + 11 * DAY)  # another tenant's (shared cache)
    # bob keeps one job: his cache hit goes first, by count
    backends.finished("bob", T0 + 12 * DAY, names=())
    sweep_finished(backends.jobs, backends.artifacts, RetentionPolicy(0, keep_per_tenant=1), now=T0 + 12 * DAY)
    assert backends.jobs.get(hit.id) is None
    assert backends.stored(source) == [True, True]  # alice's job still has them

    result = sweep_finished(backends.jobs, backends.artifacts, RetentionPolicy(30 * DAY, 0), now=T0 + 41 * DAY)
    assert source.id in result.removed_age and f"alice/jobs/{source.id}/" in result.deleted_prefixes
    assert backends.stored(source) == [False, False]


class _FailingDeletes(FileStore):
    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.fail = True

    def delete_prefix(self, prefix: str) -> int:
        if self.fail:
            raise StorageError("the object store is away")
        return super().delete_prefix(prefix)

    def delete_object(self, key: str) -> None:
        if self.fail:
            raise StorageError("the object store is away")
        super().delete_object(key)


def test_artifacts_the_store_could_not_delete_are_deleted_on_the_next_round(tmp_path):
    store = _FailingDeletes(tmp_path / "store")
    b = Backends(SqliteJobStore(tmp_path / "jobs.db"), store, tmp_path)
    old = b.finished("alice", T0)
    policy = RetentionPolicy(retention_s=DAY, keep_per_tenant=0)

    first = sweep_finished(b.jobs, store, policy, now=T0 + 2 * DAY)
    assert first.removed_age == [old.id] and first.failed_prefixes == [f"alice/jobs/{old.id}/"]
    assert b.stored(old) == [True, True] and b.jobs.pending_deletions() == [f"alice/jobs/{old.id}/"]

    store.fail = False
    second = sweep_finished(b.jobs, store, policy, now=T0 + 2 * DAY)
    assert second.deleted_prefixes == [f"alice/jobs/{old.id}/"]
    assert b.stored(old) == [False, False] and b.jobs.pending_deletions() == []


def test_policy_names_its_settings():
    assert RetentionPolicy(30 * DAY, 10_000).describe() == (
        "finished jobs are kept 30 days after they end (FXPORT_JOB_RETENTION_S) and at most the newest 10000 per "
        "tenant (FXPORT_MAX_FINISHED_JOBS_PER_TENANT)")
    assert RetentionPolicy(0, 0).describe() == "finished jobs are kept for good"


def test_an_index_entry_left_without_its_record_is_dropped_and_not_counted(redis_server, tmp_path):
    """Redis only: SQLite's index is its jobs table, so no entry there outlives its record."""
    jobs = RedisJobStore(redis_server.url.rsplit("/", 1)[0] + f"/{REDIS_DB}")
    jobs.r.flushdb()
    b = Backends(jobs, FileStore(tmp_path / "store"), tmp_path)
    try:
        ghost = new_job_id(T0 - 1)
        jobs.r.zadd(jobs._tenant_jobs("alice"), {ghost: 0})
        kept = [b.finished("alice", T0 + i, names=()) for i in range(2)]

        result = sweep_finished(jobs, b.artifacts, RetentionPolicy(0, keep_per_tenant=2), now=T0 + 10)

        assert result.removed == [] and jobs.count_jobs("alice") == 2
        assert [r.id for r in jobs.list("alice")[0]] == [r.id for r in reversed(kept)]
    finally:
        jobs.close()


# -- inputs ---------------------------------------------------------------------------------


def test_the_input_ledger_holds_each_tenant_to_its_quota(backends):
    jobs, one, two, three = backends.jobs, "1" * 64, "2" * 64, "3" * 64
    assert jobs.reserve_input("alice", one, 600, T0 + DAY, 1000) == InputAdmission(True, 600)
    assert jobs.reserve_input("alice", two, 500, T0 + DAY, 1000) == InputAdmission(False, 600)  # 1100 > 1000
    # counted once, whatever the quota; a later use keeps it longer, an earlier one does not shorten it
    assert jobs.reserve_input("alice", one, 600, T0 + 2 * DAY, 1) == InputAdmission(True, 600)
    assert jobs.reserve_input("alice", one, 600, T0, 1000) == InputAdmission(True, 600)
    assert jobs.reserve_input("bob", two, 500, T0 + DAY, 1000).admitted  # one tenant's bytes are not another's
    assert jobs.reserve_input("alice", three, 400, T0 + DAY, 0).admitted  # 0: no quota
    assert jobs.input_bytes("alice") == 1000 and jobs.input_bytes("bob") == 500 and jobs.input_bytes("carol") == 0
    assert jobs.input_tenants() == ["alice", "bob"]

    assert jobs.inputs_due("alice", T0 + 1.5 * DAY, 10) == [three]
    assert jobs.forget_input("alice", one, T0 + 1.5 * DAY) is None  # not due
    assert jobs.forget_input("alice", three, T0 + 1.5 * DAY) == 400
    assert jobs.forget_input("alice", three, T0 + 1.5 * DAY) is None  # already gone
    assert jobs.input_bytes("alice") == 600
    assert jobs.reserve_input("alice", two, 400, T0 + DAY, 1000) == InputAdmission(True, 1000)  # room again


def test_inputs_go_once_due_unless_a_job_in_flight_names_them(backends):
    b = backends
    queued = b.input("alice", b"a model of a queued job", T0 + DAY)
    finished = b.input("alice", b"a model of a finished job", T0 + DAY)
    orphan = b.input("alice", b"uploaded, never submitted", T0 + DAY)
    later = b.input("alice", b"submitted again since", T0 + 30 * DAY)
    bobs = b.input("bob", b"a model of a finished job", T0 + DAY)  # the same bytes as alice's, bob's copy
    b.with_model("alice", T0, queued, JobState.QUEUED)
    b.with_model("alice", T0, finished, JobState.SUCCEEDED)
    b.with_model("bob", T0, bobs, JobState.RUNNING)

    result = sweep_finished(b.jobs, b.artifacts, RetentionPolicy(0, 0), now=T0 + 2 * DAY)

    assert sorted(result.deleted_inputs) == sorted(input_key("alice", sha) for sha in (finished, orphan))
    assert not b.input_stored("alice", finished) and not b.input_stored("alice", orphan)
    assert b.input_stored("alice", queued) and b.input_stored("alice", later) and b.input_stored("bob", bobs)
    assert b.jobs.input_bytes("alice") == len(b"a model of a queued job") + len(b"submitted again since")
    # a sweep narrowed to some tenants (a submit's wake-up) leaves inputs to the full rounds
    b.input("carol", b"due", T0)
    assert sweep_finished(b.jobs, b.artifacts, RetentionPolicy(0, 0), now=T0 + DAY, tenants=["carol"]
                          ).deleted_inputs == []


def test_an_input_the_store_could_not_delete_stays_counted_and_goes_on_the_next_round(tmp_path):
    store = _FailingDeletes(tmp_path / "store")
    b = Backends(SqliteJobStore(tmp_path / "jobs.db"), store, tmp_path)
    sha = b.input("alice", b"uploaded, never submitted", T0)

    first = sweep_finished(b.jobs, store, RetentionPolicy(0, 0), now=T0 + DAY)
    assert first.deleted_inputs == [] and b.input_stored("alice", sha)
    assert b.jobs.input_bytes("alice") == len(b"uploaded, never submitted")

    store.fail = False
    second = sweep_finished(b.jobs, store, RetentionPolicy(0, 0), now=T0 + DAY)
    assert second.deleted_inputs == [input_key("alice", sha)] and not b.input_stored("alice", sha)
    assert b.jobs.input_bytes("alice") == 0
