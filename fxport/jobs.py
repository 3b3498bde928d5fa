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
from enum import Enum
from pathlib import Path
from typing import Any, Iterable

from pydantic import BaseModel, Field

from fxport.storage import JOB_ID_RE


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
STAGES = ("load", "capture", "passes", "quantize", "export", "verify", "tensorrt", "upload")


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
    stage: str | None = None
    code: str = "internal"
    message: str
    detail: str | None = None


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

    @property
    def terminal(self) -> bool:
        return self.state.terminal


class IdempotencyConflict(Exception):
    """The idempotency key names an earlier job submitted with a different model or spec."""

    def __init__(self, existing: JobRecord) -> None:
        super().__init__(
            f"idempotency key {existing.idempotency_key!r} was used for job {existing.id} "
            "with a different model or spec; use a new key"
        )
        self.existing = existing


_CROCKFORD = "0123456789abcdefghjkmnpqrstvwxyz"


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
    worker: str | None = None,
    new_attempt: bool = False,
    task_id: str | None = None,
    cache_hit: bool | None = None,
    now: float | None = None,
) -> JobRecord | None:
    """The job state machine. Returns the updated copy, or None if the update is refused.

    QUEUED → RUNNING → SUCCEEDED | FAILED | CANCELLED; QUEUED → CANCELLED | FAILED;
    RUNNING → QUEUED (requeued after a restart); RUNNING → RUNNING (a redelivered task).
    A terminal record never changes again: a replayed or late update is refused, which is
    what makes at-least-once task delivery harmless.
    """
    if record.terminal:
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


def event_for(rec: JobRecord, seq: int) -> JobEvent:
    return JobEvent(
        seq=seq, job_id=rec.id, time=rec.updated_at, state=rec.state, stage=rec.stage,
        progress=rec.progress, message=rec.message,
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
    def ids_in_states(self, states: Iterable[JobState]) -> list[str]:
        """Every job id (all tenants) in one of `states`; for recovery after a restart."""

    def close(self) -> None:
        pass

    def append_event(self, job_id: str, *, message: str) -> JobEvent | None:
        """A message-only event (e.g. a warning) on a job that is still running."""
        rec, changed = self.transition(job_id, message=message)
        return event_for(rec, rec.last_seq) if rec is not None and changed else None

    def list(
        self,
        tenant: str,
        *,
        states: Iterable[JobState] | None = None,
        labels: dict[str, str] | None = None,
        page_size: int = 50,
        page_token: str | None = None,
    ) -> tuple[list[JobRecord], str | None]:
        """Newest first. Returns (page, next_page_token or None)."""
        page_size = max(1, min(int(page_size or 50), self.MAX_PAGE))
        want_states = set(states or ())
        want_labels = dict(labels or {})
        before = decode_page_token(page_token)
        out: list[JobRecord] = []
        batch = max(2 * page_size, 100)
        while True:
            ids = self._ids_desc(tenant, before, batch)
            for job_id in ids:
                before = job_id
                rec = self.get(job_id)
                if rec is None:
                    continue
                if want_states and rec.state not in want_states:
                    continue
                if any(rec.labels.get(k) != v for k, v in want_labels.items()):
                    continue
                out.append(rec)
                if len(out) == page_size:
                    more = bool(self._ids_desc(tenant, job_id, 1))
                    return out, (_encode_token(job_id) if more else None)
            if len(ids) < batch:
                return out, None


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
  redis.call('SET', KEYS[4], ARGV[1])
end
redis.call('HSET', KEYS[1], 'record', ARGV[2], 'state', ARGV[3], 'seq', 1)
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[6], '0-1', 'e', ARGV[5])
redis.call('ZADD', KEYS[3], 0, ARGV[1])
return ARGV[1]
"""


class RedisJobStore(JobStore):
    EVENTS_MAXLEN = 10_000

    def __init__(self, url: str, *, namespace: str = "fxport") -> None:
        import redis

        self._redis_mod = redis
        self.url = url
        self.ns = namespace
        self.r = redis.Redis.from_url(
            url, decode_responses=True, health_check_interval=30, socket_keepalive=True,
            retry_on_timeout=True,
        )
        self._create = self.r.register_script(_CREATE_LUA)

    def _job(self, job_id: str) -> str:
        return f"{self.ns}:job:{job_id}"

    def _events(self, job_id: str) -> str:
        return f"{self.ns}:job:{job_id}:events"

    def _tenant_jobs(self, tenant: str) -> str:
        return f"{self.ns}:tenant:{tenant}:jobs"

    def _idem(self, tenant: str, key: str) -> str:
        return f"{self.ns}:idem:{tenant}:{_idem_digest(key)}"

    def create(self, record: JobRecord) -> tuple[JobRecord, bool]:
        rec = record.model_copy(update={"last_seq": 1})
        idem = rec.idempotency_key or ""
        job_id = self._create(
            keys=[self._job(rec.id), self._events(rec.id), self._tenant_jobs(rec.tenant),
                  self._idem(rec.tenant, idem) if idem else f"{self.ns}:noidem"],
            args=[rec.id, rec.model_dump_json(), rec.state.value, idem,
                  event_for(rec, 1).model_dump_json(), self.EVENTS_MAXLEN],
        )
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
                    pipe.xadd(self._events(job_id), {"e": event_for(new, new.last_seq).model_dump_json()},
                              id=f"0-{new.last_seq}", maxlen=self.EVENTS_MAXLEN, approximate=True)
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
        return self.r.zrevrangebylex(self._tenant_jobs(tenant), hi, "-", start=0, num=limit)

    def ids_in_states(self, states: Iterable[JobState]) -> list[str]:
        wanted = {s.value for s in states}
        out = []
        for key in self.r.scan_iter(match=f"{self.ns}:job:*", count=500):
            if key.endswith(":events"):
                continue
            if self.r.hget(key, "state") in wanted:
                out.append(key.rsplit(":", 1)[1])
        return out

    def close(self) -> None:
        self.r.close()


# ---------------------------------------------------------------------------------------
# SQLite (embedded)
# ---------------------------------------------------------------------------------------

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
  id TEXT PRIMARY KEY, tenant TEXT NOT NULL, state TEXT NOT NULL, record TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS jobs_tenant ON jobs (tenant, id);
CREATE TABLE IF NOT EXISTS events (
  job_id TEXT NOT NULL, seq INTEGER NOT NULL, data TEXT NOT NULL, PRIMARY KEY (job_id, seq));
CREATE TABLE IF NOT EXISTS idempotency (
  tenant TEXT NOT NULL, key_sha256 TEXT NOT NULL, job_id TEXT NOT NULL, PRIMARY KEY (tenant, key_sha256));
"""


