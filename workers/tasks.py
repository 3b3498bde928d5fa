"""Celery tasks: ids in, bookkeeping only. The work is `workers/jobs.py`, shared with the
embedded pool."""

from __future__ import annotations

import logging
import os
from typing import Any, cast

from celery import signals

from fxport.config import Settings
from fxport.retry import Backoff
from fxport.task_queue import BUILD_TENSORRT, RUN_JOB, STAGE_TASKS
from fxport.workers.celery_app import MessageVisibility, app, message_kept_visible
from fxport.workers.job_lease import LeaseHeld
from fxport.workers.jobs import (
    RetryLater,
    WorkerContext,
    execute_job,
    execute_stage,
    past_soft_time_limit,
    soft_time_limit_message,
)
from fxport.workers.queue_consumers import ConsumerHeartbeat, queue_has_consumers

log = logging.getLogger(__name__)
MAX_RETRIES = 3
JOB_STORE_RETRY_S = 30.0
_ctx: WorkerContext | None = None


def context() -> WorkerContext:
    """Built on first use in each pool process (after the fork: no shared sockets)."""
    global _ctx
    if _ctx is None:
        from fxport.jobs import open_job_store
        from fxport.storage import open_store

        settings = Settings()
        _ctx = WorkerContext(
            # Ride out a broker restart (AOF replay) instead of failing the attempt mid-job.
            jobs=_metered(open_job_store(settings.job_store_url(), settings.home, retry_s=JOB_STORE_RETRY_S,
                                        events_ttl_s=settings.events_ttl_s),
                          settings),
            artifacts=open_store(settings.store_url(), retry_s=settings.store_retry_s),
            settings=settings,
            enqueue_stage=enqueue_stage,
            lease_s=settings.job_lease_s,
            gpu_workers=lambda: queue_has_consumers(settings.broker_url, "gpu"),
            **cast("dict[str, Any]", {"worker_id": settings.worker_id} if settings.worker_id else {}),
        )
    return _ctx


def enqueue_stage(stage: str, job_id: str) -> None:
    # A deterministic task id: a redelivered CPU task that re-enqueues is recognisably the same.
    app.send_task(STAGE_TASKS[stage], args=[job_id], task_id=f"{job_id}-{stage}")


_heartbeat: ConsumerHeartbeat | None = None


@signals.worker_ready.connect
def _start_queue_heartbeat(sender: Any = None, **_: Any) -> None:
    """List this worker as a consumer of its queues in Redis (what a job waiting for a GPU reports)."""
    global _heartbeat
    url = Settings().broker_url
    if not url or not url.startswith(("redis://", "rediss://")) or _heartbeat is not None:
        return

    def queues() -> list[str]:
        task_consumer = getattr(sender, "task_consumer", None)
        if task_consumer is not None:
            return [q.name for q in task_consumer.queues]
        return list(app.amqp.queues.consume_from or ())

    name = getattr(sender, "hostname", None) or f"{os.getpid()}"
    _heartbeat = ConsumerHeartbeat(url, name, queues).start()


@signals.worker_shutdown.connect
def _stop_queue_heartbeat(**_: Any) -> None:
    global _heartbeat
    if _heartbeat is not None:
        _heartbeat.stop()
        _heartbeat = None


_toolchain: Any = None


@signals.worker_ready.connect
def _publish_toolchain(sender: Any = None, **_: Any) -> None:
    """Tell the API which toolchain this worker's queues run (the result cache's key; the API
    image has no torch to ask). See fxport/toolchain.py."""
    global _toolchain
    url = Settings().broker_url
    if not url or not url.startswith(("redis://", "rediss://", "unix://")) or _toolchain is not None:
        return
    from fxport.toolchain import ToolchainPublisher

    task_consumer = getattr(sender, "task_consumer", None)
    queues = ([q.name for q in task_consumer.queues] if task_consumer is not None
              else list(app.amqp.queues.consume_from or ()))
    try:
        _toolchain = ToolchainPublisher(url, queues, getattr(sender, "hostname", None) or str(os.getpid())).start()
    except Exception as exc:  # no cache hits until it works; the jobs themselves are unaffected
        log.warning("could not start publishing the toolchain: %s", exc)


@signals.worker_shutdown.connect
def _stop_publishing_toolchain(**_: Any) -> None:
    global _toolchain
    if _toolchain is not None:
        _toolchain.stop()
        _toolchain = None


