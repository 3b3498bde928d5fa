"""Jobs: their records, the state machine, and the job store on Redis or SQLite.

One module per concern:
- records.py: JobRecord, JobEvent, StoredArtifact, JobState, Stage/STAGES, job ids,
  page tokens;
- transitions.py: `apply_update`, the one place the state machine lives, and `event_for`;
- store.py: the `JobStore` interface (create, get, list, transition, events, leases,
  retention, the input ledger);
- redis_store.py (distributed) and sqlite_store.py (embedded): its two backends;
  backends.py: `open_job_store`, which picks one from a URL;
- orphans.py: the sweep that requeues RUNNING jobs whose worker died.

Import from here: `from fxport.jobs import JobRecord, open_job_store`.
"""

from fxport.jobs.backends import open_job_store
from fxport.jobs.orphans import MAX_ATTEMPTS, SWEEPER_LEASE, SweepResult, sweep_orphans
from fxport.jobs.records import (
    IN_FLIGHT_STATES,
    KEEP_FOREVER,
    STAGES,
    TERMINAL_STATES,
    IdempotencyConflict,
    InputAdmission,
    InputRef,
    JobEvent,
    JobRecord,
    JobState,
    SharedArtifactsGone,
    Stage,
    StageTiming,
    StoredArtifact,
    decode_page_token,
    encode_page_token,
    job_id_time,
    new_job_id,
)
from fxport.jobs.redis_store import RedisJobStore
from fxport.jobs.sqlite_store import SqliteJobStore
from fxport.jobs.store import JobStore
from fxport.jobs.transitions import apply_update, event_for

__all__ = [
    "IN_FLIGHT_STATES", "KEEP_FOREVER", "MAX_ATTEMPTS", "STAGES", "SWEEPER_LEASE", "TERMINAL_STATES",
    "IdempotencyConflict", "InputAdmission", "InputRef", "JobEvent", "JobRecord", "JobState",
    "JobStore", "RedisJobStore", "SharedArtifactsGone", "SqliteJobStore", "Stage", "StageTiming", "StoredArtifact",
    "SweepResult", "apply_update", "decode_page_token", "encode_page_token", "event_for", "job_id_time",
    "new_job_id", "open_job_store", "sweep_orphans",
]
