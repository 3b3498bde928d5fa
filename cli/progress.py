"""The one progress display: `fxport convert` (the engine's events) and `submit --wait` /
`jobs watch` (a job's events) both draw through it.

On a terminal a rich bar per stage; otherwise plain lines for CI logs, one per stage start and
per message worth reading, worded alike for both commands: `[export] started`,
`[export] torchscript`. Never imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.console import Console

if TYPE_CHECKING:
    from fxport.client import ProgressEvent


class StageProgress:
    """Stage progress on `console`: a rich bar per stage on a terminal, plain lines otherwise.

    Call it with an engine event `{"stage", "progress", "message"}` (it is the engine's
    `on_progress` hook), or pass `on_job_event` as `Job.wait(on_event=...)`. `enabled=False`
    shows nothing."""

    def __init__(self, console: Console, enabled: bool = True) -> None:
        self.console, self.enabled = console, enabled
        self._bar: Any = None
        self._tasks: dict[str, Any] = {}
        self._last: tuple[str, str, str] | None = None  # the last job-event line: (state, stage, message)
        if enabled and console.is_terminal:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self._bar = Progress(TextColumn("{task.description:<9}"), BarColumn(), TextColumn("{task.fields[msg]}"),
                                 TimeElapsedColumn(), console=console)

    def __enter__(self) -> StageProgress:
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._bar is not None:
            self._bar.stop()

    # -- the two event kinds -----------------------------------------------------------

    def __call__(self, event: dict[str, Any]) -> None:
        self.on_engine_event(event)

    def on_engine_event(self, event: dict[str, Any]) -> None:
        """An in-process engine event: every stage starts at 0.0 and ends at 1.0 "done"."""
        if not self.enabled:
            return
        stage, frac, msg = event.get("stage", "?"), float(event.get("progress", 0)), event.get("message", "")
        if self._bar is None:
            if frac == 0.0 or msg not in ("", "done"):
                self._line(stage, msg or "started")
            return
        self._advance(stage, frac, msg)

    def on_job_event(self, ev: ProgressEvent) -> None:
        """A server job's event. The job store may repeat or coalesce events (a resumed watch
        replays the last one), so plain lines skip a repeat and a stage's empty or "done" message."""
        if not self.enabled:
            return
        if self._bar is not None and ev.state == "RUNNING" and ev.stage:
            self._advance(ev.stage, ev.progress, ev.message)
            return
        if self._bar is not None and ev.state != "RUNNING":
            if ev.terminal and ev.state == "SUCCEEDED":
                for task in self._tasks.values():
                    self._bar.update(task, completed=1.0)
            self.console.print(f"{ev.state.lower()}: {ev.message}", markup=False, highlight=False)
            return
        stage = ev.stage or ev.state.lower()
        key = (ev.state, stage, ev.message)
        if key == self._last or (ev.message in ("", "done") and self._last and self._last[1] == stage):
            return
        self._last = key
        self._line(stage, ev.message or ("started" if ev.state == "RUNNING" else ev.state.lower()))

    # -- drawing ---------------------------------------------------------------------------

    def _line(self, stage: str, text: str) -> None:
        self.console.print(f"[{stage}] {text}", markup=False, highlight=False)

    def _advance(self, stage: str, frac: float, msg: str) -> None:
        for name, task in self._tasks.items():  # a new stage means the earlier ones are done
            if name != stage:
                self._bar.update(task, completed=1.0)
        if stage not in self._tasks:
            self._tasks[stage] = self._bar.add_task(stage, total=1.0, msg="")
        self._bar.update(self._tasks[stage], completed=frac, msg=msg)
