"""Retention: finished jobs are removed, with their artifacts, so the job store stays bounded.

Without it every job record stayed in the job store for good. On the distributed stack that
store is Redis, which holds everything in memory: normal use grows it without end, and one
tenant submitting and cancelling in a loop fills it, which stops every tenant's jobs. (Measured
on a 2-core Intel Xeon VM: one client, 4 threads, 38 submit-and-cancel rounds a second, each
leaving 26 KB in Redis with the largest labels a spec may carry, about 7 KB without: 1 MB a
second.)

A finished job (SUCCEEDED, FAILED or CANCELLED) is removed when either holds:
- it finished more than `retention_s` ago (FXPORT_JOB_RETENTION_S; 0 = no age limit);
- its tenant has more than `keep_per_tenant` job records (FXPORT_MAX_FINISHED_JOBS_PER_TENANT;
  0 = no count limit) and it is among the oldest finished ones: the newest are kept.
QUEUED and RUNNING jobs are never removed; FXPORT_MAX_JOBS_IN_FLIGHT bounds those.

Removing a job deletes its record, events, idempotency key and index entries in one atomic
step of the store, which queues its artifacts' prefix for deletion in the same step unless a
cache hit still shares them (JobStore.remove). The sweep then deletes the queued prefixes from
the object store, and only then drops them from the queue, so a sweep cut short deletes them on
the next round. The cache entry of a removed job is left: its proof check fails on the next
lookup, which drops it (fxport/cache.py).

Inputs (models and calibration files under `{tenant}/inputs/`) are counted in the job store's
input ledger (JobStore.reserve_input) when a submit or a presigned upload first names them,
against the tenant's quota (FXPORT_MAX_INPUT_BYTES_PER_TENANT). Each entry says until when the
input is kept: a presigned upload's until its URL expires (plus an hour to finish the PUT), a
job's input for FXPORT_INPUT_RETENTION_S after the job was submitted. Past that, an input that
no QUEUED or RUNNING job names is deleted (`sweep_inputs`): an upload whose submit never came,
or a model no job has used for the retention time. Finished jobs do not keep their inputs:
nothing reads a finished job's inputs, and a resubmit sends the bytes again (or is answered
from the result cache, which needs only the digests).

One sweep at a time runs across API replicas (a store lease). Each round walks every tenant's
jobs oldest first and stops at the first job young enough to keep, once the tenant is within its
count: job ids sort by creation time and a job finishes after it is created, so no later job can
be due.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from fxport.jobs import JobStore, job_id_time
from fxport.metrics import METRICS
from fxport.periodic import PeriodicTask
from fxport.storage import ArtifactStore, StorageError, input_key

log = logging.getLogger(__name__)

SWEEPER_LEASE = "retention-sweeper"
PAGE = 200


@dataclass(frozen=True)
class RetentionPolicy:
    retention_s: float  # 0 = no age limit
    keep_per_tenant: int  # 0 = no count limit

    @property
    def active(self) -> bool:
        return bool(self.retention_s or self.keep_per_tenant)

    def describe(self) -> str:
        """For users: what is kept, naming the settings."""
        parts = []
        if self.retention_s:
            parts.append(f"{span_text(self.retention_s)} after they end (FXPORT_JOB_RETENTION_S)")
        if self.keep_per_tenant:
            parts.append(f"at most the newest {self.keep_per_tenant} per tenant (FXPORT_MAX_FINISHED_JOBS_PER_TENANT)")
        return "finished jobs are kept " + " and ".join(parts) if parts else "finished jobs are kept for good"


def span_text(seconds: float) -> str:
    if seconds >= 86400 and seconds % 86400 == 0:
        return f"{int(seconds // 86400)} days"
    if seconds >= 3600 and seconds % 3600 == 0:
        return f"{int(seconds // 3600)} h"
    return f"{seconds:g} s"


@dataclass
class RetentionResult:
    removed_age: list[str] = field(default_factory=list)
    removed_count: list[str] = field(default_factory=list)
    deleted_prefixes: list[str] = field(default_factory=list)
    failed_prefixes: list[str] = field(default_factory=list)
    deleted_inputs: list[str] = field(default_factory=list)  # their keys

    @property
    def removed(self) -> list[str]:
        return self.removed_age + self.removed_count


def sweep_finished(jobs: JobStore, artifacts: ArtifactStore, policy: RetentionPolicy, *,
                   now: float | None = None, owner: str = "retention",
                   tenants: Iterable[str] | None = None) -> RetentionResult:
    """Remove the finished jobs `policy` no longer keeps (of `tenants`, or of every tenant), then
    delete the artifact prefixes queued for deletion. Returns what was done; does nothing while
    another sweep holds the lease."""
    result = RetentionResult()
    if jobs.acquire_lease(SWEEPER_LEASE, owner, 300.0) is not None:
        return result
    try:
        now = jobs.clock() if now is None else now
        if policy.active:
            for tenant in jobs.tenants() if tenants is None else sorted(tenants):
                _sweep_tenant(jobs, tenant, policy, now, result)
        _delete_queued(jobs, artifacts, result)
        if tenants is None:
            sweep_inputs(jobs, artifacts, now, result)
    finally:
        jobs.release_lease(SWEEPER_LEASE, owner)
    if result.failed_prefixes:
        log.warning("retention: %d artifact prefixes could not be deleted; the next round tries again",
                    len(result.failed_prefixes))
    return result


def _sweep_tenant(jobs: JobStore, tenant: str, policy: RetentionPolicy, now: float, result: RetentionResult) -> None:
    before = len(result.removed_age), len(result.removed_count)
    _walk_tenant(jobs, tenant, policy, now, result)
    by_age, by_count = len(result.removed_age) - before[0], len(result.removed_count) - before[1]
    if by_age or by_count:
        log.info("retention: removed %d finished jobs of tenant %s (%d by age, %d past its count)",
                 by_age + by_count, tenant, by_age, by_count, extra={"tenant": tenant})


def _walk_tenant(jobs: JobStore, tenant: str, policy: RetentionPolicy, now: float, result: RetentionResult) -> None:
    excess = jobs.count_jobs(tenant) - policy.keep_per_tenant if policy.keep_per_tenant else 0
    cutoff = now - policy.retention_s if policy.retention_s else None
    after: str | None = None
    while True:
        ids = jobs.ids_asc(tenant, after, PAGE)
        for job_id in ids:
            after = job_id
            created = job_id_time(job_id)
            young = cutoff is None or created is None or created > cutoff
            if excess <= 0 and young:
                return  # this job and every later one are kept
            rec = jobs.get(job_id)
            if rec is None:  # an index entry left without its record: dropped, and not counted
                jobs.remove(job_id, tenant)
                excess -= 1
                continue
            if not rec.terminal:
                continue
            by_age = cutoff is not None and (rec.finished_at or rec.updated_at) <= cutoff
            if not by_age and excess <= 0:
                continue
            if jobs.remove(job_id):
                (result.removed_age if by_age else result.removed_count).append(job_id)
                METRICS.jobs_removed_total.labels("age" if by_age else "count").inc()
                excess -= 1
        if len(ids) < PAGE:
            return


def _delete_queued(jobs: JobStore, artifacts: ArtifactStore, result: RetentionResult) -> None:
    while True:
        prefixes = [p for p in jobs.pending_deletions(PAGE) if p not in result.failed_prefixes]
        if not prefixes:
            return
        for prefix in prefixes:
            try:
                artifacts.delete_prefix(prefix)
            except StorageError as exc:  # kept in the queue: the next round tries again
                log.warning("retention: could not delete %s: %s", prefix, exc)
                result.failed_prefixes.append(prefix)
                continue
            jobs.deletion_done(prefix)
            result.deleted_prefixes.append(prefix)


def sweep_inputs(jobs: JobStore, artifacts: ArtifactStore, now: float, result: RetentionResult) -> None:
    """Delete the inputs whose ledger entry is past its keep_until and that no QUEUED or RUNNING
    job names. The entry goes first, atomically and only if no use pushed it later meanwhile;
    then the object. Should the delete fail, the entry comes back, due at once, so the next
    round tries again and the bytes stay counted."""
    for tenant in jobs.input_tenants():
        due = jobs.inputs_due(tenant, now, PAGE)
        if not due:
            continue
        in_use = jobs.inputs_in_use(tenant)
        deleted = 0
        for sha in due:
            size = None if sha in in_use else jobs.forget_input(tenant, sha, now)
            if size is None:
                continue
            key = input_key(tenant, sha)
            try:
                artifacts.delete_object(key)
            except StorageError as exc:
                log.warning("retention: could not delete input %s: %s", key, exc)
                jobs.reserve_input(tenant, sha, size, 0.0, 0)  # due at once
                continue
            result.deleted_inputs.append(key)
            METRICS.inputs_removed_total.inc()
            deleted += 1
        if deleted:
            log.info("retention: deleted %d inputs of tenant %s no job used (FXPORT_INPUT_RETENTION_S)", deleted,
                     tenant, extra={"tenant": tenant})


class RetentionSweeper(PeriodicTask):
    """`sweep_finished` over every tenant every `interval_s` in a daemon thread of the API
    server; in between, over the tenants `wake_for` named (a submit that took its tenant past
    the count limit), at once."""

    name = "retention-sweeper"
    tick_at_start = True

    def __init__(self, jobs: JobStore, artifacts: ArtifactStore, policy: RetentionPolicy, interval_s: float) -> None:
        import os
        import socket

        super().__init__(interval_s)
        self.jobs, self.artifacts, self.policy = jobs, artifacts, policy
        self.owner = f"retention:{socket.gethostname()}:{os.getpid()}"
        self._lock = threading.Lock()
        self._woken: set[str] = set()
        self._full_due = 0.0  # monotonic time of the next sweep over every tenant

    def wake_for(self, tenant: str) -> None:
        with self._lock:
            self._woken.add(tenant)
        self.wake()

    def tick(self) -> None:
        with self._lock:
            woken, self._woken = self._woken, set()
        full = time.monotonic() >= self._full_due
        started = time.monotonic()
        result = sweep_finished(self.jobs, self.artifacts, self.policy, owner=self.owner,
                                tenants=None if full else woken)
        if full:
            self._full_due = started + self.interval_s
        log.debug("retention sweep (%s): %d removed in %.3f s", "all tenants" if full else ", ".join(sorted(woken)),
                  len(result.removed), time.monotonic() - started)
