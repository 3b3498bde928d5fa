"""Per-tenant admission: how many jobs one tenant may have QUEUED or RUNNING at once.

The count reads the tenant's newest jobs from the job store (in-flight jobs are recent: a
tenant whose newest `SCAN_JOBS` jobs are all finished is not flooding the queue), so a
submit costs a bounded number of reads however long the tenant's history. Checking and
creating happen under a per-tenant lock, so concurrent submits to one API process cannot
overshoot; across API replicas the limit can be exceeded by at most the replicas racing.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

import grpc

from fxport.jobs import JobState, JobStore

SCAN_JOBS = 1000
IN_FLIGHT = (JobState.QUEUED, JobState.RUNNING)


class InFlightLimit:
    def __init__(self, jobs: JobStore, limit: int) -> None:
        self.jobs, self.limit = jobs, limit
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()

    def count(self, tenant: str) -> int:
        """Jobs of `tenant` in flight among its newest SCAN_JOBS: the job store reads their states
        only (one pipelined Redis round trip, or one SQL query), not SCAN_JOBS whole records."""
        return self.jobs.count_recent_in_states(tenant, IN_FLIGHT, SCAN_JOBS)

    def check(self, tenant: str, context: grpc.ServicerContext) -> None:
        n = self.count(tenant)
        if n >= self.limit:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"tenant {tenant!r} has {n} jobs queued or running; the limit is {self.limit} "
                          "(FXPORT_MAX_JOBS_IN_FLIGHT): wait for some to finish or cancel them")

    @contextmanager
    def admit(self, tenant: str, context: grpc.ServicerContext) -> Iterator[None]:
        """Check, then run the body (which creates the job) before anyone else of this tenant checks."""
        with self._guard:
            lock = self._locks.setdefault(tenant, threading.Lock())
        with lock:
            self.check(tenant, context)
            yield
