"""Retrying a call that failed for a passing reason: exponential backoff with jitter, within a deadline.

The one retry policy of fxport. Its users:
- the object store (fxport/storage/s3_store.py): connection failures and 5xx answers, for
  FXPORT_STORE_RETRY_S per operation;
- the Redis job store (fxport/jobs/redis_retry.py): each command, while Redis is unreachable,
  for the store's `retry_s`;
- the client (client/client.py): UNAVAILABLE and "busy" answers, and a full queue for as long
  as the server's `retry-after` and `queue_wait_s` say;
- the embedded worker pool (workers/embedded.py): a job whose store failed for a moment;
- the Celery tasks (workers/tasks.py): the countdown before such a job is delivered again.

`retry_call` runs a callable until it returns, raises something not worth retrying (raised at
once, unchanged), or the budget ends (the last failure is raised, or what `on_give_up` makes
of it). The budget is a deadline, counted from the first attempt, and/or a number of attempts:
no attempt starts once the pause before it would pass the deadline.

No dependencies: the thin client imports it.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

__all__ = ["Backoff", "RetryIf", "retry_call"]

_T = TypeVar("_T")

RetryIf = type[BaseException] | tuple[type[BaseException], ...] | Callable[[BaseException], bool]
"""Which failures are retried: exception classes, or a test of the exception."""


@dataclass(frozen=True)
class Backoff:
    """The pause before each retry: `first_s`, then `factor` times the previous, at most `max_s`;
    each scaled by a random factor in [1 - jitter, 1 + jitter], so that clients failing together
    do not all come back together."""

    first_s: float = 0.2
    max_s: float = 5.0
    factor: float = 2.0
    jitter: float = 0.2

    def delay(self, retry: int) -> float:
        """The pause before retry number `retry` (1: the first), before jitter."""
        exponent = min(max(0, retry - 1), 64)  # past the cap long before; keeps the power finite
        return float(min(self.max_s, self.first_s * self.factor**exponent))

    def jittered(self, seconds: float) -> float:
        """`seconds` scaled by this backoff's random factor."""
        if not self.jitter:
            return seconds
        return seconds * random.uniform(1.0 - self.jitter, 1.0 + self.jitter)

    def pause(self, retry: int) -> float:
        """The pause before retry number `retry`, jitter included."""
        return self.jittered(self.delay(retry))


def _matches(retry_if: RetryIf, exc: BaseException) -> bool:
    if isinstance(retry_if, type) or isinstance(retry_if, tuple):
        return isinstance(exc, retry_if)
    return retry_if(exc)


def retry_call(
    fn: Callable[[], _T],
    *,
    retry_if: RetryIf,
    deadline_s: float | Callable[[BaseException], float] | None = None,
    max_attempts: int | None = None,
    backoff: Backoff = Backoff(),
    retry_after: Callable[[BaseException], float | None] | None = None,
    on_retry: Callable[[BaseException, int, float], None] | None = None,
    on_give_up: Callable[[BaseException, int, float], BaseException | None] | None = None,
    sleep: Callable[[float], object] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> _T:
    """`fn()`, again after a pause each time it raises an exception `retry_if` accepts.

    `deadline_s`: seconds from the first attempt after which no attempt starts (the pause taken,
    jitter included, counts against it); a callable gets the failure, for budgets that depend on
    it. None: no deadline. `max_attempts`: attempts in all (None: no limit).
    `retry_after`: the pause a failure asks for (a server's `retry-after`), used instead of the
    backoff's when it gives one; jittered the same way.
    `on_retry(exc, attempt, pause)`: before each pause (for a log line). `on_give_up(exc,
    attempts, elapsed_s)`: when the budget is spent, the exception to raise instead of `exc`
    (chained from it), or None to raise `exc`. A failure `retry_if` refuses is raised at once.
    """
    started = clock()
    attempt = 0
    while True:
        attempt += 1
        try:
            return fn()
        except Exception as exc:
            if not _matches(retry_if, exc):
                raise
            asked = retry_after(exc) if retry_after is not None else None
            pause = backoff.jittered(asked) if asked is not None else backoff.pause(attempt)
            elapsed = clock() - started
            budget = deadline_s(exc) if callable(deadline_s) else deadline_s
            if (max_attempts is not None and attempt >= max_attempts) or \
                    (budget is not None and elapsed + pause > budget):
                replacement = on_give_up(exc, attempt, elapsed) if on_give_up is not None else None
                if replacement is None:
                    raise
                raise replacement from exc
            if on_retry is not None:
                on_retry(exc, attempt, pause)
            sleep(pause)
