"""The Celery app: Redis broker, queues `cpu` and `gpu`, at-least-once delivery settings.

Why each reliability setting (ENVIRONMENT.md, "Redis + Celery 5.7"; deploy/README.md, "Reliability"):
- `task_acks_late` + `task_reject_on_worker_lost`: a worker killed mid-job leaves its message
  un-acked, so the job is redelivered and runs again (idempotent: deterministic keys). A
  killed pool child's job is requeued at once; a killed worker's after the visibility timeout.
- a short `visibility_timeout` (Settings.visibility_timeout_s) with `unacked_restore_interval`
  and `unacked_restore_throttle=1`: a dead worker's job is back on the queue within about
  visibility_timeout_s + unacked_restore_interval_s (the sweep's lock expires after one
  interval, so a worker killed mid-sweep cannot hold it back). Kombu would hand a still-running job
  to a second worker after that timeout, so a running job keeps its message fresh
  (`MessageVisibility`, called by its lease heartbeat) and holds a job lease; the timeout
  no longer has to exceed the hard time limit.
- `worker_prefetch_multiplier=1`: a busy worker does not sit on jobs another could run.
- soft limit → the task gets SoftTimeLimitExceeded and the job FAILS naming its stage;
  hard limit → the pool child is killed.
- `worker_soft_shutdown_timeout`: SIGTERM (remapped to SIGQUIT in the manifests) lets the
  running job finish for that long, then cuts it; un-acked, it is back on the queue at once.
- `broker_connection_max_retries=None`: a worker waits out a broker restart instead of exiting.
Results live in the job store, not a Celery result backend.

Only the API server (to enqueue by name) and the workers import this; it imports no engine code.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from celery import Celery, signals
from kombu import Queue

from fxport.config import Settings

log = logging.getLogger(__name__)
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


class MessageVisibility:
    """Keeps a running task's Redis message from being handed to another worker.

    Kombu's Redis transport emulates acks: a delivered message waits in the hash `unacked`,
    its delivery time in the sorted set `unacked_index`; any worker's periodic sweep puts
    back on the queue every message delivered more than `visibility_timeout` ago. Calling
    this moves the task's entries in `unacked_index` to now (ZADD XX: only entries that
    still exist), so only a worker that stopped calling it — a dead one — loses its job.
    Entries are found by task id (= job id): a delivery tag is not exposed to the task.
    This reads kombu's key layout (kombu 5.x: `unacked`, `unacked_index`, honouring
    `global_keyprefix`); tests/reliability fails if that layout changes.
    """

    _clients: dict[str, Any] = {}

    def __init__(self, celery_app: Celery, task_id: str) -> None:
        opts = celery_app.conf.broker_transport_options or {}
        prefix = opts.get("global_keyprefix", "")
        self.hash_key = prefix + opts.get("unacked_key", "unacked")
        self.index_key = prefix + opts.get("unacked_index_key", "unacked_index")
        self.task_id = task_id
        self.url = celery_app.conf.broker_url

    def _client(self) -> Any:
        client = self._clients.get(self.url)
        if client is None:
            import redis

            client = self._clients[self.url] = redis.Redis.from_url(self.url, socket_timeout=10,
                                                                  socket_connect_timeout=5)
        return client

    def tags(self) -> list[str]:
        out = []
        for tag, raw in self._client().hscan_iter(self.hash_key, count=500):
            if self.task_id.encode() not in raw:
                continue
            try:
                if json.loads(raw)[0]["headers"]["id"] == self.task_id:
                    out.append(tag.decode())
            except (ValueError, KeyError, IndexError, TypeError):
                continue
        return out

    def __call__(self) -> int:
        """Refresh this task's entries; returns how many there were."""
        tags = self.tags()
        if tags:
            self._client().zadd(self.index_key, {t: time.time() for t in tags}, xx=True)
        return len(tags)


@contextmanager
def message_kept_visible(celery_app: Celery, task_id: str, every_s: float) -> Iterator[MessageVisibility]:
    """MessageVisibility every `every_s` seconds in a thread, for tasks that hold no job lease
    (whose heartbeat would do it): the tensorrt stage."""
    keep = MessageVisibility(celery_app, task_id)
    stop = threading.Event()

    def run() -> None:
        while True:
            try:
                keep()
            except Exception as exc:  # the broker is away; the next round tries again
                log.warning("could not refresh the task's message: %s", exc)
            if stop.wait(every_s):
                return

    thread = threading.Thread(target=run, name=f"visibility-{task_id}", daemon=True)
    thread.start()
    try:
        yield keep
    finally:
        stop.set()
        thread.join(timeout=5)


app = create_celery_app()


@signals.worker_process_shutdown.connect
def _drop_dead_child_metrics(pid: int | None = None, **_: object) -> None:
    """A pool child exits: its live gauges must stop counting in the summed /metrics."""
    import os

    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from fxport.metrics import mark_process_dead

        mark_process_dead(pid or os.getpid())
