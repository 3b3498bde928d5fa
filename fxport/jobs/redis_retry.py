"""redis-py's retry hook, run by fxport's retry policy (fxport/retry.py).

redis-py retries a command (and each reconnect) through the `Retry` object it was given, which
counts tries. `DeadlineRetry` keeps redis-py's part (which errors, the failure callback that
drops the broken connection) and lets `retry_call` decide when to try again: with fxport's
backoff, until the store's `retry_s` is spent.

Imported only by RedisJobStore, when one is made: it imports redis.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from redis.backoff import NoBackoff
from redis.retry import Retry

from fxport.retry import Backoff, retry_call

_T = TypeVar("_T")

# 0.1 s, doubling, at most 1 s between tries: a Redis that restarts answers again within seconds.
REDIS_BACKOFF = Backoff(first_s=0.1, max_s=1.0)


class DeadlineRetry(Retry):
    """Retry a Redis command for `budget_s` seconds (0: never) while it fails with `errors`."""

    def __init__(self, budget_s: float, errors: tuple[type[Exception], ...]) -> None:
        # The count redis-py reports in its own metrics: about how many tries fit the budget.
        tries = 0 if budget_s <= 0 else max(1, int(budget_s / 0.8))
        super().__init__(NoBackoff(), tries, supported_errors=errors)
        self.budget_s = max(0.0, float(budget_s))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DeadlineRetry) and self.budget_s == other.budget_s and super().__eq__(other)

    __hash__ = Retry.__hash__

    def call_with_retry(self, do: Callable[[], _T], fail: Callable[..., Any],
                        is_retryable: Callable[[Exception], bool] | None = None,
                        with_failure_count: bool = False) -> _T:
        failures = 0

        def attempt() -> _T:
            nonlocal failures
            try:
                return do()
            except self._supported_errors as error:
                failures += 1  # redis-py's callback: drop the connection (the next try reconnects)
                if with_failure_count:
                    fail(error, failures)
                else:
                    fail(error)
                raise

        def retryable(exc: BaseException) -> bool:
            checks = (getattr(self, "_is_retryable", None), is_retryable)
            return isinstance(exc, self._supported_errors) and all(check(exc) for check in checks if check)

        return retry_call(attempt, retry_if=retryable, deadline_s=self.budget_s, backoff=REDIS_BACKOFF)
