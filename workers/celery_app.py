"""The Celery app: Redis broker, queues `cpu` and `gpu`, at-least-once delivery settings.

Why each reliability setting (ENVIRONMENT.md, "Redis + Celery 5.7"):
- `task_acks_late` + `task_reject_on_worker_lost`: a worker killed mid-job leaves its message
  un-acked, so the job is redelivered and runs again (idempotent: deterministic keys).
- `visibility_timeout` above the hard time limit: otherwise Redis hands a still-running job
  to a second worker. `unacked_restore_throttle` keeps redelivery near that timeout.
- `worker_prefetch_multiplier=1`: a busy worker does not sit on jobs another could run.
- soft limit → the task gets SoftTimeLimitExceeded and the job FAILS naming its stage;
  hard limit → the pool child is killed.
Results live in the job store, not a Celery result backend.

Only the API server (to enqueue by name) and the workers import this; it imports no engine code.
"""

from __future__ import annotations

from celery import Celery
from kombu import Queue

from fxport.config import Settings

RUN_JOB = "fxport.run_job"
BUILD_TENSORRT = "fxport.build_tensorrt"
STAGE_TASKS = {"tensorrt": BUILD_TENSORRT}
QUEUES = ("cpu", "gpu")
DEFAULT_BROKER = "redis://127.0.0.1:6379/0"


def route_for(task_name: str) -> str:
    """TensorRT builds need a GPU; everything else runs on the CPU queue."""
    return "gpu" if task_name == BUILD_TENSORRT else "cpu"


def create_celery_app(settings: Settings | None = None) -> Celery:
    settings = settings or Settings()
    hard = settings.job_hard_time_limit_s
    soft = min(settings.job_soft_time_limit_s, hard - 1)
    app = Celery("fxport", broker=settings.broker_url or DEFAULT_BROKER, include=["fxport.workers.tasks"])
    app.conf.update(
        task_queues=[Queue(q) for q in QUEUES],
        task_default_queue="cpu",
        task_routes={BUILD_TENSORRT: {"queue": "gpu"}, "fxport.*": {"queue": "cpu"}},
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        task_soft_time_limit=soft,
        task_time_limit=hard,
        broker_transport_options={
            "visibility_timeout": hard + max(60, hard // 5),
            "unacked_restore_throttle": 1,
        },
        broker_connection_retry_on_startup=True,
        worker_prefetch_multiplier=1,
        task_ignore_result=True,
        task_serializer="json",
        accept_content=["json"],
        task_track_started=False,
        worker_hijack_root_logger=False,
        worker_send_task_events=False,
    )
    return app


app = create_celery_app()
