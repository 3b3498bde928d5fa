"""What `Job.events` yields: `ProgressEvent`, one step of a job as the client sees it, and the
small readers of the server's messages it is built from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fxport.text import printable
from fxport.v1 import conversion_pb2 as pb

TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED")


def state_name(value: int) -> str:
    """A JobState enum value as its name without the prefix: "RUNNING"."""
    return pb.JobState.Name(value).removeprefix("JOB_STATE_")


def timestamp(msg: Any, field_name: str) -> float | None:
    """A Timestamp field of `msg` as Unix seconds; None when unset."""
    if not msg.HasField(field_name):
        return None
    return getattr(msg, field_name).ToNanoseconds() / 1e9


def artifact_dict(a: pb.Artifact) -> dict[str, Any]:
    return {"name": a.name, "format": a.format, "key": a.key, "bytes": a.bytes, "sha256": a.sha256}


@dataclass(frozen=True)
class ProgressEvent:
    """One step of a job: its state, stage and progress after a change (WatchJob's JobEvent)."""

    seq: int
    job_id: str
    state: str
    stage: str
    progress: float
    message: str
    time: float | None
    # An artifact the worker stored while the job still runs (not verified yet): Job.wait's
    # download_to fetches it at once and keeps it if the finished job lists the same sha256.
    staged: dict[str, Any] | None = None

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    @classmethod
    def from_pb(cls, ev: pb.JobEvent) -> ProgressEvent:
        return cls(seq=ev.seq, job_id=ev.job_id, state=state_name(ev.state), stage=printable(ev.stage),
                   progress=ev.progress, message=printable(ev.message), time=timestamp(ev, "time"),
                   staged=artifact_dict(ev.staged) if ev.HasField("staged") else None)

    def to_dict(self) -> dict[str, Any]:
        return {"seq": self.seq, "job_id": self.job_id, "state": self.state, "stage": self.stage,
                "progress": self.progress, "message": self.message, "time": self.time, "staged": self.staged}
