"""The contract between the API and the workers: Celery task names, queues, and the Celery app
both sides build (the API to send tasks by name, the workers to run them).

The API server (service/dispatch.py) and the workers (workers/celery_app.py, workers/tasks.py)
import it from here, so neither room imports the other. Celery itself is imported only when an
app is built: the names cost nothing to import.

Why each reliability setting of `create_celery_app` (deploy/README.md, "Reliability"):
- `task_acks_late` + `task_reject_on_worker_lost`: a worker killed mid-job leaves its message
  un-acked, so the job is redelivered and runs again (idempotent: deterministic keys). A
  killed pool child's job is requeued at once; a killed worker's after the visibility timeout.
- a short `visibility_timeout` (Settings.visibility_timeout_s) with `unacked_restore_interval`
  and `unacked_restore_throttle=1`: a dead worker's job is back on the queue within about
  visibility_timeout_s + unacked_restore_interval_s (the sweep's lock expires after one
  interval, so a worker killed mid-sweep cannot hold it back). Kombu would hand a still-running job
  to a second worker after that timeout, so a running job keeps its message fresh
  (workers/celery_app.py, `MessageVisibility`, called by its lease heartbeat) and holds a job
  lease; the timeout no longer has to exceed the hard time limit.
- `worker_prefetch_multiplier=1`: a busy worker does not sit on jobs another could run.
- soft limit → the task gets SoftTimeLimitExceeded and the job FAILS naming its stage;
  hard limit → the pool child is killed.
- `worker_soft_shutdown_timeout`: SIGTERM (remapped to SIGQUIT in the manifests) lets the
  running job finish for that long, then cuts it; un-acked, it is back on the queue at once.
- `broker_connection_max_retries=None`: a worker waits out a broker restart instead of exiting.
Results live in the job store, not a Celery result backend.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fxport.config import Settings

if TYPE_CHECKING:
    from celery import Celery

RUN_JOB = "fxport.run_job"
BUILD_TENSORRT = "fxport.build_tensorrt"
# A job's later stages, each a task of its own: stage name → task name.
STAGE_TASKS = {"tensorrt": BUILD_TENSORRT}
QUEUES = ("cpu", "gpu")
DEFAULT_BROKER = "redis://127.0.0.1:6379/0"
# The module that defines the tasks; the workers' app loads it (the API's never needs to).
TASKS_MODULE = "fxport.workers.tasks"


def route_for(task_name: str) -> str:
    """TensorRT builds need a GPU; everything else runs on the CPU queue."""
    return "gpu" if task_name == BUILD_TENSORRT else "cpu"


def create_celery_app(settings: Settings | None = None) -> Celery:
    from celery import Celery
    from kombu import Queue

    settings = settings or Settings()
    hard = settings.job_hard_time_limit_s
    soft = min(settings.job_soft_time_limit_s, hard - 1)
    app = Celery("fxport", broker=settings.broker_url or DEFAULT_BROKER, include=[TASKS_MODULE])
    app.conf.update(
        task_queues=[Queue(q) for q in QUEUES],
        task_default_queue="cpu",
        task_routes={BUILD_TENSORRT: {"queue": "gpu"}, "fxport.*": {"queue": "cpu"}},
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        task_soft_time_limit=soft,
        task_time_limit=hard,
        broker_transport_options={
            "visibility_timeout": settings.visibility_timeout_s,
            "unacked_restore_interval": settings.unacked_restore_interval_s,
            "unacked_restore_throttle": 1,
            # The sweep runs under a Redis lock that kombu sets to expire after 300 s. A worker
            # killed inside its sweep (a few ms of every interval) leaves it held, and no worker
            # restores anything until it expires. The lock only saves duplicate scans (each
            # restore is a WATCH transaction, so a message is never restored twice), so let a
            # dead sweeper cost one interval at most.
            "unacked_mutex_expire": settings.unacked_restore_interval_s,
        },
        broker_connection_retry_on_startup=True,
        broker_connection_max_retries=None,
        worker_soft_shutdown_timeout=settings.worker_soft_shutdown_s,
        worker_prefetch_multiplier=1,
        task_ignore_result=True,
        task_serializer="json",
        accept_content=["json"],
        task_track_started=False,
        worker_hijack_root_logger=False,
        worker_send_task_events=False,
    )
    return app
