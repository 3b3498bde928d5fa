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


@signals.task_failure.connect
def _record_task_failure(sender: Any = None, exception: BaseException | None = None, args: Any = None,
                         **_: Any) -> None:
    """A task that died without recording its job (hard time limit: the pool child is
    killed; or a bug in the job function) must not leave the job RUNNING forever. Runs in
    the process that saw the failure (the worker's main process for a hard time limit)."""
    if sender is None or getattr(sender, "name", None) not in (RUN_JOB, BUILD_TENSORRT) or not args:
        return
    from celery.exceptions import TimeLimitExceeded

    from fxport.jobs import JobErrorInfo, JobState

    job_id = args[0]
    try:
        jobs = context().jobs
        rec = jobs.get(job_id)
        if rec is None or rec.terminal:
            return
        if isinstance(exception, TimeLimitExceeded):
            limit = context().settings.job_hard_time_limit_s
            error = JobErrorInfo(stage=rec.stage, code="timeout",
                                 message=f"the job ran past the worker's hard time limit ({limit} s) during "
                                         f"{rec.stage}; its worker process was killed")
        else:
            error = JobErrorInfo(stage=rec.stage, code="internal",
                                 message=f"the worker task failed: {type(exception).__name__}: {exception}")
        jobs.transition(job_id, state=JobState.FAILED, error=error, message=error.message)
    except Exception:
        log.exception("could not record the failure of job %s", job_id)
