"""Celery tasks: ids in, bookkeeping only. The work is `workers/jobs.py`, shared with the
embedded pool."""

from __future__ import annotations

import logging
from typing import Any

from celery import signals

from fxport.config import Settings
from fxport.workers.celery_app import BUILD_TENSORRT, RUN_JOB, STAGE_TASKS, app
from fxport.workers.jobs import RetryLater, WorkerContext, execute_job, execute_stage

log = logging.getLogger(__name__)
MAX_RETRIES = 3
_ctx: WorkerContext | None = None


def context() -> WorkerContext:
    """Built on first use in each pool process (after the fork: no shared sockets)."""
    global _ctx
    if _ctx is None:
        from fxport.jobs import open_job_store
        from fxport.storage import open_store

        settings = Settings()
        _ctx = WorkerContext(
            jobs=open_job_store(settings.job_store_url(), settings.home),
            artifacts=open_store(settings.store_url()),
            settings=settings,
            enqueue_stage=enqueue_stage,
            **({"worker_id": settings.worker_id} if settings.worker_id else {}),
        )
    return _ctx


def enqueue_stage(stage: str, job_id: str) -> None:
    # A deterministic task id: a redelivered CPU task that re-enqueues is recognisably the same.
    app.send_task(STAGE_TASKS[stage], args=[job_id], task_id=f"{job_id}-{stage}")


@signals.setup_logging.connect
def _setup_logging(**_: Any) -> None:
    from fxport.logs import configure_logging

    s = Settings()
    configure_logging(s.log_level, s.log_format)


@app.task(name=RUN_JOB, bind=True, max_retries=MAX_RETRIES)
def run_job(self: Any, job_id: str) -> None:
    try:
        execute_job(job_id, context(), final_attempt=self.request.retries >= MAX_RETRIES)
    except RetryLater as exc:
        raise self.retry(exc=exc, countdown=min(60, 2 ** (self.request.retries + 1)))


@app.task(name=BUILD_TENSORRT, bind=True, max_retries=MAX_RETRIES)
def build_tensorrt(self: Any, job_id: str) -> None:
    try:
        execute_stage("tensorrt", job_id, context(), final_attempt=self.request.retries >= MAX_RETRIES)
    except RetryLater as exc:
        raise self.retry(exc=exc, countdown=min(60, 2 ** (self.request.retries + 1)))
