"""The sandbox's event channel, read with every size bounded (workers/sandbox/events.py)."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from fxport.workers.sandbox.events import MAX_EVENT_BYTES, MAX_MESSAGE_CHARS, EventPump, check_event


class Channel:
    """A FIFO as run_engine_job makes it: the worker's end O_RDWR|O_NONBLOCK, the child's O_WRONLY."""

    def __init__(self, tmp_path: Path) -> None:
        path = tmp_path / "events"
        os.mkfifo(path, 0o600)
        self.read_fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)
        self.write_fd = os.open(path, os.O_WRONLY)
        self.layers: list[object] = []
        self.events: list[dict] = []
        self.got = threading.Event()
        self.pump = EventPump(self.read_fd, self.layers.append, self._event).start()

    def _event(self, event: dict) -> None:
        self.events.append(event)
        self.got.set()

    def send(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.write_fd, view):]

    def flood(self, data: bytes) -> None:
        """`send` from a thread until the reading end is closed under it (the child killed). Through a
        descriptor of its own: once close() has closed write_fd its number is reused (by the next
        test's channel), and a write still blocked here must not go on into that."""
        fd = os.dup(self.write_fd)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        except OSError:
            pass
        finally:
            os.close(fd)

    def close(self) -> None:
        if self.read_fd < 0:
            return
        self.pump.stop()
        os.close(self.write_fd)
        os.close(self.read_fd)  # the last reader: a flood blocked on a full pipe gets EPIPE and ends
        self.read_fd = self.write_fd = -1


@pytest.fixture()
def channel(tmp_path: Path):
    ch = Channel(tmp_path)
    yield ch
    ch.close()


def line(obj: object) -> bytes:
    return json.dumps(obj).encode() + b"\n"


def test_the_first_line_is_the_layer_report_and_later_ones_are_checked_events(channel):
    channel.send(line({"sandbox": {"no_new_processes": True}}))
    channel.send(line({"stage": "export", "progress": 0.5, "message": "x" * 2000}))
    assert channel.got.wait(10)
    assert channel.layers == [{"no_new_processes": True}]
    assert channel.events == [{"stage": "export", "progress": 0.5, "message": "x" * MAX_MESSAGE_CHARS}]
    channel.send(line({"sandbox": {"filesystem_reads_confined": True}}))  # a second report: the model's
    assert channel.pump.violated.wait(10)
    assert channel.pump.violation == "a line that is not a progress event"
    assert channel.layers == [{"no_new_processes": True}]


def test_an_oversized_line_is_a_violation_without_reading_it_all(channel):
    channel.send(line({"sandbox": {}}))
    writer = threading.Thread(target=channel.flood, args=(b"x" * (64 << 20),), daemon=True)  # no newline, ever
    writer.start()
    assert channel.pump.violated.wait(30)
    assert channel.pump.violation == f"an event line over {MAX_EVENT_BYTES} bytes"
    assert len(channel.pump._buffer) <= MAX_EVENT_BYTES
    channel.close()  # as the worker does: the blocked writer gets EPIPE, and ends before the next test
    writer.join(30)
    assert not writer.is_alive()


def test_a_first_line_that_is_no_report_counts_as_none(channel):
    channel.send(line({"stage": "load", "progress": 0.0, "message": ""}))
    assert channel.got.wait(10)
    assert channel.layers == [None]


@pytest.mark.parametrize("event, why", [
    (b"not json", "not JSON"),
    (line({"stage": "exfiltrate", "progress": 0}), "unknown stage"),
    (line({"stage": "load", "progress": "half"}), "progress is not a number"),
    (line({"stage": "load", "message": {"big": "object"}}), "message is not a string"),
    (line([1, 2, 3]), "not a progress event"),
])
def test_what_is_not_a_progress_event(event, why):
    with pytest.raises(ValueError, match=why):
        check_event(event.rstrip(b"\n"))
