"""fxport/periodic.py: the loop every background chore runs on (toolchain publisher, queue
heartbeat, cache sweeper, orphan sweeper)."""

from __future__ import annotations

import threading
import time

from fxport.periodic import PeriodicTask


class Counting(PeriodicTask):
    name = "counting"

    def __init__(self, interval_s: float, *, fail_first: int = 0, at_start: bool = False) -> None:
        super().__init__(interval_s)
        self.tick_at_start = at_start
        self.ticks, self.fail_first, self.stopped = 0, fail_first, 0
        self.ticked = threading.Event()

    def tick(self) -> None:
        self.ticks += 1
        if self.ticks <= self.fail_first:
            raise ConnectionError("store away")  # an outage: logged, the loop goes on
        self.ticked.set()

    def on_stop(self) -> None:
        self.stopped += 1


def test_a_failing_tick_does_not_end_the_loop_and_stop_runs_on_stop_once():
    task = Counting(0.01, fail_first=3).start()
    assert task.ticked.wait(5), "the loop ended after a failing tick"
    task.stop()
    assert task.ticks >= 4 and task.stopped == 1
    after = task.ticks
    time.sleep(0.05)
    assert task.ticks == after  # stopped means stopped


def test_first_tick_waits_one_interval_unless_tick_at_start():
    late, early = Counting(30), Counting(30, at_start=True)
    late.start(), early.start()
    assert early.ticked.wait(5)
    assert late.ticks == 0
    late.stop(), early.stop()  # a stop during the long wait returns at once
    assert late.ticks == 0 and early.ticks == 1
