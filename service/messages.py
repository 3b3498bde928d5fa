"""Job records and events ↔ fxport.v1 protobuf messages."""

from __future__ import annotations

import json

from google.protobuf.timestamp_pb2 import Timestamp

from fxport.jobs import JobEvent, JobRecord, JobState
from fxport.v1 import conversion_pb2 as pb

STATE_TO_PROTO = {
    JobState.QUEUED: pb.JOB_STATE_QUEUED,
    JobState.RUNNING: pb.JOB_STATE_RUNNING,
    JobState.SUCCEEDED: pb.JOB_STATE_SUCCEEDED,
    JobState.FAILED: pb.JOB_STATE_FAILED,
    JobState.CANCELLED: pb.JOB_STATE_CANCELLED,
}
STATE_FROM_PROTO = {v: k for k, v in STATE_TO_PROTO.items()}


def timestamp(seconds: float | None) -> Timestamp | None:
    if seconds is None:
        return None
    ts = Timestamp()
    ts.FromNanoseconds(int(seconds * 1e9))
    return ts


def job_to_proto(rec: JobRecord) -> pb.Job:
    msg = pb.Job(
        id=rec.id, tenant=rec.tenant, state=STATE_TO_PROTO[rec.state], stage=rec.stage or "",
        progress=rec.progress, message=rec.message,
        spec_json=json.dumps(rec.spec.normalized(), sort_keys=True, separators=(",", ":")), spec_digest=rec.spec_digest,
        labels=rec.labels, cache_hit=rec.cache_hit, worker=rec.worker or "", attempts=rec.attempts,
        idempotency_key=rec.idempotency_key or "", last_seq=rec.last_seq,
        model=pb.InputRef(sha256=rec.model.sha256, bytes=rec.model.bytes, filename=rec.model.filename,
                          key=rec.model.key),
    )
    if rec.calibration is not None:
        c = rec.calibration
        msg.calibration.CopyFrom(pb.InputRef(sha256=c.sha256, bytes=c.bytes, filename=c.filename, key=c.key))
    for a in rec.artifacts:
        msg.artifacts.add(name=a.name, format=a.format, key=a.key, bytes=a.bytes, sha256=a.sha256)
    for a in rec.staged:
        msg.staged_artifacts.add(name=a.name, format=a.format, key=a.key, bytes=a.bytes, sha256=a.sha256)
    if rec.error is not None:
        e = rec.error
        msg.error.CopyFrom(pb.JobError(stage=e.stage or "", code=e.code, message=e.message, detail=e.detail or "",
                                       field=e.field or ""))
    for field in ("created_at", "updated_at", "started_at", "finished_at"):
        ts = timestamp(getattr(rec, field))
        if ts is not None:
            getattr(msg, field).CopyFrom(ts)
    for stage, timing in rec.stage_timings.items():
        st = msg.stage_timings.add(stage=stage)
        if timing.started_at is not None:
            st.started_at.CopyFrom(timestamp(timing.started_at))
        if timing.finished_at is not None:
            st.finished_at.CopyFrom(timestamp(timing.finished_at))
    return msg


def event_to_proto(ev: JobEvent, job: JobRecord | None = None) -> pb.JobEvent:
    msg = pb.JobEvent(seq=ev.seq, job_id=ev.job_id, state=STATE_TO_PROTO[ev.state], stage=ev.stage or "",
                      progress=ev.progress, message=ev.message)
    msg.time.CopyFrom(timestamp(ev.time))
    if ev.staged is not None:
        a = ev.staged
        msg.staged.CopyFrom(pb.Artifact(name=a.name, format=a.format, key=a.key, bytes=a.bytes, sha256=a.sha256))
    if job is not None:
        msg.job.CopyFrom(job_to_proto(job))
    return msg
