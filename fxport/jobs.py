"""Job records and the job store: create (idempotent), get, list, guarded transitions, events.

Every change of a job goes through `JobStore.transition`, which applies `apply_update`
(the one place the state machine lives) and appends an event in the same atomic step, so
WatchJob never sees a state the record did not have, and a replayed or late update can
never move a finished job backwards.

Two backends:
- `RedisJobStore` (distributed): a Redis hash per job, a Redis Stream of events per job with
  ids `0-<seq>` (so the stream id *is* the event sequence number and `XREAD` from `0-<n>`
  resumes exactly after event n), a sorted set per tenant for listing, idempotency keys as
  plain keys set in the same Lua step that creates the job.
- `SqliteJobStore` (embedded): one SQLite file under $FXPORT_HOME. Chosen over an in-process
  dict so that job history and artifacts survive a restart of `fxport serve` (`fxport jobs
  list/download` still work) and jobs interrupted by a restart can be re-run. Waiters in the
  same process are woken by a condition variable; other processes fall back to polling.

redis is imported only by RedisJobStore.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import sqlite3
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from fxport.manifest import PrintableText
from fxport.storage import JOB_ID_RE, job_prefix


class JobState(str, Enum):
    QUEUED = "QUEUED"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_STATES


TERMINAL_STATES = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})
IN_FLIGHT_STATES = frozenset({JobState.QUEUED, JobState.RUNNING})
KEEP_FOREVER = 1e12  # an input ledger entry's keep_until when inputs are kept for good (year 33658)
STAGES = ("load", "capture", "passes", "quantize", "export", "verify", "benchmark", "package", "tensorrt",
          "upload")


class InputRef(BaseModel):
    sha256: str
    bytes: int
    filename: str = ""
    key: str


class ArtifactRecord(BaseModel):
    name: str
    format: str
    key: str
    bytes: int
    sha256: str


class JobErrorInfo(BaseModel):
    """A failed job's error (no control characters, whoever wrote it)."""

    stage: PrintableText | None = None
    code: PrintableText = "internal"
    message: PrintableText
    detail: PrintableText | None = None


class StageTiming(BaseModel):
    started_at: float | None = None
    finished_at: float | None = None


class JobRecord(BaseModel):
    """One job (DESIGN.md §2). Times are Unix seconds."""

    id: str
    tenant: str
    state: JobState = JobState.QUEUED
    stage: str | None = None
    progress: float = 0.0
    message: str = ""
    spec: dict[str, Any] = Field(default_factory=dict, description="The normalized spec.")
    spec_digest: str = ""
    labels: dict[str, str] = Field(default_factory=dict)
    model: InputRef
    calibration: InputRef | None = None
    artifacts: list[ArtifactRecord] = Field(default_factory=list)
    staged: list[ArtifactRecord] = Field(
        default_factory=list,
        description="Artifacts stored while the job runs, before verification ended (latest copy of each name); "
                    "cleared whenever the job leaves RUNNING or starts a new attempt.")
    error: JobErrorInfo | None = None
    created_at: float = Field(default_factory=time.time)
    updated_at: float = Field(default_factory=time.time)
    started_at: float | None = None
    finished_at: float | None = None
    stage_timings: dict[str, StageTiming] = Field(default_factory=dict)
    cache_hit: bool = False
    worker: str | None = None
    attempts: int = 0
    idempotency_key: str | None = None
    task_id: str | None = None
    last_seq: int = 0
    artifacts_of: str | None = Field(
        None, description="A cache hit: the job whose artifacts it shares. They are kept while any job sharing "
                          "them is (JobStore.remove).")
    trace_context: dict[str, str] | None = Field(
        None, description="The submit's trace (W3C traceparent), which every worker that runs the job continues "
                          "(fxport/tracing.py); None when tracing is off.")

    @property
    def terminal(self) -> bool:
        return self.state.terminal


class JobEvent(BaseModel):
    seq: int
    job_id: str
    time: float
    state: JobState
    stage: str | None = None
    progress: float = 0.0
    message: str = ""
    # Which delivery of the job wrote this event: a job's events show each attempt's start
    # and its end, and never one attempt's events after the next attempt started.
    attempt: int = 0
    worker: str | None = None
    staged: ArtifactRecord | None = None  # this event is an artifact stored early (JobRecord.staged)

    @property
    def terminal(self) -> bool:
        return self.state.terminal


@dataclass(frozen=True)
class InputAdmission:
    """JobStore.reserve_input's answer: whether the input is counted, and the tenant's total after."""

    admitted: bool
    used_bytes: int


class IdempotencyConflict(Exception):
    """The idempotency key names an earlier job submitted with a different model or spec."""

    def __init__(self, existing: JobRecord) -> None:
        super().__init__(
            f"idempotency key {existing.idempotency_key!r} was used for job {existing.id} "
            "with a different model or spec; use a new key"
        )
        self.existing = existing


_CROCKFORD = "0123456789abcdefghjkmnpqrstvwxyz"


class SharedArtifactsGone(Exception):
    """A cache hit's source job was removed (retention) between the lookup and the new record:
    its artifacts are going, so the submit is converted instead."""


def job_id_time(job_id: str) -> float | None:
    """The creation time (Unix seconds) a job id carries (see new_job_id); None for a malformed id."""
    if len(job_id) != 26 or not all(c in _CROCKFORD for c in job_id):
        return None
    value = 0
    for c in job_id:
        value = (value << 5) | _CROCKFORD.index(c)
    return (value >> 80) / 1000.0


def new_job_id(now: float | None = None) -> str:
    """A lowercase ULID: 48-bit milliseconds + 80 random bits. Sorts by creation time."""
    ms = int((time.time() if now is None else now) * 1000)
    value = (ms << 80) | int.from_bytes(os.urandom(10), "big")
    out = []
    for _ in range(26):
        out.append(_CROCKFORD[value & 31])
        value >>= 5
    return "".join(reversed(out))


_UNSET: Any = object()


