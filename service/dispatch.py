"""How the API hands a job to workers: Celery on Redis (distributed) or the embedded pool.

A dispatcher has `enqueue(job_id) -> task id`, `cancel(record)` and `close()`. The API never
imports worker code: the Celery dispatcher sends tasks by name (fxport/task_queue.py, the contract
both sides import), and the embedded pool (workers/embedded.py) is handed in by whoever builds the
server (`create_server(embedded_pool=...)`; `fxport serve`: cli/server.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from fxport.config import Settings
from fxport.jobs import JobRecord, JobStore
from fxport.storage import ArtifactStore
from fxport.task_queue import RUN_JOB, STAGE_TASKS, create_celery_app  # imports Celery only when an app is built

log = logging.getLogger(__name__)


class Dispatcher(Protocol):
    def enqueue(self, job_id: str) -> str: ...

    def cancel(self, record: JobRecord) -> None: ...

    def close(self) -> None: ...


class EmbeddedDispatcher(Dispatcher, Protocol):
    """A worker pool in the API process (workers/embedded.py): it also re-runs, on start, the jobs
    a previous process left unfinished."""

    def recover(self) -> list[str]: ...


# Builds the embedded pool from the server's own stores: fxport.workers.embedded.create_embedded_pool.
EmbeddedPoolFactory = Callable[[JobStore, ArtifactStore, Settings], EmbeddedDispatcher]


class CeleryDispatcher:
    """Sends tasks by name, so the API process never imports the worker code."""

    def __init__(self, settings: Settings) -> None:
        self.app = create_celery_app(settings)
        self._run_job = RUN_JOB
        self._stages = STAGE_TASKS

    def enqueue(self, job_id: str) -> str:
        # task id = job id: a retried enqueue is the same task, and revoke needs no lookup.
        self.app.send_task(self._run_job, args=[job_id], task_id=job_id)
        return job_id

    def cancel(self, record: JobRecord) -> None:
        # SIGUSR1 is billiard's soft-time-limit signal: the task gets an exception in its own
        # thread, the sandbox is killed by its `except BaseException`, and the job function
        # sees the CANCELLED record and removes partial artifacts. (SIGTERM would kill the
        # pool child before any of that.) The job function's own cancel watch is the backup.
        ids = [record.task_id or record.id] + [f"{record.id}-{stage}" for stage in self._stages]
        try:
            self.app.control.revoke(ids, terminate=True, signal="SIGUSR1")
        except Exception as exc:  # the record is CANCELLED either way; the worker checks it
            log.warning("revoke failed: %s", exc, extra={"job_id": record.id})

    def close(self) -> None:
        self.app.close()
