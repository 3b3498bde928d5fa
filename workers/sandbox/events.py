"""The sandbox's events, read by the worker with a bound on everything.

The child writes JSON lines to a FIFO in its folder. The first line is its layer report, sent
before the model was opened (sandbox/child.py); every later line is a progress event
`{"stage", "progress", "message"}`. The model can write to that FIFO too, so the worker
believes only the first line about layers and checks every event: a line longer than
MAX_EVENT_BYTES, more than MAX_EVENTS events, or a line that is not such an event ends the
job with a named reason (`violation`). Messages are cut to MAX_MESSAGE_CHARS before they
reach the job store.
"""

from __future__ import annotations

import json
import os
import select
import threading
from collections.abc import Callable
from typing import Any

from fxport.jobs import STAGES
from fxport.text import printable

MAX_EVENT_BYTES = 4096
MAX_EVENTS = 10_000
MAX_MESSAGE_CHARS = 500


def check_event(line: bytes) -> dict[str, Any]:
    """A progress event from one line, or ValueError saying what is wrong with it."""
    try:
        event = json.loads(line)
    except ValueError:
        raise ValueError("a line that is not JSON") from None
    if not isinstance(event, dict) or set(event) - {"stage", "progress", "message"}:
        raise ValueError("a line that is not a progress event")
    stage, progress, message = event.get("stage"), event.get("progress", 0.0), event.get("message", "")
    if stage not in STAGES:
        raise ValueError(f"an event for an unknown stage {str(stage)[:40]!r}")
    if not isinstance(progress, (int, float)) or isinstance(progress, bool) or progress != progress:
        raise ValueError("an event whose progress is not a number")
    if not isinstance(message, str):
        raise ValueError("an event whose message is not a string")
    # a model can write escape sequences here (OSC 52 sets a clipboard): none reaches a terminal
    return {"stage": stage, "progress": min(1.0, max(0.0, float(progress))),
            "message": printable(message[:MAX_MESSAGE_CHARS])}


class EventPump:
    """Reads the events FIFO on a thread of its own until `stop()`.

    `on_layers(report)` gets the first line's layer report (or None when the first line is
    not one); `on_event(event)` every checked event after it. `violation` names the first
    broken rule; `violated` is set with it (the caller then kills the child)."""

    def __init__(self, fd: int, on_layers: Callable[[dict[str, Any] | None], None],
                 on_event: Callable[[dict[str, Any]], None]) -> None:
        self.fd, self.on_layers, self.on_event = fd, on_layers, on_event
        self.violation: str | None = None
        self.violated = threading.Event()
        self.count = 0
        self._first = True
        self._buffer = b""
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._run, name="sandbox-events", daemon=True)

    def start(self) -> EventPump:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Drain what the child left and stop (the child has exited or was killed)."""
        os.write(self._wake_w, b"x")
        self._thread.join(timeout=5)
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _read(self) -> bytes:
        try:
            return os.read(self.fd, 65536)
        except BlockingIOError:  # the worker's own O_RDWR end keeps the FIFO open: empty, never EOF
            return b""

    def _run(self) -> None:
        while self.violation is None:
            ready, _, _ = select.select([self.fd, self._wake_r], [], [], 1.0)
            if self.fd in ready and (chunk := self._read()):
                self._feed(chunk)
                continue
            if self._wake_r in ready:
                while self.violation is None and (chunk := self._read()):
                    self._feed(chunk)
                return

    def _feed(self, chunk: bytes) -> None:
        *lines, rest = (self._buffer + chunk).split(b"\n")
        for line in lines:
            if self.violation is not None:
                return
            self._line(line)
        if len(rest) > MAX_EVENT_BYTES:
            self._violate(f"an event line over {MAX_EVENT_BYTES} bytes")
            rest = b""
        self._buffer = rest

    def _line(self, line: bytes) -> None:
        if len(line) > MAX_EVENT_BYTES:
            return self._violate(f"an event line over {MAX_EVENT_BYTES} bytes")
        if self._first:
            self._first = False
            report = None
            try:
                data = json.loads(line)
                if isinstance(data, dict) and isinstance(data.get("sandbox"), dict):
                    report = data["sandbox"]
            except ValueError:
                pass
            self.on_layers(report)
            if report is not None:
                return
        self.count += 1
        if self.count > MAX_EVENTS:
            return self._violate(f"more than {MAX_EVENTS} progress events")
        try:
            event = check_event(line)
        except ValueError as exc:
            return self._violate(str(exc))
        self.on_event(event)

    def _violate(self, what: str) -> None:
        if self.violation is None:
            self.violation = what
            self.violated.set()
