"""The embedded worker pool: threads in the API process running the same job function the
Celery tasks run (workers/jobs.py). The engine itself runs in a sandbox subprocess, so a
thread per job is enough here, and the API process never loads a model.

The API room (service/) never imports worker code: `fxport serve` (cli/server.py) hands
`create_embedded_pool` to `fxport.service.server.create_server`, which calls it with its stores
and uses the pool as its dispatcher (service/dispatch.py, `EmbeddedDispatcher`).

On start it picks up jobs a previous run left QUEUED or RUNNING (the SQLite job store
survives restarts), the same at-least-once behaviour the distributed mode gets from Redis.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fxport.config import Settings
from fxport.jobs import JobRecord, JobState, JobStore
from fxport.retry import Backoff, retry_call
from fxport.storage import ArtifactStore
from fxport.workers.jobs import RetryLater, WorkerContext, execute_job, execute_stage, kill_sandboxes_of

log = logging.getLogger(__name__)
RETRIES = 3
RETRY_BACKOFF = Backoff(first_s=2.0, max_s=30.0, jitter=0.0)  # 2 s, 4 s, 8 s


class EmbeddedPool:
    def __init__(self, ctx: WorkerContext, workers: int = 2) -> None:
        self.ctx = ctx
        ctx.enqueue_stage = self.enqueue_stage
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fxport-job")
        self._closed = threading.Event()
        self._running: set[str] = set()
        self._lock = threading.Lock()

    def enqueue(self, job_id: str) -> str:
        self._pool.submit(self._run, None, job_id)
        return f"embedded-{job_id}"

    def enqueue_stage(self, stage: str, job_id: str) -> None:
        self._pool.submit(self._run, stage, job_id)

    def cancel(self, record: JobRecord) -> None:
        """Nothing to revoke: the running job's cancel watch sees the record and kills its sandbox."""

    def recover(self) -> list[str]:
        """Re-run jobs a previous process left unfinished."""
        ids = self.ctx.jobs.ids_in_states([JobState.QUEUED, JobState.RUNNING])
        for job_id in ids:
            rec = self.ctx.jobs.get(job_id)
            if rec is not None and rec.state is JobState.RUNNING and rec.stage == "tensorrt" and rec.artifacts:
                self.enqueue_stage("tensorrt", job_id)
            else:
                self.enqueue(job_id)
        if ids:
            log.info("re-running %d unfinished job(s) from an earlier run", len(ids))
        return ids

    def _run(self, stage: str | None, job_id: str) -> None:
        with self._lock:
            self._running.add(job_id)
        try:
            self._run_with_retries(stage, job_id)
        finally:
            with self._lock:
                self._running.discard(job_id)

    def _run_with_retries(self, stage: str | None, job_id: str) -> None:
        """Run the job; again after RETRY_BACKOFF's pause while it asks to (RetryLater: its store
        failed for a moment), RETRIES times at most. The last attempt fails the job instead."""
        attempts = 0

        def attempt() -> None:
            nonlocal attempts
            attempts += 1
            if self._closed.is_set():
                return
            final = attempts == RETRIES + 1
            if stage is None:
                execute_job(job_id, self.ctx, final_attempt=final)
            else:
                execute_stage(stage, job_id, self.ctx, final_attempt=final)

        try:
            retry_call(attempt, retry_if=RetryLater, max_attempts=RETRIES + 1, backoff=RETRY_BACKOFF)
        except RetryLater:
            pass  # only a final attempt could raise it, and a final attempt fails the job instead
        except Exception:
            log.exception("job function crashed", extra={"job_id": job_id})

    def close(self, timeout: float = 10.0) -> None:
        """Stop: queued work is dropped (it stays QUEUED for the next start), running jobs'
        sandboxes are killed and the jobs left RUNNING, to be re-run by `recover`."""
        self._closed.set()
        self.ctx.stopping.set()
        with self._lock:
            running = list(self._running)
        for job_id in running:
            kill_sandboxes_of(job_id)
        self._pool.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + timeout
        for thread in list(getattr(self._pool, "_threads", ())):
            thread.join(max(0.0, deadline - time.monotonic()))


def create_embedded_pool(jobs: JobStore, artifacts: ArtifactStore, settings: Settings) -> EmbeddedPool:
    """The pool the embedded server runs its jobs on, against the server's own stores
    (`settings.embedded_workers` threads; `settings.worker_id` names it in job leases and logs)."""
    named: dict[str, Any] = {"worker_id": settings.worker_id} if settings.worker_id else {}
    ctx = WorkerContext(jobs=jobs, artifacts=artifacts, settings=settings, **named)
    return EmbeddedPool(ctx, settings.embedded_workers)
