"""One background loop for the service's periodic chores: a daemon thread that calls `tick()`
every `interval_s` until `stop()`. A failing tick is logged and the next one runs (a Redis or
object-store outage must not end the loop). Used by the toolchain publisher, the queue
heartbeat, the cache sweeper, the orphan sweeper and the retention sweeper."""

from __future__ import annotations

import logging
import threading
from typing import Self

log = logging.getLogger(__name__)


class PeriodicTask:
    """Subclasses set `name`, implement `tick()`, and may add `on_stop()` (runs once, after
    the thread has ended). `tick_at_start`: the first tick runs at once, not after one interval."""

    name = "periodic"
    tick_at_start = False

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._wake = threading.Event()  # set by stop() and wake()
        self._thread: threading.Thread | None = None

    def tick(self) -> None:
        raise NotImplementedError

    def on_stop(self) -> None:
        pass

    def start(self) -> Self:
        self._thread = threading.Thread(target=self._run, name=f"fxport-{self.name}", daemon=True)
        self._thread.start()
        return self

    def wake(self) -> None:
        """Run the next tick now instead of at the end of the interval."""
        self._wake.set()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout=timeout_s)
        self.on_stop()

    def _sleep(self) -> bool:
        """Wait out the interval or a wake(); True once stopped."""
        self._wake.wait(self.interval_s)
        self._wake.clear()
        return self._stop.is_set()

    def _run(self) -> None:
        if not self.tick_at_start and self._sleep():
            return
        while True:
            try:
                self.tick()
            except Exception as exc:
                log.warning("%s failed (next try in %.0f s): %s", self.name, self.interval_s, exc)
            if self._sleep():
                return
