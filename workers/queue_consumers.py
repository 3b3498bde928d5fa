"""Which Celery queues have a live worker: a heartbeat every worker writes to Redis, read when a job waits.

A job that needs a GPU stays QUEUED until a worker consuming queue "gpu" takes it; its record
should say whether one exists. Asked of Celery (`app.control.inspect().active_queues()`), the
answer costs a full broadcast timeout per question, and a worker whose only process is busy
(a solo pool in the middle of a TensorRT build) does not answer at all — it would look absent
exactly while it works. So each worker's main process runs a thread that keeps a Redis entry
per queue it consumes alive:

    fxport:queue-consumers:<queue>   sorted set, member = worker name, score = expiry (Unix s)

refreshed every `BEAT_S`, expiring `TTL_S` after the last beat (a kill -9 drops out by
itself), removed on a clean shutdown. `queue_has_consumers` counts unexpired members and
caches the answer for `CACHE_S`, so a burst of jobs costs one Redis round trip.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from fxport.periodic import PeriodicTask

log = logging.getLogger(__name__)

KEY = "fxport:queue-consumers:{queue}"
BEAT_S = 10.0
TTL_S = 30.0
CACHE_S = 5.0

_cache: dict[tuple[str, str], tuple[float, bool | None]] = {}
_cache_lock = threading.Lock()
_clients: dict[str, Any] = {}


def _client(url: str) -> Any:
    client = _clients.get(url)
    if client is None:
        import redis

        client = _clients[url] = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
    return client


class ConsumerHeartbeat(PeriodicTask):
    """Keeps `worker` listed as a consumer of each queue `queues()` returns, from a daemon thread."""

    name = "queue-heartbeat"
    tick_at_start = True

    def __init__(self, redis_url: str, worker: str, queues: Callable[[], list[str]], *, interval_s: float = BEAT_S,
                 ttl_s: float = TTL_S) -> None:
        super().__init__(interval_s)
        self.url, self.worker, self.queues, self.ttl_s = redis_url, worker, queues, ttl_s
        self._listed: set[str] = set()

    def beat(self) -> None:
        now = time.time()
        current = set(self.queues())
        pipe = _client(self.url).pipeline()
        for queue in current:
            pipe.zadd(KEY.format(queue=queue), {self.worker: now + self.ttl_s})
            pipe.zremrangebyscore(KEY.format(queue=queue), "-inf", now)  # others' expired entries
        for queue in self._listed - current:  # a queue this worker stopped consuming (cancel_consumer)
            pipe.zrem(KEY.format(queue=queue), self.worker)
        pipe.execute()
        self._listed = current

    tick = beat  # Redis away for a moment: the entry expires, the next beat restores it

    def on_stop(self) -> None:
        try:
            pipe = _client(self.url).pipeline()
            for queue in self._listed:
                pipe.zrem(KEY.format(queue=queue), self.worker)
            pipe.execute()
        except Exception as exc:
            log.warning("could not remove the queue heartbeat: %s", exc)
        self._listed = set()


def queue_has_consumers(redis_url: str | None, queue: str, *, cache_s: float = CACHE_S) -> bool | None:
    """Whether some live worker consumes `queue`; None when that cannot be told (no Redis URL,
    Redis unreachable)."""
    if not redis_url or not redis_url.startswith(("redis://", "rediss://", "unix://")):
        return None
    now = time.monotonic()
    with _cache_lock:
        hit = _cache.get((redis_url, queue))
        if hit is not None and now - hit[0] < cache_s:
            return hit[1]
    try:
        live = _client(redis_url).zcount(KEY.format(queue=queue), time.time(), "+inf")
        answer: bool | None = live > 0
    except Exception as exc:
        log.warning("could not read queue consumers of %r: %s", queue, exc)
        answer = None
    with _cache_lock:
        _cache[(redis_url, queue)] = (now, answer)
    return answer


def waiting_message(queue: str, has_consumers: bool | None) -> str:
    """What a job record says while the job waits in `queue`."""
    if has_consumers is False:
        return f"waiting for a GPU worker (queue {queue} has no consumers)"
    if has_consumers:
        return f"queued for a GPU worker (queue {queue})"
    return f"waiting for a GPU worker (queue {queue})"