def apply_update(
    record: JobRecord,
    *,
    state: JobState | None = None,
    stage: str | None = _UNSET,
    progress: float | None = None,
    message: str | None = None,
    error: JobErrorInfo | None = None,
    artifacts: list[ArtifactRecord] | None = None,
    staged: ArtifactRecord | None = None,
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
    if record.terminal:
        return None
    if expect_attempt is not None and record.attempts != expect_attempt:
        return None
    if expect_state is not None and record.state is not expect_state:
        return None
    allowed = {
        JobState.QUEUED: {JobState.QUEUED, JobState.RUNNING, *TERMINAL_STATES},
        JobState.RUNNING: {JobState.QUEUED, JobState.RUNNING, *TERMINAL_STATES},
    }
    if state is not None and state not in allowed[record.state]:
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
        if rec.stage in rec.stage_timings and rec.stage_timings[rec.stage].finished_at is None:
            rec.stage_timings[rec.stage].finished_at = now
        if stage is not None:
            rec.stage_timings[stage] = StageTiming(started_at=now)
        rec.stage = stage
        if progress is None:
            rec.progress = 0.0
    if progress is not None:
        rec.progress = max(0.0, min(1.0, float(progress)))
    if message is not None:
        rec.message = message
    if error is not None:
        rec.error = error
    if artifacts is not None:
        rec.artifacts = list(artifacts)
    if staged is not None:
        if rec.state is not JobState.RUNNING:
            return None  # stored for an attempt that is over: nothing to offer
        rec.staged = [a for a in rec.staged if a.name != staged.name] + [staged]
    if rec.state is not JobState.RUNNING or new_attempt:
        rec.staged = []  # another attempt re-uploads; an ended job offers its `artifacts` only
    if worker is not None:
        rec.worker = worker
    if task_id is not None:
        rec.task_id = task_id
    if cache_hit is not None:
        rec.cache_hit = cache_hit
    if rec.state.terminal:
        rec.finished_at = now
        if rec.stage in rec.stage_timings and rec.stage_timings[rec.stage].finished_at is None:
            rec.stage_timings[rec.stage].finished_at = now
        if rec.state is JobState.SUCCEEDED:
            rec.progress = 1.0
    rec.updated_at = now
    return rec


def event_for(rec: JobRecord, seq: int, staged: ArtifactRecord | None = None) -> JobEvent:
    return JobEvent(
        seq=seq, job_id=rec.id, time=rec.updated_at, state=rec.state, stage=rec.stage,
        progress=rec.progress, message=rec.message, attempt=rec.attempts, worker=rec.worker, staged=staged,
    )


def _encode_token(job_id: str) -> str:
    return base64.urlsafe_b64encode(json.dumps({"before": job_id}).encode()).decode().rstrip("=")


def decode_page_token(token: str | None) -> str | None:
    """The job id a page starts below; ValueError for a token this server did not make."""
    if not token:
        return None
    try:
        data = json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
        before = data["before"]
    except (ValueError, KeyError, TypeError):
        raise ValueError("invalid page_token: pass back next_page_token unchanged") from None
    if not isinstance(before, str) or not JOB_ID_RE.match(before):
        raise ValueError("invalid page_token: pass back next_page_token unchanged")
    return before


def _idem_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class JobStore(ABC):
    """Where job records and their events live. Tenant scoping is the caller's job for
    `get` (a record carries its tenant); `list` and idempotency keys are per tenant."""

    MAX_PAGE = 500
    # Records one `list` call examines at most. A filter that matches few of a tenant's jobs
    # otherwise read all of them in one call (10,000 records: 1 s), and a tenant sending such
    # calls side by side held every RPC thread of the API, health checks' included. Past it the
    # call returns the page so far (even an empty one) with a token to go on from.
    LIST_SCAN_LIMIT = 2_000

    @abstractmethod
    def create(self, record: JobRecord) -> tuple[JobRecord, bool]:
        """Store a new QUEUED record (and its first event). With `record.idempotency_key` set
        and already used by this tenant, returns (the earlier job, False) instead; raises
        IdempotencyConflict if that job had a different model or spec."""

    @abstractmethod
    def get(self, job_id: str) -> JobRecord | None: ...

    @abstractmethod
    def find_idempotent(self, tenant: str, key: str) -> JobRecord | None: ...

    @abstractmethod
    def transition(self, job_id: str, **changes: Any) -> tuple[JobRecord | None, bool]:
        """Apply `apply_update(record, **changes)` atomically and append an event.
        Returns (record after, changed). (None, False) for an unknown job."""

    @abstractmethod
    def read_events(self, job_id: str, after_seq: int = 0, timeout: float = 0.0) -> list[JobEvent]:
        """Events with seq > after_seq; waits up to `timeout` seconds for one to arrive."""

    @abstractmethod
    def _ids_desc(self, tenant: str, before: str | None, limit: int) -> list[str]:
        """Job ids of `tenant`, newest first, strictly below `before`."""

    @abstractmethod
    def _raw_many(self, ids: list[str]) -> list[str | None]:
        """The stored JSON of each of `ids` (None where gone), read in one round trip."""

    def _get_many(self, ids: list[str], might_match: Callable[[str], bool]) -> list[JobRecord | None]:
        """The records of `ids` (None where gone, or where `might_match`, given the record's
        JSON, says it cannot match a filter, so it is never parsed)."""
        return [JobRecord.model_validate_json(raw) if raw and might_match(raw) else None
                for raw in self._raw_many(ids)]

    @abstractmethod
    def ids_in_states(self, states: Iterable[JobState]) -> list[str]:
        """Every job id (all tenants) in one of `states`; for recovery after a restart."""

    def running_ids(self) -> list[str]:
        """Ids of RUNNING jobs (the orphan sweeper's candidates)."""
        return self.ids_in_states([JobState.RUNNING])

    @abstractmethod
    def count_in_flight(self, tenant: str, *, exact: bool = False) -> int:
        """How many of `tenant`'s jobs are QUEUED or RUNNING: per-tenant admission asks on every
        submit, so it is answered from an index kept with the records, in time independent of
        the tenant's history. `exact`: check each indexed job against its record and drop the
        ones no longer in flight — what admission does before it refuses a submit. (A job
        recorded before the index existed is counted from its next update on.)"""

    # -- retention (fxport/retention.py): finished jobs are removed, their artifacts after them ---
    # A cache hit's record shares its source job's artifacts (`artifacts_of`). Removing a job
    # queues its artifact prefix for deletion only once no remaining job shares it, in the same
    # atomic step; and a new share is only recorded while the source job still exists (create
    # raises SharedArtifactsGone otherwise). So no remaining record ever points at deleted bytes.

    @abstractmethod
    def tenants(self) -> list[str]:
        """Every tenant with a job record."""

    @abstractmethod
    def ids_asc(self, tenant: str, after: str | None, limit: int) -> list[str]:
        """Job ids of `tenant`, oldest first, strictly above `after`."""

    @abstractmethod
    def count_jobs(self, tenant: str) -> int:
        """How many job records `tenant` has, in any state."""

    @abstractmethod
    def remove(self, job_id: str, tenant: str | None = None) -> bool | None:
        """Delete a finished job: its record, events, lease, idempotency key and index entries;
        queue its artifact prefix for deletion unless a job still shares it, and its source's
        prefix when it was the last job sharing that one and the source is gone. True: removed;
        False: kept, because it is QUEUED or RUNNING; None: no such job (`tenant`'s index entry
        for it, if one was left, is dropped)."""

    @abstractmethod
    def pending_deletions(self, limit: int = 100) -> list[str]:
        """Artifact prefixes queued by `remove`, oldest first."""

    @abstractmethod
    def deletion_done(self, prefix: str) -> None:
        """Drop `prefix` from the queue once its objects are deleted."""

    # -- the input ledger (fxport/retention.py, sweep_inputs): what each tenant stores under ----
    # `{tenant}/inputs/`, so that a tenant's stored input bytes have a quota and inputs no job
    # uses are deleted. One entry per (tenant, sha256): its size and the store-clock time it
    # may be deleted after (`keep_until`), which every use of the input pushes later. Inputs
    # that QUEUED or RUNNING jobs name are never deleted, whatever their entry says.

    @abstractmethod
    def reserve_input(self, tenant: str, sha256: str, size: int, keep_until: float, quota: int) -> InputAdmission:
        """Count an input against `tenant`'s quota, atomically. Already counted: its keep_until is
        pushed to `keep_until` if that is later, and it is admitted whatever the quota. New: admitted
        and counted when the tenant's total stays within `quota` (0 = no quota); refused otherwise."""

    @abstractmethod
    def input_bytes(self, tenant: str) -> int:
        """The bytes of `tenant`'s counted inputs."""

    @abstractmethod
    def input_tenants(self) -> list[str]:
        """Every tenant with a counted input."""

    @abstractmethod
    def inputs_due(self, tenant: str, now: float, limit: int) -> list[str]:
        """sha256s of `tenant`'s inputs whose keep_until is before `now`, oldest first."""

    @abstractmethod
    def forget_input(self, tenant: str, sha256: str, now: float) -> int | None:
        """Drop the input's entry (and its bytes from the tenant's total) if its keep_until is still
        before `now`, returning its size; None when a use pushed it later meanwhile, or it is gone."""

    @abstractmethod
    def _in_flight_ids(self, tenant: str) -> list[str]:
        """Ids that may be `tenant`'s QUEUED or RUNNING jobs (a superset is fine)."""

    def inputs_in_use(self, tenant: str) -> set[str]:
        """sha256s of the inputs `tenant`'s QUEUED or RUNNING jobs name."""
        in_use: set[str] = set()
        for raw in self._raw_many(self._in_flight_ids(tenant)):
            if raw is None:
                continue
            rec = JobRecord.model_validate_json(raw)
            if not rec.terminal:
                in_use.update(ref.sha256 for ref in (rec.model, rec.calibration) if ref is not None)
        return in_use

    # -- job leases (DESIGN.md §7): at most one live worker runs a job -----------------------
    # A worker takes the lease before it starts a job and renews it while the job runs; a
    # redelivered copy of the job finds it held and waits. The lease expires on its own when
    # the worker dies; each renewal also stamps a heartbeat, for the orphan sweeper.

    @abstractmethod
    def acquire_lease(self, job_id: str, owner: str, ttl_s: float) -> str | None:
        """Take the job's lease for `ttl_s` seconds. None when taken (or already ours);
        otherwise the holder's name."""

    @abstractmethod
    def renew_lease(self, job_id: str, owner: str, ttl_s: float) -> bool:
        """Extend our lease and stamp the heartbeat; False if we no longer hold it."""

    @abstractmethod
    def release_lease(self, job_id: str, owner: str) -> bool:
        """Drop the lease if `owner` holds it (so a dead holder's lease can be broken too)."""

    @abstractmethod
    def lease_holder(self, job_id: str) -> str | None: ...

    @abstractmethod
    def last_heartbeat(self, job_id: str) -> float | None:
        """Store-clock seconds of the job's last lease renewal, if any."""

    def clock(self) -> float:
        """Now, on the clock heartbeats are stamped with (the store's, not this host's)."""
        return time.time()

    def close(self) -> None:  # noqa: B027 - an optional hook: a store holding no resources keeps this no-op
        pass

    def list(
        self,
        tenant: str,
        *,
        states: Iterable[JobState] | None = None,
        labels: dict[str, str] | None = None,
        page_size: int = 50,
        page_token: str | None = None,
    ) -> tuple[list[JobRecord], str | None]:
        """Newest first. Returns (page, next_page_token or None). A page may hold fewer than
        `page_size` jobs, even none, and still have a token: the call examined LIST_SCAN_LIMIT
        records and left the rest to the next call."""
        page_size = max(1, min(int(page_size or 50), self.MAX_PAGE))
        want_states = set(states or ())
        want_labels = dict(labels or {})
        might_match = _filter_precheck(want_states, want_labels)
        before = decode_page_token(page_token)
        out: list[JobRecord] = []
        batch = max(2 * page_size, 100)
        examined = 0
        while True:
            asked = min(batch, self.LIST_SCAN_LIMIT - examined)
            ids = self._ids_desc(tenant, before, asked)
            for job_id, rec in zip(ids, self._get_many(ids, might_match), strict=True):
                before = job_id
                examined += 1
                if rec is not None and (not want_states or rec.state in want_states) \
                        and all(rec.labels.get(k) == v for k, v in want_labels.items()):
                    out.append(rec)
                if len(out) == page_size or examined >= self.LIST_SCAN_LIMIT:
                    more = bool(self._ids_desc(tenant, job_id, 1))
                    return out, (_encode_token(job_id) if more else None)
            if len(ids) < asked:
                return out, None


def _filter_precheck(states: set[JobState], labels: dict[str, str]) -> Callable[[str], bool]:
    """A test on a record's JSON that every record matching the filter passes (most others fail
    it): each wanted label as the record's own serializer writes it, and one of the states."""
    import pydantic_core

    needles = [pydantic_core.to_json({k: v}).decode()[1:-1] for k, v in labels.items()]
    state_needles = [f'"state":"{s.value}"' for s in states]

    def might_match(raw: str) -> bool:
        return all(n in raw for n in needles) and (not state_needles or any(n in raw for n in state_needles))

    return might_match


def _shared_source(rec: JobRecord) -> tuple[str, str] | None:
    """(source job id, its artifact prefix) for a record that shares another job's artifacts."""
    if not rec.artifacts_of or not rec.artifacts:
        return None
    tenant = rec.artifacts[0].key.split("/", 1)[0]
    return rec.artifacts_of, job_prefix(tenant, rec.artifacts_of)


def _same_request(a: JobRecord, b: JobRecord) -> bool:
    return (
        a.model.sha256 == b.model.sha256
        and a.spec_digest == b.spec_digest
        and (a.calibration.sha256 if a.calibration else None) == (b.calibration.sha256 if b.calibration else None)
    )


# ---------------------------------------------------------------------------------------
# Redis
# ---------------------------------------------------------------------------------------

_CREATE_LUA = """
if ARGV[4] ~= '' then
  local existing = redis.call('GET', KEYS[4])
  if existing then return existing end
end
if ARGV[9] == '1' and redis.call('EXISTS', KEYS[6]) == 0 then return false end
if ARGV[4] ~= '' then redis.call('SET', KEYS[4], ARGV[1]) end
redis.call('HSET', KEYS[1], 'record', ARGV[2], 'state', ARGV[3], 'seq', 1)
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[6], '0-1', 'e', ARGV[5])
redis.call('EXPIRE', KEYS[2], ARGV[8])
redis.call('ZADD', KEYS[3], 0, ARGV[1])
if ARGV[7] == '1' then redis.call('SADD', KEYS[5], ARGV[1]) end
if ARGV[9] == '1' then redis.call('SADD', KEYS[7], ARGV[1]) end
return ARGV[1]
"""

# KEYS: 1 job, 2 events, 3 tenant's jobs, 4 in-flight, 5 running, 6 lease, 7 heartbeat,
# 8 idempotency key (or a placeholder), 9 jobs sharing this one's artifacts, 10 the deletion
# queue, 11 the source job (or a placeholder), 12 jobs sharing the source's artifacts.
# ARGV: 1 job id, 2 its artifact prefix, 3 '1' when it shares a source's artifacts, 4 the
# source's prefix.
_REMOVE_LUA = """
local state = redis.call('HGET', KEYS[1], 'state')
if not state then
  redis.call('ZREM', KEYS[3], ARGV[1])
  return 0
end
if state == 'QUEUED' or state == 'RUNNING' then return -1 end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[6], KEYS[7])
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('SREM', KEYS[4], ARGV[1])
redis.call('SREM', KEYS[5], ARGV[1])
if redis.call('GET', KEYS[8]) == ARGV[1] then redis.call('DEL', KEYS[8]) end
if redis.call('SCARD', KEYS[9]) == 0 then redis.call('RPUSH', KEYS[10], ARGV[2]) end
if ARGV[3] == '1' then
  redis.call('SREM', KEYS[12], ARGV[1])
  if redis.call('SCARD', KEYS[12]) == 0 and redis.call('EXISTS', KEYS[11]) == 0 then
    redis.call('RPUSH', KEYS[10], ARGV[4])
  end
end
return 1
"""


# KEYS: 1 the tenant's inputs (sha256 -> keep_until), 2 their sizes, 3 their total bytes.
# ARGV: 1 sha256, 2 size, 3 keep_until, 4 quota (0 = none).
_RESERVE_INPUT_LUA = """
local old = redis.call('ZSCORE', KEYS[1], ARGV[1])
local used = tonumber(redis.call('GET', KEYS[3]) or '0')
if old then
  if tonumber(ARGV[3]) > tonumber(old) then redis.call('ZADD', KEYS[1], ARGV[3], ARGV[1]) end
  return {1, used}
end
local quota = tonumber(ARGV[4])
if quota > 0 and used + tonumber(ARGV[2]) > quota then return {0, used} end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
return {1, redis.call('INCRBY', KEYS[3], ARGV[2])}
"""

# KEYS as _RESERVE_INPUT_LUA's. ARGV: 1 sha256, 2 now.
_FORGET_INPUT_LUA = """
local keep = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not keep or tonumber(keep) >= tonumber(ARGV[2]) then return -1 end
local size = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0')
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('DECRBY', KEYS[3], size)
return size
"""


_ACQUIRE_LEASE_LUA = """
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then return holder end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
local t = redis.call('TIME')
redis.call('SET', KEYS[2], t[1] .. '.' .. string.format('%06d', t[2]), 'EX', ARGV[3])
return false
"""

_RENEW_LEASE_LUA = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
local t = redis.call('TIME')
redis.call('SET', KEYS[2], t[1] .. '.' .. string.format('%06d', t[2]), 'EX', ARGV[3])
return 1
"""

_RELEASE_LEASE_LUA = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
return redis.call('DEL', KEYS[1])
"""


class RedisJobStore(JobStore):
    # A job's event stream: at most ~EVENTS_MAXLEN events (each message ≤ 500 characters: the
    # sandbox's events are checked and cut, workers/sandbox/events.py), expiring events_ttl_s
    # after the last one, so no job can grow Redis without bound.
    EVENTS_MAXLEN = 2_000
    EVENTS_TTL_S = 7 * 24 * 3600
    HEARTBEAT_KEEP_S = 7 * 24 * 3600

    def __init__(self, url: str, *, namespace: str = "fxport", retry_s: float = 0.0,
                 events_ttl_s: int | None = None) -> None:
        """`retry_s`: how long a command keeps retrying (backoff up to 1 s) while Redis is
        unreachable or still replaying its AOF. Workers ride out a broker restart this way;
        the API keeps it short and answers UNAVAILABLE instead (service/unavailable.py)."""
        self.events_ttl_s = int(events_ttl_s or self.EVENTS_TTL_S)
        import redis
        from redis.backoff import ExponentialWithJitterBackoff
        from redis.retry import Retry

        self._redis_mod = redis
        self.url = url
        self.ns = namespace
        retries = 0 if retry_s <= 0 else max(1, int(retry_s / 0.8))  # ≈ seconds at a 1 s cap, with the ramp
        # decode_responses=True: every reply is str, which redis-py's annotations (bytes | str) cannot say
        self.r: Any = redis.Redis.from_url(
            url, decode_responses=True, health_check_interval=30, socket_keepalive=True,
            retry_on_timeout=True, socket_connect_timeout=5,
            retry=Retry(ExponentialWithJitterBackoff(cap=1.0, base=0.1), retries,
                        supported_errors=(redis.ConnectionError, redis.TimeoutError, TimeoutError)),
        )
        self._create = self.r.register_script(_CREATE_LUA)
        self._acquire = self.r.register_script(_ACQUIRE_LEASE_LUA)
        self._renew = self.r.register_script(_RENEW_LEASE_LUA)
        self._release = self.r.register_script(_RELEASE_LEASE_LUA)
        self._remove = self.r.register_script(_REMOVE_LUA)
        self._reserve_input = self.r.register_script(_RESERVE_INPUT_LUA)
        self._forget_input = self.r.register_script(_FORGET_INPUT_LUA)

    def _job(self, job_id: str) -> str:
        return f"{self.ns}:job:{job_id}"

    # Outside the `{ns}:job:*` pattern that ids_in_states scans.
    def _lease(self, job_id: str) -> str:
        return f"{self.ns}:lease:{job_id}"

    def _heartbeat(self, job_id: str) -> str:
        return f"{self.ns}:heartbeat:{job_id}"

    def _running(self) -> str:
        return f"{self.ns}:running"

    def _events(self, job_id: str) -> str:
        return f"{self.ns}:job:{job_id}:events"

    def _tenant_jobs(self, tenant: str) -> str:
        return f"{self.ns}:tenant:{tenant}:jobs"

    def _in_flight(self, tenant: str) -> str:
        return f"{self.ns}:tenant:{tenant}:in-flight"

    def _idem(self, tenant: str, key: str) -> str:
        return f"{self.ns}:idem:{tenant}:{_idem_digest(key)}"

    def _shares(self, job_id: str) -> str:
        return f"{self.ns}:shares:{job_id}"

    def _deletions(self) -> str:
        return f"{self.ns}:artifact-deletions"

    def _inputs(self, tenant: str) -> list[str]:
        head = f"{self.ns}:tenant:{tenant}"
        return [f"{head}:inputs", f"{head}:input-sizes", f"{head}:input-bytes"]

    def create(self, record: JobRecord) -> tuple[JobRecord, bool]:
        rec = record.model_copy(update={"last_seq": 1})
        idem = rec.idempotency_key or ""
        source = rec.artifacts_of or ""
        job_id = self._create(
            keys=[self._job(rec.id), self._events(rec.id), self._tenant_jobs(rec.tenant),
                  self._idem(rec.tenant, idem) if idem else f"{self.ns}:noidem", self._in_flight(rec.tenant),
                  self._job(source) if source else f"{self.ns}:nosource",
                  self._shares(source) if source else f"{self.ns}:nosource"],
            args=[rec.id, rec.model_dump_json(), rec.state.value, idem,
                  event_for(rec, 1).model_dump_json(), self.EVENTS_MAXLEN,
                  "1" if rec.state in IN_FLIGHT_STATES else "0", self.events_ttl_s, "1" if source else "0"],
        )
        if job_id is None:
            raise SharedArtifactsGone(f"job {source} was removed")
        if job_id == rec.id:
            return rec, True
        existing = self.get(job_id)
        if existing is None:  # the key outlived its job; should not happen, but don't fail the submit
            self.r.delete(self._idem(rec.tenant, idem))
            return self.create(record)
        if not _same_request(existing, rec):
            raise IdempotencyConflict(existing)
        return existing, False

    def get(self, job_id: str) -> JobRecord | None:
        raw = self.r.hget(self._job(job_id), "record")
        return JobRecord.model_validate_json(raw) if raw else None

    def _raw_many(self, ids: list[str]) -> list[str | None]:
        with self.r.pipeline(transaction=False) as pipe:
            for job_id in ids:
                pipe.hget(self._job(job_id), "record")
            raws: list[str | None] = pipe.execute()
        return raws

    def find_idempotent(self, tenant: str, key: str) -> JobRecord | None:
        job_id = self.r.get(self._idem(tenant, key))
        return self.get(job_id) if job_id else None

    def transition(self, job_id: str, **changes: Any) -> tuple[JobRecord | None, bool]:
        key = self._job(job_id)
        with self.r.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(key)
                    raw = pipe.hget(key, "record")
                    if not raw:
                        pipe.unwatch()
                        return None, False
                    rec = JobRecord.model_validate_json(raw)
                    new = apply_update(rec, **changes)
                    if new is None:
                        pipe.unwatch()
                        return rec, False
                    new.last_seq = rec.last_seq + 1
                    pipe.multi()
                    pipe.hset(key, mapping={"record": new.model_dump_json(), "state": new.state.value,
                                            "seq": new.last_seq})
                    event = event_for(new, new.last_seq, changes.get("staged"))
                    pipe.xadd(self._events(job_id), {"e": event.model_dump_json()},
                              id=f"0-{new.last_seq}", maxlen=self.EVENTS_MAXLEN, approximate=True)
                    pipe.expire(self._events(job_id), self.events_ttl_s)
                    if new.state is JobState.RUNNING:
                        pipe.sadd(self._running(), job_id)
                    elif rec.state is JobState.RUNNING:
                        pipe.srem(self._running(), job_id)
                    # Added on every in-flight write, not only on entering: a job created before
                    # the index existed is counted from its next update on.
                    if new.state in IN_FLIGHT_STATES:
                        pipe.sadd(self._in_flight(new.tenant), job_id)
                    else:
                        pipe.srem(self._in_flight(new.tenant), job_id)
                    pipe.execute()
                    return new, True
                except self._redis_mod.WatchError:
                    continue

    def read_events(self, job_id: str, after_seq: int = 0, timeout: float = 0.0) -> list[JobEvent]:
        stream = self._events(job_id)
        if timeout > 0:
            resp = self.r.xread({stream: f"0-{int(after_seq)}"}, count=500, block=max(1, int(timeout * 1000)))
            entries = resp[0][1] if resp else []
        else:
            entries = self.r.xrange(stream, min=f"(0-{int(after_seq)}", count=500)
        return [JobEvent.model_validate_json(fields["e"]) for _, fields in entries]

    def _ids_desc(self, tenant: str, before: str | None, limit: int) -> list[str]:
        hi = f"({before}" if before else "+"
        ids: list[str] = self.r.zrevrangebylex(self._tenant_jobs(tenant), hi, "-", start=0, num=limit)
        return ids

    def ids_in_states(self, states: Iterable[JobState]) -> list[str]:
        wanted = {s.value for s in states}
        out = []
        for key in self.r.scan_iter(match=f"{self.ns}:job:*", count=500):
            if key.endswith(":events"):
                continue
            if self.r.hget(key, "state") in wanted:
                out.append(key.rsplit(":", 1)[1])
        return out

    def running_ids(self) -> list[str]:
        # An index kept by `transition`, so a sweep does not scan every job ever run.
        return sorted(self.r.smembers(self._running()))

    def count_in_flight(self, tenant: str, *, exact: bool = False) -> int:
        key = self._in_flight(tenant)
        if not exact:
            return int(self.r.scard(key))
        ids = sorted(self.r.smembers(key))
        with self.r.pipeline(transaction=False) as pipe:
            for job_id in ids:
                pipe.hget(self._job(job_id), "state")
            states = pipe.execute()
        wanted = {s.value for s in IN_FLIGHT_STATES}
        stale = [job_id for job_id, state in zip(ids, states) if state not in wanted]
        for job_id in stale:  # only if it is still stale: a transition may have re-added it meanwhile
            with self.r.pipeline() as pipe:
                try:
                    pipe.watch(self._job(job_id))
                    if pipe.hget(self._job(job_id), "state") not in wanted:
                        pipe.multi()
                        pipe.srem(key, job_id)
                        pipe.execute()
                except self._redis_mod.WatchError:
                    pass
        return len(ids) - len(stale)

    def tenants(self) -> list[str]:
        head, tail = f"{self.ns}:tenant:", ":jobs"
        return sorted({key[len(head):-len(tail)] for key in self.r.scan_iter(match=f"{head}*{tail}", count=500)})

    def ids_asc(self, tenant: str, after: str | None, limit: int) -> list[str]:
        lo = f"({after}" if after else "-"
        ids: list[str] = self.r.zrangebylex(self._tenant_jobs(tenant), lo, "+", start=0, num=limit)
        return ids

    def count_jobs(self, tenant: str) -> int:
        return int(self.r.zcard(self._tenant_jobs(tenant)))

    def remove(self, job_id: str, tenant: str | None = None) -> bool | None:
        rec = self.get(job_id)
        if rec is None:
            if tenant is not None:
                self.r.zrem(self._tenant_jobs(tenant), job_id)
            return None
        idem = rec.idempotency_key or ""
        source = _shared_source(rec)
        done = self._remove(
            keys=[self._job(job_id), self._events(job_id), self._tenant_jobs(rec.tenant),
                  self._in_flight(rec.tenant), self._running(), self._lease(job_id), self._heartbeat(job_id),
                  self._idem(rec.tenant, idem) if idem else f"{self.ns}:noidem", self._shares(job_id),
                  self._deletions(), self._job(source[0]) if source else f"{self.ns}:nosource",
                  self._shares(source[0]) if source else f"{self.ns}:nosource"],
            args=[job_id, job_prefix(rec.tenant, job_id), "1" if source else "0", source[1] if source else ""],
        )
        return {1: True, -1: False}.get(int(done))

    def pending_deletions(self, limit: int = 100) -> list[str]:
        prefixes: list[str] = self.r.lrange(self._deletions(), 0, max(1, limit) - 1)
        return prefixes

    def deletion_done(self, prefix: str) -> None:
        self.r.lrem(self._deletions(), 0, prefix)

    def reserve_input(self, tenant: str, sha256: str, size: int, keep_until: float, quota: int) -> InputAdmission:
        admitted, used = self._reserve_input(keys=self._inputs(tenant),
                                             args=[sha256, int(size), repr(float(keep_until)), int(quota)])
        return InputAdmission(bool(admitted), int(used))

    def input_bytes(self, tenant: str) -> int:
        return int(self.r.get(self._inputs(tenant)[2]) or 0)

    def input_tenants(self) -> list[str]:
        head, tail = f"{self.ns}:tenant:", ":inputs"
        return sorted({key[len(head):-len(tail)] for key in self.r.scan_iter(match=f"{head}*{tail}", count=500)})

    def inputs_due(self, tenant: str, now: float, limit: int) -> list[str]:
        due: list[str] = self.r.zrangebyscore(self._inputs(tenant)[0], "-inf", f"({now!r}", start=0, num=limit)
        return due

    def forget_input(self, tenant: str, sha256: str, now: float) -> int | None:
        size = int(self._forget_input(keys=self._inputs(tenant), args=[sha256, repr(float(now))]))
        return None if size < 0 else size

    def _in_flight_ids(self, tenant: str) -> list[str]:
        return sorted(self.r.smembers(self._in_flight(tenant)))

    def acquire_lease(self, job_id: str, owner: str, ttl_s: float) -> str | None:
        holder = self._acquire(keys=[self._lease(job_id), self._heartbeat(job_id)],
                               args=[owner, max(1, int(ttl_s * 1000)), self.HEARTBEAT_KEEP_S])
        return holder or None

    def renew_lease(self, job_id: str, owner: str, ttl_s: float) -> bool:
        return bool(self._renew(keys=[self._lease(job_id), self._heartbeat(job_id)],
                                args=[owner, max(1, int(ttl_s * 1000)), self.HEARTBEAT_KEEP_S]))

    def release_lease(self, job_id: str, owner: str) -> bool:
        return bool(self._release(keys=[self._lease(job_id)], args=[owner]))

    def lease_holder(self, job_id: str) -> str | None:
        holder: str | None = self.r.get(self._lease(job_id))
        return holder

    def last_heartbeat(self, job_id: str) -> float | None:
        raw = self.r.get(self._heartbeat(job_id))
        return float(raw) if raw else None

    def clock(self) -> float:
        sec: int
        usec: int
        sec, usec = self.r.time()
        return sec + usec / 1e6

    def close(self) -> None:
        self.r.close()


# ---------------------------------------------------------------------------------------
# SQLite (embedded)
# ---------------------------------------------------------------------------------------

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
  id TEXT PRIMARY KEY, tenant TEXT NOT NULL, state TEXT NOT NULL, record TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS jobs_tenant ON jobs (tenant, id);
CREATE INDEX IF NOT EXISTS jobs_tenant_state ON jobs (tenant, state);
CREATE TABLE IF NOT EXISTS events (
  job_id TEXT NOT NULL, seq INTEGER NOT NULL, data TEXT NOT NULL, PRIMARY KEY (job_id, seq));
CREATE TABLE IF NOT EXISTS idempotency (
  tenant TEXT NOT NULL, key_sha256 TEXT NOT NULL, job_id TEXT NOT NULL, PRIMARY KEY (tenant, key_sha256));
CREATE TABLE IF NOT EXISTS leases (
  job_id TEXT PRIMARY KEY, owner TEXT NOT NULL, expires_at REAL NOT NULL, heartbeat_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS shares (
  source TEXT NOT NULL, job_id TEXT NOT NULL, PRIMARY KEY (source, job_id));
CREATE TABLE IF NOT EXISTS artifact_deletions (
  seq INTEGER PRIMARY KEY AUTOINCREMENT, prefix TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS inputs (
  tenant TEXT NOT NULL, sha256 TEXT NOT NULL, bytes INTEGER NOT NULL, keep_until REAL NOT NULL,
  PRIMARY KEY (tenant, sha256));
CREATE INDEX IF NOT EXISTS inputs_due ON inputs (tenant, keep_until);
"""


class SqliteJobStore(JobStore):
    POLL_S = 0.2  # how often a waiter re-reads, for writers in other processes
    EVENTS_MAXLEN = 2_000  # events kept per job (the oldest go first), as in Redis

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=10)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)

    def _tx(self) -> _SqliteTx:
        return _SqliteTx(self)

    def create(self, record: JobRecord) -> tuple[JobRecord, bool]:
        rec = record.model_copy(update={"last_seq": 1})
        with self._tx() as db:
            if rec.idempotency_key:
                row = db.execute(
                    "SELECT job_id FROM idempotency WHERE tenant=? AND key_sha256=?",
                    (rec.tenant, _idem_digest(rec.idempotency_key)),
                ).fetchone()
                if row:
                    existing = self._get(row[0])
                    if existing is not None:
                        if not _same_request(existing, rec):
                            raise IdempotencyConflict(existing)
                        return existing, False
                db.execute(
                    "INSERT OR REPLACE INTO idempotency VALUES (?,?,?)",
                    (rec.tenant, _idem_digest(rec.idempotency_key), rec.id),
                )
            if rec.artifacts_of:
                if not db.execute("SELECT 1 FROM jobs WHERE id=?", (rec.artifacts_of,)).fetchone():
                    raise SharedArtifactsGone(f"job {rec.artifacts_of} was removed")
                db.execute("INSERT OR IGNORE INTO shares VALUES (?,?)", (rec.artifacts_of, rec.id))
            db.execute("INSERT INTO jobs VALUES (?,?,?,?)",
                       (rec.id, rec.tenant, rec.state.value, rec.model_dump_json()))
            db.execute("INSERT INTO events VALUES (?,?,?)", (rec.id, 1, event_for(rec, 1).model_dump_json()))
        return rec, True

    def _get(self, job_id: str) -> JobRecord | None:
        row = self._db.execute("SELECT record FROM jobs WHERE id=?", (job_id,)).fetchone()
        return JobRecord.model_validate_json(row[0]) if row else None

    def get(self, job_id: str) -> JobRecord | None:
        with self._lock:
            return self._get(job_id)

    def _raw_many(self, ids: list[str]) -> list[str | None]:
        with self._lock:
            rows = dict(self._db.execute(f"SELECT id, record FROM jobs WHERE id IN ({','.join('?' * len(ids))})",
                                         ids).fetchall()) if ids else {}
        return [rows.get(job_id) for job_id in ids]

    def find_idempotent(self, tenant: str, key: str) -> JobRecord | None:
        with self._lock:
            row = self._db.execute(
                "SELECT job_id FROM idempotency WHERE tenant=? AND key_sha256=?", (tenant, _idem_digest(key))
            ).fetchone()
            return self._get(row[0]) if row else None

    def transition(self, job_id: str, **changes: Any) -> tuple[JobRecord | None, bool]:
        with self._tx() as db:
            rec = self._get(job_id)
            if rec is None:
                return None, False
            new = apply_update(rec, **changes)
            if new is None:
                return rec, False
            new.last_seq = rec.last_seq + 1
            db.execute("UPDATE jobs SET state=?, record=? WHERE id=?", (new.state.value, new.model_dump_json(), job_id))
            event = event_for(new, new.last_seq, changes.get("staged"))
            db.execute("INSERT INTO events VALUES (?,?,?)", (job_id, new.last_seq, event.model_dump_json()))
            if new.last_seq > self.EVENTS_MAXLEN and new.last_seq % 100 == 0:  # trimmed now and then, as Redis does
                db.execute("DELETE FROM events WHERE job_id=? AND seq<=?", (job_id, new.last_seq - self.EVENTS_MAXLEN))
        return new, True

    def read_events(self, job_id: str, after_seq: int = 0, timeout: float = 0.0) -> list[JobEvent]:
        deadline = time.monotonic() + max(0.0, timeout)
        with self._changed:
            while True:
                rows = self._db.execute(
                    "SELECT data FROM events WHERE job_id=? AND seq>? ORDER BY seq LIMIT 500", (job_id, int(after_seq))
                ).fetchall()
                left = deadline - time.monotonic()
                if rows or left <= 0:
                    return [JobEvent.model_validate_json(r[0]) for r in rows]
                self._changed.wait(min(left, self.POLL_S))

    def _ids_desc(self, tenant: str, before: str | None, limit: int) -> list[str]:
        with self._lock:
            rows = self._db.execute(
                "SELECT id FROM jobs WHERE tenant=? AND id<? ORDER BY id DESC LIMIT ?",
                (tenant, before or "~", limit),
            ).fetchall()
        return [r[0] for r in rows]

    def ids_in_states(self, states: Iterable[JobState]) -> list[str]:
        wanted = [s.value for s in states]
        with self._lock:
            rows = self._db.execute(
                f"SELECT id FROM jobs WHERE state IN ({','.join('?' * len(wanted))}) ORDER BY id", wanted
            ).fetchall()
        return [r[0] for r in rows]

    def count_in_flight(self, tenant: str, *, exact: bool = False) -> int:
        wanted = sorted(s.value for s in IN_FLIGHT_STATES)
        with self._lock:
            row = self._db.execute(
                f"SELECT COUNT(*) FROM jobs WHERE tenant=? AND state IN ({','.join('?' * len(wanted))})",
                (tenant, *wanted),
            ).fetchone()
        return int(row[0])

    def tenants(self) -> list[str]:
        with self._lock:
            return [r[0] for r in self._db.execute("SELECT DISTINCT tenant FROM jobs ORDER BY tenant").fetchall()]

    def ids_asc(self, tenant: str, after: str | None, limit: int) -> list[str]:
        with self._lock:
            rows = self._db.execute("SELECT id FROM jobs WHERE tenant=? AND id>? ORDER BY id LIMIT ?",
                                    (tenant, after or "", limit)).fetchall()
        return [r[0] for r in rows]

    def count_jobs(self, tenant: str) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM jobs WHERE tenant=?", (tenant,)).fetchone()[0])

    def remove(self, job_id: str, tenant: str | None = None) -> bool | None:
        with self._tx() as db:  # the record is the index here: none is ever left without it
            rec = self._get(job_id)
            if rec is None:
                return None
            if not rec.terminal:
                return False
            db.execute("DELETE FROM jobs WHERE id=?", (job_id,))
            db.execute("DELETE FROM events WHERE job_id=?", (job_id,))
            db.execute("DELETE FROM leases WHERE job_id=?", (job_id,))
            db.execute("DELETE FROM idempotency WHERE job_id=?", (job_id,))
            if not db.execute("SELECT 1 FROM shares WHERE source=?", (job_id,)).fetchone():
                db.execute("INSERT INTO artifact_deletions (prefix) VALUES (?)", (job_prefix(rec.tenant, job_id),))
            source = _shared_source(rec)
            if source:
                db.execute("DELETE FROM shares WHERE source=? AND job_id=?", (source[0], job_id))
                if not db.execute("SELECT 1 FROM shares WHERE source=?", (source[0],)).fetchone() \
                        and not db.execute("SELECT 1 FROM jobs WHERE id=?", (source[0],)).fetchone():
                    db.execute("INSERT INTO artifact_deletions (prefix) VALUES (?)", (source[1],))
        return True

    def pending_deletions(self, limit: int = 100) -> list[str]:
        with self._lock:
            rows = self._db.execute("SELECT prefix FROM artifact_deletions ORDER BY seq LIMIT ?",
                                    (max(1, limit),)).fetchall()
        return [r[0] for r in rows]

    def deletion_done(self, prefix: str) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM artifact_deletions WHERE prefix=?", (prefix,))

    def reserve_input(self, tenant: str, sha256: str, size: int, keep_until: float, quota: int) -> InputAdmission:
        with self._tx() as db:
            used = int(db.execute("SELECT COALESCE(SUM(bytes), 0) FROM inputs WHERE tenant=?", (tenant,)).fetchone()[0])
            if db.execute("SELECT 1 FROM inputs WHERE tenant=? AND sha256=?", (tenant, sha256)).fetchone():
                db.execute("UPDATE inputs SET keep_until=MAX(keep_until, ?) WHERE tenant=? AND sha256=?",
                           (keep_until, tenant, sha256))
                return InputAdmission(True, used)
            if quota > 0 and used + size > quota:
                return InputAdmission(False, used)
            db.execute("INSERT INTO inputs VALUES (?,?,?,?)", (tenant, sha256, int(size), keep_until))
        return InputAdmission(True, used + size)

    def input_bytes(self, tenant: str) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COALESCE(SUM(bytes), 0) FROM inputs WHERE tenant=?",
                                        (tenant,)).fetchone()[0])

    def input_tenants(self) -> list[str]:
        with self._lock:
            return [r[0] for r in self._db.execute("SELECT DISTINCT tenant FROM inputs ORDER BY tenant").fetchall()]

    def inputs_due(self, tenant: str, now: float, limit: int) -> list[str]:
        with self._lock:
            rows = self._db.execute("SELECT sha256 FROM inputs WHERE tenant=? AND keep_until<? ORDER BY keep_until "
                                    "LIMIT ?", (tenant, now, max(1, limit))).fetchall()
        return [r[0] for r in rows]

    def forget_input(self, tenant: str, sha256: str, now: float) -> int | None:
        with self._tx() as db:
            row = db.execute("SELECT bytes FROM inputs WHERE tenant=? AND sha256=? AND keep_until<?",
                             (tenant, sha256, now)).fetchone()
            if row is None:
                return None
            db.execute("DELETE FROM inputs WHERE tenant=? AND sha256=?", (tenant, sha256))
            return int(row[0])

    def _in_flight_ids(self, tenant: str) -> list[str]:
        wanted = sorted(s.value for s in IN_FLIGHT_STATES)
        with self._lock:
            rows = self._db.execute(
                f"SELECT id FROM jobs WHERE tenant=? AND state IN ({','.join('?' * len(wanted))}) ORDER BY id",
                (tenant, *wanted)).fetchall()
        return [r[0] for r in rows]

    def acquire_lease(self, job_id: str, owner: str, ttl_s: float) -> str | None:
        now = time.time()
        with self._tx() as db:
            row = db.execute("SELECT owner, expires_at FROM leases WHERE job_id=?", (job_id,)).fetchone()
            if row and row[0] != owner and row[1] > now:
                holder: str = row[0]
                return holder
            db.execute("INSERT OR REPLACE INTO leases VALUES (?,?,?,?)", (job_id, owner, now + ttl_s, now))
        return None

    def renew_lease(self, job_id: str, owner: str, ttl_s: float) -> bool:
        now = time.time()
        with self._tx() as db:
            cur = db.execute("UPDATE leases SET expires_at=?, heartbeat_at=? WHERE job_id=? AND owner=? "
                             "AND expires_at>?", (now + ttl_s, now, job_id, owner, now))
            return cur.rowcount == 1

    def release_lease(self, job_id: str, owner: str) -> bool:
        with self._tx() as db:
            # The heartbeat stays (as an expired row) for the sweeper.
            cur = db.execute("UPDATE leases SET expires_at=0 WHERE job_id=? AND owner=?", (job_id, owner))
            return cur.rowcount == 1

    def lease_holder(self, job_id: str) -> str | None:
        with self._lock:
            row = self._db.execute("SELECT owner FROM leases WHERE job_id=? AND expires_at>?",
                                   (job_id, time.time())).fetchone()
        return row[0] if row else None

    def last_heartbeat(self, job_id: str) -> float | None:
        with self._lock:
            row = self._db.execute("SELECT heartbeat_at FROM leases WHERE job_id=?", (job_id,)).fetchone()
        return row[0] if row else None

    def close(self) -> None:
        with self._lock:
            self._db.close()


class _SqliteTx:
    """BEGIN IMMEDIATE … COMMIT under the store's lock; wakes event waiters on commit."""

    def __init__(self, store: SqliteJobStore) -> None:
        self.store = store

    def __enter__(self) -> sqlite3.Connection:
        self.store._lock.acquire()
        self.store._db.execute("BEGIN IMMEDIATE")
        return self.store._db

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            self.store._db.execute("ROLLBACK" if exc_type else "COMMIT")
            if exc_type is None:
                self.store._changed.notify_all()
        finally:
            self.store._lock.release()


# ---------------------------------------------------------------------------------------
# Orphans
# ---------------------------------------------------------------------------------------

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
                error = JobErrorInfo(stage=rec.stage, code="worker_lost",
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


def open_job_store(url: str | None, home: Path, *, retry_s: float = 0.0, events_ttl_s: int | None = None) -> JobStore:
    """`redis://…` → RedisJobStore; None → SQLite under `home`; `sqlite:///path` → that file.
    `retry_s`: RedisJobStore's retry budget for an unreachable Redis; `events_ttl_s`: how long
    its event streams outlive their last event."""
    if url and url.startswith(("redis://", "rediss://", "unix://")):
        return RedisJobStore(url, retry_s=retry_s, events_ttl_s=events_ttl_s)
    if url and url.startswith("sqlite:///"):
        return SqliteJobStore(Path(url[len("sqlite:///") - 1 :]))
    if url:
        raise ValueError(f"job store URL {url!r}: use redis://HOST:PORT/DB or sqlite:///path")
    return SqliteJobStore(Path(home) / "jobs.db")
