"""The workers' Celery app, and keeping a running task's message from being redelivered.

The task names, queues and the app's settings (and why each reliability setting) are the
contract with the API: fxport/task_queue.py. This module builds the workers' app from it,
adds `MessageVisibility` (a running job keeps its Redis message fresh, so only a dead worker
loses it) and drops a dead pool child's metrics. Only the workers import it; it imports no
engine code.
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

from fxport.task_queue import create_celery_app

log = logging.getLogger(__name__)


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
