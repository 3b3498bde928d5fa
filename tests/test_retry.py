"""fxport.retry: the one retry policy (backoff, deadline, which failures, retry-after), on a fake clock."""

from __future__ import annotations

import pytest

from fxport.retry import Backoff, retry_call

STEADY = Backoff(first_s=0.2, max_s=5.0, jitter=0.0)


class FakeTime:
    """A clock that moves only when slept on; `sleeps` records each pause."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


class Flaky:
    """Fails with `error` `failures` times, then returns "done"."""

    def __init__(self, failures: int, error: type[Exception] = ConnectionError) -> None:
        self.failures, self.error, self.calls = failures, error, 0

    def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error(f"failure {self.calls}")
        return "done"


def run(fn, fake: FakeTime, **kw):
    kw.setdefault("backoff", STEADY)
    return retry_call(fn, sleep=fake.sleep, clock=fake.clock, **kw)


def test_backoff_doubles_up_to_its_cap_and_jitters_within_its_band():
    assert [STEADY.delay(n) for n in range(1, 8)] == [0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0]
    assert STEADY.delay(10_000) == 5.0  # no overflow however long it retried
    jittery = Backoff(first_s=1.0, max_s=1.0, jitter=0.2)
    pauses = [jittery.pause(1) for _ in range(200)]
    assert all(0.8 <= p <= 1.2 for p in pauses) and len(set(pauses)) > 1


def test_a_call_that_succeeds_runs_once_and_never_sleeps():
    fake = FakeTime()
    assert run(Flaky(0), fake, retry_if=ConnectionError, deadline_s=10) == "done"
    assert fake.sleeps == []


def test_it_retries_with_growing_pauses_until_the_call_succeeds():
    fake, fn = FakeTime(), Flaky(3)
    assert run(fn, fake, retry_if=ConnectionError, deadline_s=10) == "done"
    assert fn.calls == 4 and fake.sleeps == [0.2, 0.4, 0.8]


def test_max_attempts_counts_every_attempt_and_raises_the_last_failure():
    fake, fn = FakeTime(), Flaky(10)
    with pytest.raises(ConnectionError, match="failure 3"):
        run(fn, fake, retry_if=ConnectionError, max_attempts=3)
    assert fn.calls == 3 and fake.sleeps == [0.2, 0.4]


def test_no_attempt_starts_once_its_pause_would_pass_the_deadline():
    fake, fn = FakeTime(), Flaky(100)
    with pytest.raises(ConnectionError):
        run(fn, fake, retry_if=ConnectionError, deadline_s=1.0)
    # 0.2 + 0.4 = 0.6 s slept; the next pause (0.8 s) would end at 1.4 s, past 1.0 s.
    assert fn.calls == 3 and fake.sleeps == [0.2, 0.4] and fake.now <= 1.0


def test_a_zero_budget_means_one_attempt():
    fake, fn = FakeTime(), Flaky(1)
    with pytest.raises(ConnectionError):
        run(fn, fake, retry_if=ConnectionError, deadline_s=0.0)
    assert fn.calls == 1 and fake.sleeps == []


def test_the_deadline_may_depend_on_the_failure():
    class Patient(Exception):
        pass

    def budget(exc: BaseException) -> float:
        return 100.0 if isinstance(exc, Patient) else 0.5

    fake, fn = FakeTime(), Flaky(100, Patient)
    with pytest.raises(Patient):
        run(fn, fake, retry_if=Exception, deadline_s=budget, max_attempts=6)
    assert fn.calls == 6
    fake, fn = FakeTime(), Flaky(100, ConnectionError)
    with pytest.raises(ConnectionError):
        run(fn, fake, retry_if=Exception, deadline_s=budget)
    assert fn.calls == 2  # 0.2 s fits the 0.5 s budget, 0.2 + 0.4 s does not


def test_a_failure_not_worth_retrying_is_raised_at_once_unchanged():
    fake, fn = FakeTime(), Flaky(5, ValueError)
    gave_up = []
    with pytest.raises(ValueError, match="failure 1"):
        run(fn, fake, retry_if=ConnectionError, deadline_s=60,
            on_give_up=lambda exc, attempts, elapsed: gave_up.append(exc))
    assert fn.calls == 1 and fake.sleeps == [] and gave_up == []


def test_retry_if_may_be_a_test_of_the_exception():
    fake, fn = FakeTime(), Flaky(2, OSError)
    assert run(fn, fake, retry_if=lambda exc: "failure" in str(exc), deadline_s=10) == "done"
    fake, fn = FakeTime(), Flaky(2, OSError)
    with pytest.raises(OSError):
        run(fn, fake, retry_if=lambda exc: False, deadline_s=10)
    assert fn.calls == 1


def test_retry_after_from_the_failure_replaces_the_backoff_pause():
    class Refused(Exception):
        def __init__(self, message: str, wait: float | None = 3.0) -> None:
            super().__init__(message)
            self.wait = wait

    fake, fn = FakeTime(), Flaky(2, Refused)
    assert run(fn, fake, retry_if=Refused, deadline_s=60, retry_after=lambda exc: getattr(exc, "wait", None)) == "done"
    assert fake.sleeps == [3.0, 3.0]
    # None: the backoff's own pause
    fake, fn = FakeTime(), Flaky(2, Refused)
    assert run(fn, fake, retry_if=Refused, deadline_s=60, retry_after=lambda exc: None) == "done"
    assert fake.sleeps == [0.2, 0.4]


def test_a_retry_after_past_the_deadline_gives_up_at_once():
    fake, fn = FakeTime(), Flaky(5)
    with pytest.raises(ConnectionError):
        run(fn, fake, retry_if=ConnectionError, deadline_s=10, retry_after=lambda exc: 30.0)
    assert fn.calls == 1 and fake.sleeps == []


def test_on_give_up_replaces_the_last_failure_and_chains_it():
    class Unreachable(Exception):
        pass

    fake, fn = FakeTime(), Flaky(100)
    seen = []
    with pytest.raises(Unreachable, match="after 3 attempts over 0.6 s") as err:
        run(fn, fake, retry_if=ConnectionError, max_attempts=3,
            on_retry=lambda exc, attempt, pause: seen.append((attempt, pause)),
            on_give_up=lambda exc, attempts, elapsed: Unreachable(f"after {attempts} attempts over {elapsed:.1f} s"))
    assert isinstance(err.value.__cause__, ConnectionError)
    assert seen == [(1, 0.2), (2, 0.4)]


def test_on_give_up_returning_none_raises_the_failure_itself():
    fake = FakeTime()
    with pytest.raises(ConnectionError, match="failure 2"):
        run(Flaky(5), fake, retry_if=ConnectionError, max_attempts=2, on_give_up=lambda *a: None)