@signals.worker_process_init.connect
def _prestart_sandbox(**_: Any) -> None:
    """Each pool process starts its warm sandbox now, in the background, instead of making its
    first job wait for it (seconds of `import torch` and warm-up)."""
    import threading

    from fxport.toolchain import local_toolchain
    from fxport.workers.sandbox import prestart

    def warm() -> None:
        prestart()
        local_toolchain()  # the package-metadata scan, once, before a job waits on it

    threading.Thread(target=warm, name="fxport-sandbox-prestart", daemon=True).start()


@signals.setup_logging.connect
def _setup_logging(**_: Any) -> None:
    from fxport.logs import configure_logging

    s = Settings()
    configure_logging(s.log_level, s.log_format)


# A task the store failed for a moment comes back as a new delivery after 2, 4, 8 ... s (at most a
# minute), jittered so that jobs failing together do not return together (fxport/retry.py).
REDELIVERY = Backoff(first_s=1.0, max_s=60.0)


@app.task(name=RUN_JOB, bind=True, max_retries=MAX_RETRIES)
def run_job(self: Any, job_id: str) -> None:
    # The object store's own retry budget (Settings.store_retry_s) is the job's: past it the
    # job FAILS naming the endpoint, rather than rerunning from scratch a few more times.
    try:
        execute_job(job_id, context(), final_attempt=True, on_heartbeat=MessageVisibility(app, self.request.id))
    except LeaseHeld as held:
        # A duplicate delivery of a job a live worker runs: look again later, as a fresh message
        # (same task id, so a cancel's revoke still finds it); this one is acknowledged.
        log.info("%s", held, extra={"job_id": job_id})
        app.send_task(RUN_JOB, args=[job_id], task_id=self.request.id, countdown=held.retry_in_s)
    except RetryLater as exc:
        raise self.retry(exc=exc, countdown=REDELIVERY.pause(self.request.retries + 2)) from exc


@app.task(name=BUILD_TENSORRT, bind=True, max_retries=MAX_RETRIES)
def build_tensorrt(self: Any, job_id: str) -> None:
    ctx = context()
    try:
        # An engine build outlasts the visibility timeout: keep the message from being redelivered.
        with message_kept_visible(app, self.request.id, ctx.settings.visibility_timeout_s / 4):
            execute_stage("tensorrt", job_id, ctx, final_attempt=self.request.retries >= MAX_RETRIES)
    except RetryLater as exc:
        raise self.retry(exc=exc, countdown=REDELIVERY.pause(self.request.retries + 2)) from exc


@signals.task_failure.connect
def _record_task_failure(sender: Any = None, exception: BaseException | None = None, args: Any = None,
                         **_: Any) -> None:
    """A task that died without recording its job (hard time limit: the pool child is
    killed; or a bug in the job function) must not leave the job RUNNING forever. Runs in
    the process that saw the failure (the worker's main process for a hard time limit)."""
    if sender is None or getattr(sender, "name", None) not in (RUN_JOB, BUILD_TENSORRT) or not args:
        return
    from celery.exceptions import TimeLimitExceeded

    from fxport.errors import ErrorRecord
    from fxport.jobs import JobState

    job_id = args[0]
    if _is_broker_outage(exception):
        # Not the job's fault: left RUNNING, it comes back by redelivery or the orphan sweeper.
        log.warning("job %s: attempt ended by a job store outage (%s); it will be rerun", job_id, exception)
        return
    try:
        jobs = context().jobs
        rec = jobs.get(job_id)
        if rec is None or rec.terminal:
            return
        if past_soft_time_limit(exception):  # raised outside the job's own handler
            error = ErrorRecord(stage=rec.stage, code="timeout",
                                 message=soft_time_limit_message(context().settings, rec.stage))
        elif isinstance(exception, TimeLimitExceeded):
            limit = context().settings.job_hard_time_limit_s
            error = ErrorRecord(stage=rec.stage, code="timeout",
                                 message=f"the job ran past the worker's hard time limit ({limit} s) during "
                                         f"{rec.stage}; its worker process was killed")
        else:
            error = ErrorRecord(stage=rec.stage, code="internal",
                                 message=f"the worker task failed: {type(exception).__name__}: {exception}")
        jobs.transition(job_id, state=JobState.FAILED, error=error, message=error.message)
    except Exception:
        log.exception("could not record the failure of job %s", job_id)


def _is_broker_outage(exc: BaseException | None) -> bool:
    try:
        import redis
    except ImportError:
        return False
    return isinstance(exc, (redis.ConnectionError, redis.TimeoutError))


def _metered(store, settings):  # noqa: ANN001, ANN202
    """With metrics on (FXPORT_METRICS_PORT), count job states and stage durations this worker records."""
    if settings.metrics_port is None:
        return store
    from fxport.metrics import MeteredJobStore

    return MeteredJobStore(store)
