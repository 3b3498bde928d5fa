"""The embedded job store: one SQLite file under $FXPORT_HOME.

Chosen over an in-process dict so that job history and artifacts survive a restart of
`fxport serve` (`fxport jobs list/download` still work) and jobs interrupted by a restart can
be re-run. Every change is one `BEGIN IMMEDIATE` transaction under the store's lock. Waiters
in the same process are woken by a condition variable; other processes fall back to polling.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fxport.jobs.records import (
    IN_FLIGHT_STATES,
    IdempotencyConflict,
    InputAdmission,
    JobEvent,
    JobRecord,
    JobState,
    SharedArtifactsGone,
)
from fxport.jobs.store import JobStore, idempotency_digest, same_request, shared_source
from fxport.jobs.transitions import apply_update, event_for
from fxport.storage.keys import job_prefix

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
                    (rec.tenant, idempotency_digest(rec.idempotency_key)),
                ).fetchone()
                if row:
                    existing = self._get(row[0])
                    if existing is not None:
                        if not same_request(existing, rec):
                            raise IdempotencyConflict(existing)
                        return existing, False
                db.execute(
                    "INSERT OR REPLACE INTO idempotency VALUES (?,?,?)",
                    (rec.tenant, idempotency_digest(rec.idempotency_key), rec.id),
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
        return JobRecord.from_json(row[0]) if row else None

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
                "SELECT job_id FROM idempotency WHERE tenant=? AND key_sha256=?", (tenant, idempotency_digest(key))
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
            source = shared_source(rec)
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
