"""The one progress display: the plain lines (CI logs) for engine events and for job events."""

from __future__ import annotations

import io
from typing import Any

from rich.console import Console

from fxport.cli.progress import StageProgress
from fxport.client import ProgressEvent


def _plain() -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, force_terminal=False, width=200, highlight=False), buf


def _job(state: str, stage: str = "", progress: float = 0.0, message: str = "") -> ProgressEvent:
    return ProgressEvent(seq=0, job_id="j", state=state, stage=stage, progress=progress, message=message, time=None)


def _engine(stage: str, progress: float, message: str = "") -> dict[str, Any]:
    return {"stage": stage, "progress": progress, "message": message}


def test_engine_events_print_stage_starts_and_messages() -> None:
    console, buf = _plain()
    with StageProgress(console, enabled=True) as progress:
        for ev in (_engine("capture", 0.0), _engine("capture", 1.0, "done"),
                   _engine("export", 0.0), _engine("export", 0.0, "torchscript"), _engine("export", 0.5, "onnx"),
                   _engine("export", 0.5, ""), _engine("export", 1.0, "done"), _engine("verify", 0.0),
                   _engine("verify", 0.5, "[not markup]")):
            progress(ev)  # the engine's on_progress hook
    assert buf.getvalue().splitlines() == [
        "[capture] started", "[export] started", "[export] torchscript", "[export] onnx", "[verify] started",
        "[verify] [not markup]",
    ]


def test_disabled_shows_nothing() -> None:
    console, buf = _plain()
    progress = StageProgress(console, enabled=False)
    progress(_engine("capture", 0.0))
    progress.on_job_event(_job("RUNNING", "capture"))
    assert buf.getvalue() == ""


def test_job_events_print_the_same_words_once() -> None:
    console, buf = _plain()
    with StageProgress(console) as progress:
        for ev in (_job("QUEUED"), _job("QUEUED"),
                   _job("RUNNING", "capture"), _job("RUNNING", "capture"), _job("RUNNING", "capture", 1.0, "done"),
                   _job("RUNNING", "export", 0.0, "torchscript"), _job("RUNNING", "export", 0.5, "onnx"),
                   _job("RUNNING", "export", 0.5, "onnx"), _job("RUNNING", "export", 1.0, "done"),
                   _job("RUNNING", "verify", 0.5, "done"), _job("SUCCEEDED", "verify", 1.0, ""),
                   _job("SUCCEEDED")):
            progress.on_job_event(ev)
    assert buf.getvalue().splitlines() == [
        "[queued] queued", "[capture] started", "[export] torchscript", "[export] onnx", "[verify] done",
        "[succeeded] succeeded",  # not "[verify] succeeded": an empty message after its stage's line is skipped
    ]


def test_job_events_on_a_terminal_print_the_end_state() -> None:
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=120, highlight=False)
    with StageProgress(console) as progress:
        progress.on_job_event(_job("RUNNING", "export", 0.5, "onnx"))
        progress.on_job_event(_job("FAILED", "export", 0.5, "boom"))
    assert "failed: boom" in buf.getvalue()
    assert "[export]" not in buf.getvalue()  # running stages draw a bar, not a line
