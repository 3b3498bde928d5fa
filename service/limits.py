"""Per-tenant admission: how many jobs one tenant may have QUEUED or RUNNING at once
(`InFlightLimit`); and the API process's capacity every tenant shares, which no one tenant may
take: its RPC threads, held by streaming calls (`StreamSlots`) and by the calls that answer at
once (`CallSlots`), and its upload spool (`SpoolBudget`).

The job store keeps an index of each tenant's in-flight jobs beside the records, so the check
costs one read whatever the length of the tenant's history (reading the newest jobs' states
instead grew with it: docs/benchmarks.md, "Costs the code is shaped around"). Before refusing a
submit, the count is checked against the records themselves. Checking and
creating happen under a per-tenant lock, so concurrent submits to one API process cannot
overshoot; across API replicas the limit can be exceeded by at most the replicas racing.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from fxport.errors import QuotaExceeded
from fxport.jobs import JobStore
from fxport.service.uploads import Reserve

# Trailing metadata of a submit refused because its tenant's jobs in flight are at their limit.
QUEUE_FULL_METADATA = ("fxport-retry", "queue-full")
QUEUE_RETRY_AFTER_S = 5  # how long a client should wait before submitting again: a tiny job's time, about
UPLOADS = "\x00uploads"  # StreamSlots key suffix: a tenant's SubmitJob streams, counted apart from its others


class InFlightLimit:
    def __init__(self, jobs: JobStore, limit: int) -> None:
        self.jobs, self.limit = jobs, limit
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()

    def count(self, tenant: str) -> int:
        """Jobs of `tenant` QUEUED or RUNNING, from the job store's index (one read)."""
        return self.jobs.count_in_flight(tenant)

    def check(self, tenant: str) -> None:
        n = self.count(tenant)
        if n >= self.limit:
            n = self.jobs.count_in_flight(tenant, exact=True)  # never refuse on a stale index
        if n >= self.limit:
            # Not a request too large, nor the server's capacity: the tenant's own queue is full. The
            # fxport client waits `retry-after` and submits again (QueueFull), for as long as it may wait.
            raise QuotaExceeded(f"tenant {tenant!r} has {n} jobs queued or running; the limit is {self.limit} "
                                "(FXPORT_MAX_JOBS_IN_FLIGHT): wait for some to finish or cancel them",
                                trailing_metadata=(QUEUE_FULL_METADATA, ("retry-after", str(QUEUE_RETRY_AFTER_S))))

    @contextmanager
    def admit(self, tenant: str) -> Iterator[None]:
        """Check, then run the body (which creates the job) before anyone else of this tenant checks."""
        with self._guard:
            lock = self._locks.setdefault(tenant, threading.Lock())
        with lock:
            self.check(tenant)
            yield


# ---------------------------------------------------------------------------------------------
# Capacity every tenant of an API process shares: its RPC threads (each streaming call holds one
# for as long as it stays open) and its upload spool
# ---------------------------------------------------------------------------------------------

# Trailing metadata of a call refused while shared capacity is taken (streams, spool): retry later.
BUSY_RETRY_METADATA = ("fxport-retry", "busy")
STREAM_ADMITTED_METADATA = ("fxport-stream", "admitted")  # initial metadata of a stream that holds a slot
# The key for streams of the services every caller reaches without a token (health, reflection).
UNAUTHENTICATED = "(no tenant: health and reflection)"


class _SharedCounts:
    """An amount held per caller, and their total, under one lock (StreamSlots, CallSlots, SpoolBudget)."""

    def __init__(self) -> None:
        self._held: dict[str, int] = {}
        self._all = 0
        self._lock = threading.Lock()

    def held(self, caller: str | None = None) -> int:
        """What `caller` holds now; everyone's together when None."""
        with self._lock:
            return self._all if caller is None else self._held.get(caller, 0)

    def _add(self, caller: str, n: int) -> None:  # with the lock held
        self._held[caller] = self._held.get(caller, 0) + n
        self._all += n

    def release(self, caller: str, n: int = 1) -> None:
        with self._lock:
            left = self._held.get(caller, 0) - n
            if left > 0:
                self._held[caller] = left
            else:
                self._held.pop(caller, None)
            self._all -= n


class StreamSlots(_SharedCounts):
    """How many streaming calls (WatchJob, SubmitJob, DownloadArtifact, Health/Watch,
    reflection) may be open at once: `per_caller` for each tenant, and for health and
    reflection together (which need no token); `total` for the whole server, which is kept
    below its RPC threads so that short calls and health checks always find one.

    Without it one tenant holding every thread (64 WatchJob streams on its own queued job, or
    uploads it never finishes) left every other tenant's calls, and the liveness probe's health
    check, waiting in the server's queue until the streams closed. Counts are per API process,
    as its threads are."""

    def __init__(self, per_caller: int, total: int, threads: int, per_caller_uploads: int | None = None) -> None:
        super().__init__()
        self.per_caller, self.total, self.threads = per_caller, total, threads
        self.per_caller_uploads = per_caller_uploads or per_caller

    def take(self, caller: str, *, upload: bool = False) -> tuple[str, str] | None:
        """Take a slot for `caller` (`upload`: one of its SubmitJob streams, counted apart: the key
        is `caller + UPLOADS`, to release): None, or (which limit, why) when none is free."""
        with self._lock:
            if upload:
                mine = self._held.get(caller + UPLOADS, 0)
                if mine >= self.per_caller_uploads:
                    return "tenant", (f"tenant {caller!r} already has {mine} submits streaming to this API server; "
                                      f"the limit is {self.per_caller_uploads} per tenant "
                                      "(FXPORT_MAX_UPLOADS_PER_TENANT): retry later; the fxport client retries")
                if self._all >= self.total:
                    return "server", self._server_full()
                self._add(caller + UPLOADS, 1)
                return None
            mine = self._held.get(caller, 0)
            if mine >= self.per_caller:
                who = (f"tenant {caller!r} already holds" if caller != UNAUTHENTICATED
                       else "callers without a token (health, reflection) already hold")
                return "tenant", (f"{who} {mine} open streaming calls (WatchJob, SubmitJob, DownloadArtifact, "
                                  f"Health/Watch, reflection); the limit is {self.per_caller} per tenant "
                                  "(FXPORT_MAX_STREAMS_PER_TENANT): close some or retry later; the fxport client "
                                  "retries, and follows a job by polling meanwhile")
            if self._all >= self.total:
                return "server", self._server_full()
            self._add(caller, 1)
            return None

    def _server_full(self) -> str:
        return (f"this API server has {self._all} streaming calls open, all of its {self.total} stream slots "
                f"(FXPORT_GRPC_MAX_WORKERS {self.threads} threads, less {self.threads - self.total} kept for short "
                "calls and health checks): retry later, or run more API replicas")


