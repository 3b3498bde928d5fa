"""The job records: what the job store keeps about a job, and the small values around it.

`JobRecord` is one job; `JobEvent` one step of its history (what WatchJob streams);
`StoredArtifact` an artifact the job stored (its manifest's own record of an artifact is
fxport.manifest.ArtifactRecord). Also here: the job states, the stages a job runs through
(`Stage`, `STAGES`), job ids, and page tokens. (The queues a job waits in: fxport/task_queue.py.)
How a record changes is fxport/jobs/transitions.py; where it is kept, fxport/jobs/store.py.
"""

from __future__ import annotations

import base64
import json
import os
import time
from dataclasses import dataclass
from enum import Enum
from typing import Any

from pydantic import BaseModel, Field, field_serializer

from fxport.errors import ErrorRecord
from fxport.spec import TRUSTED, JobSpec
from fxport.storage.keys import JOB_ID_RE


class JobState(str, Enum):
    QUEUED = "QUEUED"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_STATES


TERMINAL_STATES = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})
IN_FLIGHT_STATES = frozenset({JobState.QUEUED, JobState.RUNNING})
KEEP_FOREVER = 1e12  # an input ledger entry's keep_until when inputs are kept for good (year 33658)


class Stage(str, Enum):
    """The stages a job runs through, in this order (JobRecord.stage holds the value). `tensorrt`
    runs as a task of its own, on queue "gpu"; `upload` is the worker storing the artifacts."""

    LOAD = "load"
    CAPTURE = "capture"
    PASSES = "passes"
    QUANTIZE = "quantize"
    EXPORT = "export"
    VERIFY = "verify"
    BENCHMARK = "benchmark"
    PACKAGE = "package"
    TENSORRT = "tensorrt"
    UPLOAD = "upload"


STAGES: tuple[str, ...] = tuple(stage.value for stage in Stage)


class InputRef(BaseModel):
    sha256: str
    bytes: int
    filename: str = ""
    key: str


class StoredArtifact(BaseModel):
    """An artifact a job stored: its name, format, object key, size and sha256."""

    name: str
    format: str
    key: str
    bytes: int
    sha256: str


class StageTiming(BaseModel):
    started_at: float | None = None
    finished_at: float | None = None


class JobRecord(BaseModel):
    """One job (docs/architecture.md). Times are Unix seconds."""

    id: str
    tenant: str
    state: JobState = JobState.QUEUED
    stage: str | None = None
    progress: float = 0.0
    message: str = ""
    spec: JobSpec = Field(default_factory=JobSpec, description="The validated spec (stored normalized).")
    spec_digest: str = ""
    labels: dict[str, str] = Field(default_factory=dict)
    model: InputRef
    calibration: InputRef | None = None
    artifacts: list[StoredArtifact] = Field(default_factory=list)
    staged: list[StoredArtifact] = Field(
        default_factory=list,
        description="Artifacts stored while the job runs, before verification ended (latest copy of each name); "
                    "cleared whenever the job leaves RUNNING or starts a new attempt.")
    error: ErrorRecord | None = None
    created_at: float = Field(default_factory=time.time)
    updated_at: float = Field(default_factory=time.time)
    started_at: float | None = None
    finished_at: float | None = None
    stage_timings: dict[str, StageTiming] = Field(default_factory=dict)
    cache_hit: bool = False
    worker: str | None = None
    attempts: int = 0
    idempotency_key: str | None = None
    task_id: str | None = None
    last_seq: int = 0
    artifacts_of: str | None = Field(
        None, description="A cache hit: the job whose artifacts it shares. They are kept while any job sharing "
                          "them is (JobStore.remove).")
    trace_context: dict[str, str] | None = Field(
        None, description="The submit's trace (W3C traceparent), which every worker that runs the job continues "
                          "(fxport/tracing.py); None when tracing is off.")

    @field_serializer("spec")
    def _spec_as_normalized(self, spec: JobSpec) -> dict[str, Any]:
        return spec.normalized()  # the form the spec digest and the cache key are computed from

    @classmethod
    def from_json(cls, raw: str | bytes) -> JobRecord:
        """A record read back from the job store: its spec passed the API's checks when the job
        was submitted, so it is decoded, not checked again (fxport.spec.TRUSTED)."""
        return cls.model_validate_json(raw, context=TRUSTED)

    @property
    def terminal(self) -> bool:
        return self.state.terminal


class JobEvent(BaseModel):
    """One step of a job's history: the record as a change left it (what WatchJob streams).
    `seq` numbers a job's events from 1, without gaps."""

    seq: int
    job_id: str
    time: float
    state: JobState
    stage: str | None = None
    progress: float = 0.0
    message: str = ""
    # Which delivery of the job wrote this event: a job's events show each attempt's start
    # and its end, and never one attempt's events after the next attempt started.
    attempt: int = 0
    worker: str | None = None
    staged: StoredArtifact | None = None  # this event is an artifact stored early (JobRecord.staged)

    @property
    def terminal(self) -> bool:
        return self.state.terminal


@dataclass(frozen=True)
class InputAdmission:
    """JobStore.reserve_input's answer: whether the input is counted, and the tenant's total after."""

    admitted: bool
    used_bytes: int


class IdempotencyConflict(Exception):
    """The idempotency key names an earlier job submitted with a different model or spec."""

    def __init__(self, existing: JobRecord) -> None:
        super().__init__(
            f"idempotency key {existing.idempotency_key!r} was used for job {existing.id} "
            "with a different model or spec; use a new key"
        )
        self.existing = existing


_CROCKFORD = "0123456789abcdefghjkmnpqrstvwxyz"


class SharedArtifactsGone(Exception):
    """A cache hit's source job was removed (retention) between the lookup and the new record:
    its artifacts are going, so the submit is converted instead."""


def job_id_time(job_id: str) -> float | None:
    """The creation time (Unix seconds) a job id carries (see new_job_id); None for a malformed id."""
    if len(job_id) != 26 or not all(c in _CROCKFORD for c in job_id):
        return None
    value = 0
    for c in job_id:
        value = (value << 5) | _CROCKFORD.index(c)
    return (value >> 80) / 1000.0


def new_job_id(now: float | None = None) -> str:
    """A lowercase ULID: 48-bit milliseconds + 80 random bits. Sorts by creation time."""
    ms = int((time.time() if now is None else now) * 1000)
    value = (ms << 80) | int.from_bytes(os.urandom(10), "big")
    out = []
    for _ in range(26):
        out.append(_CROCKFORD[value & 31])
        value >>= 5
    return "".join(reversed(out))


def encode_page_token(job_id: str) -> str:
    """The token of the page that starts below `job_id` (decode_page_token reads it back)."""
    return base64.urlsafe_b64encode(json.dumps({"before": job_id}).encode()).decode().rstrip("=")


def decode_page_token(token: str | None) -> str | None:
    """The job id a page starts below; ValueError for a token this server did not make."""
    if not token:
        return None
    try:
        data = json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
        before = data["before"]
    except (ValueError, KeyError, TypeError):
        raise ValueError("invalid page_token: pass back next_page_token unchanged") from None
    if not isinstance(before, str) or not JOB_ID_RE.match(before):
        raise ValueError("invalid page_token: pass back next_page_token unchanged")
    return before