class SqliteJobStore(JobStore):
    POLL_S = 0.2  # how often a waiter re-reads, for writers in other processes

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=10)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)

    def _tx(self) -> "_SqliteTx":
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
            db.execute("INSERT INTO jobs VALUES (?,?,?,?)", (rec.id, rec.tenant, rec.state.value, rec.model_dump_json()))
            db.execute("INSERT INTO events VALUES (?,?,?)", (rec.id, 1, event_for(rec, 1).model_dump_json()))
        return rec, True

    def _get(self, job_id: str) -> JobRecord | None:
        row = self._db.execute("SELECT record FROM jobs WHERE id=?", (job_id,)).fetchone()
        return JobRecord.model_validate_json(row[0]) if row else None

    def get(self, job_id: str) -> JobRecord | None:
        with self._lock:
            return self._get(job_id)

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
            db.execute("INSERT INTO events VALUES (?,?,?)", (job_id, new.last_seq, event_for(new, new.last_seq).model_dump_json()))
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


def open_job_store(url: str | None, home: Path) -> JobStore:
    """`redis://…` → RedisJobStore; None → SQLite under `home`; `sqlite:///path` → that file."""
    if url and url.startswith(("redis://", "rediss://", "unix://")):
        return RedisJobStore(url)
    if url and url.startswith("sqlite:///"):
        return SqliteJobStore(Path(url[len("sqlite:///") - 1 :]))
    if url:
        raise ValueError(f"job store URL {url!r}: use redis://HOST:PORT/DB or sqlite:///path")
    return SqliteJobStore(Path(home) / "jobs.db")