class CallSlots(_SharedCounts):
    """How many of its calls that answer once (GetJob, ListJobs, CancelJob, CheckUpload,
    GetArtifactUrl) one tenant may have in progress on an API process at once.

    The server's threads take calls in the order they arrive. Without it one tenant sending
    calls side by side, more than there are threads (each a filtered ListJobs reading its
    share of the tenant's jobs), kept every thread busy with its own and queued every other
    tenant's calls, and the liveness probe's health check, behind them. A call past the limit
    ends at once (RESOURCE_EXHAUSTED, `fxport-retry: busy`, which the fxport client retries),
    so the tenant's excess leaves the queue in microseconds each. Health and reflection are
    not counted: a probe is never refused. Counts are per API process, as its threads are."""

    def __init__(self, per_tenant: int) -> None:
        super().__init__()
        self.per_tenant = per_tenant

    def take(self, tenant: str) -> tuple[str, str] | None:
        """Take a slot for `tenant`: None, or (which limit, why) when it holds all of its own."""
        with self._lock:
            mine = self._held.get(tenant, 0)
            if mine >= self.per_tenant:
                return "tenant", (f"tenant {tenant!r} already has {mine} calls in progress on this API server; the "
                                  f"limit is {self.per_tenant} per tenant (FXPORT_MAX_CALLS_PER_TENANT): retry later; "
                                  "the fxport client retries")
            self._add(tenant, 1)
            return None


class SpoolBudget(_SharedCounts):
    """Bytes of uploads the API process holds in its spool at once: at most `total` for all
    tenants together, at most half of it for any one. An upload reserves the size it declares
    before any byte is read (one that declares none reserves its bytes as they arrive) and gives
    it back when its files are deleted.

    Without it one tenant streaming a few maximal uploads at once (each SubmitJob may stream
    FXPORT_MAX_UPLOAD_BYTES) could fill the spool: every other tenant's upload then failed on a
    full disk, and in Kubernetes an emptyDir past its sizeLimit has the pod evicted, ending every
    tenant's calls on it."""

    def __init__(self, total: int) -> None:
        super().__init__()
        self.total, self.per_tenant = total, total // 2

    def reserve(self, tenant: str, n: int) -> tuple[str, str] | None:
        """Reserve n bytes for `tenant`: None, or (which limit, why) when that would pass one."""
        with self._lock:
            mine = self._held.get(tenant, 0)
            if mine + n > self.per_tenant:
                return "tenant", (f"tenant {tenant!r} already has {mine} bytes of uploads in this API server's spool; "
                                  f"{n} more would pass its share, {self.per_tenant} bytes (half of "
                                  "FXPORT_MAX_SPOOL_BYTES): retry once its other uploads are stored; the fxport "
                                  "client retries")
            if self._all + n > self.total:
                return "server", (f"this API server's spool holds {self._all} bytes of uploads in flight; {n} more "
                                  f"would pass FXPORT_MAX_SPOOL_BYTES ({self.total}): retry later, or run more "
                                  "API replicas")
            self._add(tenant, n)
            return None

    @contextmanager
    def reservation(self, tenant: str) -> Iterator[Reserve]:
        """`reserve(n)` for one upload of `tenant`, raising QuotaExceeded when n more bytes
        would pass a limit; everything it reserved is given back at the end of the block."""
        from fxport.metrics import METRICS

        taken = 0

        def reserve(n: int) -> None:
            nonlocal taken
            if taken + n > self.per_tenant:  # this upload alone could never fit: not a matter of waiting
                raise QuotaExceeded(f"this upload needs {taken + n} bytes of the API server's spool, more than one "
                                     f"tenant may hold, {self.per_tenant} (half of FXPORT_MAX_SPOOL_BYTES): send "
                                     "less at once (with an S3 store, files of 16 MiB or more go straight to the "
                                     "store and never pass the spool), or ask for a larger spool")
            refused = self.reserve(tenant, n)
            if refused is not None:
                METRICS.busy_refusals_total.labels("spool", refused[0]).inc()
                raise QuotaExceeded(refused[1], trailing_metadata=(BUSY_RETRY_METADATA,))
            taken += n

        try:
            yield reserve
        finally:
            self.release(tenant, taken)
