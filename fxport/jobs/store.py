"""The job store's interface: where job records and their events live, whatever the backend.

Create (idempotent), get, list, guarded transitions, events, leases, retention and the input
ledger. Two backends implement it: `RedisJobStore` (distributed, fxport/jobs/redis_store.py)
and `SqliteJobStore` (embedded, fxport/jobs/sqlite_store.py); `open_job_store`
(fxport/jobs/backends.py) picks one from a URL. Also here: the helpers both backends share.
"""

from __future__ import annotations

import hashlib
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import Any

from fxport.jobs.records import (
    InputAdmission,
    JobEvent,
    JobRecord,
    JobState,
    decode_page_token,
    encode_page_token,
)
from fxport.storage.keys import job_prefix


def idempotency_digest(key: str) -> str:
    """How a store keeps an idempotency key: its sha256 (a key may be any length)."""
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
        return [JobRecord.from_json(raw) if raw and might_match(raw) else None
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
            rec = JobRecord.from_json(raw)
            if not rec.terminal:
                in_use.update(ref.sha256 for ref in (rec.model, rec.calibration) if ref is not None)
        return in_use

    # -- job leases (docs/architecture.md): at most one live worker runs a job ---------------
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
                    return out, (encode_page_token(job_id) if more else None)
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


def shared_source(rec: JobRecord) -> tuple[str, str] | None:
    """(source job id, its artifact prefix) for a record that shares another job's artifacts."""
    if not rec.artifacts_of or not rec.artifacts:
        return None
    tenant = rec.artifacts[0].key.split("/", 1)[0]
    return rec.artifacts_of, job_prefix(tenant, rec.artifacts_of)


def same_request(a: JobRecord, b: JobRecord) -> bool:
    return (
        a.model.sha256 == b.model.sha256
        and a.spec_digest == b.spec_digest
        and (a.calibration.sha256 if a.calibration else None) == (b.calibration.sha256 if b.calibration else None)
    )
