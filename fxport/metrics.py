"""Prometheus metrics of the API server and the workers: every metric is defined here, once.

Importing this module only registers the metrics (no thread, no port); a process that
wants them scraped calls `start_metrics_server(port)` (FXPORT_METRICS_PORT). The names,
labels and label values are the operator contract listed in deploy/README.md: add, never
rename.

Celery's prefork pool records from child processes, which a plain in-memory registry would
never show on the parent's port. With PROMETHEUS_MULTIPROC_DIR set (the worker manifests
set it to an emptyDir), prometheus_client keeps values in files there and
`start_metrics_server` serves the sum over all processes. The worker's main process calls
`reset_multiprocess_dir()` before it forks its pool, and `mark_process_dead(pid)` when a
pool child exits (Celery's `worker_process_shutdown` signal).

Besides fxport's own metrics, the API serves the gRPC server metrics every gRPC service
exposes under the names of go-grpc-prometheus (`grpc_server_started_total`,
`grpc_server_handled_total`, `grpc_server_handling_seconds`), so the dashboards and alerts
written for those work unchanged; service/interceptors.py records them.

Needs the `[server]` extra (prometheus-client); the thin client never imports it.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import platform
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, multiprocess, start_http_server

from fxport.jobs import STAGES, JobState
from fxport.task_queue import QUEUES

log = logging.getLogger(__name__)

# Label values, written out so every series exists (at 0) from the first scrape: rate()
# and absent() work before the first job, and a typo in a caller shows up as a new series.
# The states, stages and queues themselves are defined once, in fxport.jobs and fxport.task_queue.
JOB_STATES = tuple(state.value.lower() for state in JobState)  # queued, running, succeeded, failed, cancelled
TERMINAL_STATE_LABELS = tuple(state.value.lower() for state in JobState if state.terminal)
UPLOAD_KINDS = ("model", "calibration")
# Why a sandbox child did not hand back a valid result. Anything else is counted as
# "other" so a free-form error text can never explode the label's cardinality.
SANDBOX_FAILURE_REASONS = (
    "timeout",  # wall-clock watchdog killed it
    "cpu_time",  # RLIMIT_CPU
    "memory",  # RLIMIT_AS / MemoryError / OOM-killed
    "file_size",  # RLIMIT_FSIZE
    "signal",  # died from another signal (segfault, abort)
    "exit_code",  # exited non-zero without a recognised cause
    "invalid_output",  # exited 0 but its result files failed validation
    "other",
)

# Why a job FAILED (ErrorRecord.code): fxport/errors.py, fxport/storage/errors.py and the worker's
# own. A code outside this list is counted as "other", a stage outside FAILURE_STAGES as
# "unknown": the labels stay bounded whatever a record says.
FAILURE_CODES = (
    "invalid_input", "invalid_spec", "unsupported_format", "capture_failed", "conversion_failed",
    "verification_failed", "resource_limit", "sandbox_violation", "sandbox_unavailable", "timeout",
    "worker_lost", "internal", "storage", "not_found", "store_unreachable", "integrity", "invalid_key",
    "lease_lost", "enqueue_failed", "no_gpu_queue", "missing_input", "other",
)
FAILURE_STAGES = ("submit", *STAGES, "unknown")

# gRPC server metrics: go-grpc-prometheus's names, labels and label values, so that existing
# dashboards and alerts apply. grpc_type is one of these; grpc_code is the canonical status
# name in its CamelCase spelling (Go's codes.Code.String()).
GRPC_TYPES = ("unary", "client_stream", "server_stream", "bidi_stream")
GRPC_CODES = {
    "OK": "OK", "CANCELLED": "Canceled", "UNKNOWN": "Unknown", "INVALID_ARGUMENT": "InvalidArgument",
    "DEADLINE_EXCEEDED": "DeadlineExceeded", "NOT_FOUND": "NotFound", "ALREADY_EXISTS": "AlreadyExists",
    "PERMISSION_DENIED": "PermissionDenied", "RESOURCE_EXHAUSTED": "ResourceExhausted",
    "FAILED_PRECONDITION": "FailedPrecondition", "ABORTED": "Aborted", "OUT_OF_RANGE": "OutOfRange",
    "UNIMPLEMENTED": "Unimplemented", "INTERNAL": "Internal", "UNAVAILABLE": "Unavailable",
    "DATA_LOSS": "DataLoss", "UNAUTHENTICATED": "Unauthenticated",
}
# Seconds: unary calls take milliseconds, uploads and downloads seconds to minutes, and a
# WatchJob stream lasts as long as its job.
RPC_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800)

# Seconds. Stages run from milliseconds (fx_source) to tens of minutes (TensorRT builds).
STAGE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600)
JOB_BUCKETS = (1, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 2700, 3600, 7200)


@dataclass(frozen=True)
class FxportMetrics:
    """The metric objects of one registry. Use the module-level `METRICS` in the app."""

    jobs_total: Counter
    jobs_running: Gauge
    queue_depth: Gauge
    stage_duration_seconds: Histogram
    job_duration_seconds: Histogram
    cache_hits_total: Counter
    cache_misses_total: Counter
    cache_entry_reads_total: Counter
    sandbox_failures_total: Counter
    busy_refusals_total: Counter
    jobs_removed_total: Counter
    inputs_removed_total: Counter
    input_quota_refusals_total: Counter
    upload_bytes_total: Counter
    direct_upload_bytes_total: Counter
    job_failures_total: Counter
    build_info: Gauge
    grpc_server_started_total: Counter
    grpc_server_handled_total: Counter
    grpc_server_handling_seconds: Histogram

    def record_sandbox_failure(self, reason: str) -> None:
        """Count one sandbox failure; a reason outside SANDBOX_FAILURE_REASONS counts as "other"."""
        self.sandbox_failures_total.labels(reason if reason in SANDBOX_FAILURE_REASONS else "other").inc()

    def record_job_failure(self, stage: str | None, code: str | None) -> None:
        """Count one FAILED job by the stage and code of its error (bounded: see FAILURE_CODES)."""
        self.job_failures_total.labels(stage if stage in FAILURE_STAGES else "unknown",
                                       code if code in FAILURE_CODES else "other").inc()

    @contextlib.contextmanager
    def job_running(self, queue: str) -> Iterator[None]:
        """fxport_jobs_running{queue} is one higher while the block runs (a job's execution)."""
        if queue not in QUEUES:
            raise ValueError(f"queue {queue!r}: one of {QUEUES}")
        gauge = self.jobs_running.labels(queue)
        gauge.inc()
        try:
            yield
        finally:
            gauge.dec()

    def set_build_info(self, versions: dict[str, str] | None = None) -> dict[str, str]:
        """fxport_build_info{version, python, torch} = 1. torch's version comes from its package
        metadata, never from importing it (the API image has no torch: the label is then "")."""
        info = versions or build_versions()
        self.build_info.labels(info["version"], info["python"], info["torch"]).set(1)
        return info

    def init_rpc_methods(self, services: Iterable[Any]) -> None:
        """Create every method's series (at 0) from the services' descriptors, as
        go-grpc-prometheus's InitializeMetrics does, except that grpc_server_handled_total
        starts with grpc_code="OK" only (the other 16 codes would add 16 series per method to
        every scrape); each other code appears with its first call."""
        for service in services:
            for method in service.methods:
                labels = (rpc_type(method.client_streaming, method.server_streaming), service.full_name, method.name)
                self.grpc_server_started_total.labels(*labels)
                self.grpc_server_handling_seconds.labels(*labels)
                self.grpc_server_handled_total.labels(*labels, "OK")


def rpc_type(request_streaming: bool, response_streaming: bool) -> str:
    """go-grpc-prometheus's grpc_type of a method (one of GRPC_TYPES)."""
    if request_streaming and response_streaming:
        return "bidi_stream"
    if request_streaming:
        return "client_stream"
    return "server_stream" if response_streaming else "unary"


def build_versions() -> dict[str, str]:
    """fxport's, Python's and torch's versions, read without importing torch."""
    from importlib import metadata

    from fxport import __version__

    try:
        torch = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch = ""
    return {"version": __version__, "python": platform.python_version(), "torch": torch}


def build_metrics(registry: CollectorRegistry | None = REGISTRY) -> FxportMetrics:
    """Define every fxport metric in `registry` (tests pass a fresh CollectorRegistry)."""
    m = FxportMetrics(**_job_metrics(registry), **_cache_metrics(registry), **_capacity_metrics(registry),
                      **_process_metrics(registry))
    _create_series(m)
    return m


def _job_metrics(registry: CollectorRegistry | None) -> dict[str, Any]:
    """Jobs: states entered, running, queued, durations, failures, sandbox failures."""
    return {
        "jobs_total": Counter(
            "fxport_jobs_total",
            "Jobs that entered each state (queued on submit, then running, then one terminal state).",
            ["state"],
            registry=registry,
        ),
        "jobs_running": Gauge(
            "fxport_jobs_running",
            "Jobs running right now in this process's worker pool, by queue.",
            ["queue"],
            registry=registry,
            multiprocess_mode="livesum",
        ),
        "queue_depth": Gauge(
            "fxport_queue_depth",
            "Messages waiting in a Celery queue (Redis list length), sampled by whoever sets it.",
            ["queue"],
            registry=registry,
            multiprocess_mode="mostrecent",
        ),
        "stage_duration_seconds": Histogram(
            "fxport_stage_duration_seconds",
            "Wall time of one job stage.",
            ["stage"],
            buckets=STAGE_BUCKETS,
            registry=registry,
        ),
        "job_duration_seconds": Histogram(
            "fxport_job_duration_seconds",
            "Wall time of a job from submit to its terminal state.",
            ["state"],
            buckets=JOB_BUCKETS,
            registry=registry,
        ),
        "job_failures_total": Counter(
            "fxport_job_failures_total",
            "Jobs that FAILED, by the stage that failed and the error code (verification_failed, "
            "store_unreachable, ...).",
            ["stage", "code"],
            registry=registry,
        ),
        "sandbox_failures_total": Counter(
            "fxport_sandbox_failures_total",
            "Sandbox children that failed, by reason.",
            ["reason"],
            registry=registry,
        ),
    }


def _cache_metrics(registry: CollectorRegistry | None) -> dict[str, Any]:
    """The result cache: hits, misses, entries read."""
    return {
        "cache_hits_total": Counter(
            "fxport_cache_hits_total",
            "Submits answered from the artifact cache (same model digest, spec and toolchain).",
            registry=registry,
        ),
        "cache_misses_total": Counter(
            "fxport_cache_misses_total",
            "Submits that missed the artifact cache and were converted.",
            registry=registry,
        ),
        "cache_entry_reads_total": Counter(
            "fxport_cache_entry_reads_total",
            "Cache entries the API read from the object store (CheckUpload and SubmitJob lookups).",
            registry=registry,
        ),
    }


def _capacity_metrics(registry: CollectorRegistry | None) -> dict[str, Any]:
    """Shared capacity, retention, input quotas and upload bytes."""
    return {
        "busy_refusals_total": Counter(
            "fxport_busy_refusals_total",
            "Calls the API refused, to be retried, because a capacity every tenant shares was taken: resource="
            "streams (open streaming calls, each holding an RPC thread), calls (other calls in progress) or spool "
            "(upload bytes being spooled); "
            "limit=tenant (the caller's share) or server (all of it).",
            ["resource", "limit"],
            registry=registry,
        ),
        "jobs_removed_total": Counter(
            "fxport_jobs_removed_total",
            "Finished jobs the retention sweep removed with their artifacts, by reason: age (older than "
            "FXPORT_JOB_RETENTION_S) or count (past FXPORT_MAX_FINISHED_JOBS_PER_TENANT).",
            ["reason"],
            registry=registry,
        ),
        "inputs_removed_total": Counter(
            "fxport_inputs_removed_total",
            "Stored inputs (models, calibration files) the retention sweep deleted: no QUEUED or RUNNING job named "
            "them and none was submitted with them for FXPORT_INPUT_RETENTION_S (or their presigned upload expired "
            "with no submit).",
            registry=registry,
        ),
        "input_quota_refusals_total": Counter(
            "fxport_input_quota_refusals_total",
            "Submits and upload offers refused because a new input would take its tenant past "
            "FXPORT_MAX_INPUT_BYTES_PER_TENANT.",
            registry=registry,
        ),
        "upload_bytes_total": Counter(
            "fxport_upload_bytes_total",
            "Bytes received by SubmitJob uploads, by kind.",
            ["kind"],
            registry=registry,
        ),
        "direct_upload_bytes_total": Counter(
            "fxport_direct_upload_bytes_total",
            "Bytes clients were given presigned URLs to PUT straight to the object store (the size each URL "
            "signs), by kind; they never pass through the API.",
            ["kind"],
            registry=registry,
        ),
    }


def _process_metrics(registry: CollectorRegistry | None) -> dict[str, Any]:
    """What runs here (fxport_build_info) and go-grpc-prometheus's gRPC server metrics."""
    return {
        "build_info": Gauge(
            "fxport_build_info",
            "Always 1; the labels say which fxport, Python and torch (empty where not installed) run here.",
            ["version", "python", "torch"],
            registry=registry,
            multiprocess_mode="max",
        ),
        "grpc_server_started_total": Counter(
            "grpc_server_started_total",
            "Total number of RPCs started on the server.",
            ["grpc_type", "grpc_service", "grpc_method"],
            registry=registry,
        ),
        "grpc_server_handled_total": Counter(
            "grpc_server_handled_total",
            "Total number of RPCs completed on the server, regardless of success or failure.",
            ["grpc_type", "grpc_service", "grpc_method", "grpc_code"],
            registry=registry,
        ),
        "grpc_server_handling_seconds": Histogram(
            "grpc_server_handling_seconds",
            "Histogram of response latency (seconds) of gRPC that had been application-level handled by the "
            "server.",
            ["grpc_type", "grpc_service", "grpc_method"],
            buckets=RPC_BUCKETS,
            registry=registry,
        ),
    }


def _create_series(m: FxportMetrics) -> None:
    """Every series with a known label set, at 0 from the first scrape."""
    for state in JOB_STATES:
        m.jobs_total.labels(state)
    for state in TERMINAL_STATE_LABELS:
        m.job_duration_seconds.labels(state)
    for stage in STAGES:
        m.stage_duration_seconds.labels(stage)
    for queue in QUEUES:
        m.jobs_running.labels(queue)
        m.queue_depth.labels(queue)
    for reason in SANDBOX_FAILURE_REASONS:
        m.sandbox_failures_total.labels(reason)
    for kind in UPLOAD_KINDS:
        m.upload_bytes_total.labels(kind)
        m.direct_upload_bytes_total.labels(kind)


METRICS = build_metrics()


def multiprocess_dir() -> Path | None:
    """The PROMETHEUS_MULTIPROC_DIR this process records into, or None (in-memory values)."""
    value = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    return Path(value) if value else None


def reset_multiprocess_dir() -> None:
    """Delete the value files of other processes (a restarted container keeps its emptyDir).

    Call it once in the worker's main process before the pool forks; never in a child. The
    calling process's own files (`*_{pid}.db`) stay: it may already hold them open.
    """
    directory = multiprocess_dir()
    if directory is None:
        return
    directory.mkdir(parents=True, exist_ok=True)
    own = f"_{os.getpid()}.db"
    for path in directory.glob("*.db"):
        if not path.name.endswith(own):
            path.unlink(missing_ok=True)


def mark_process_dead(pid: int) -> None:
    """Drop the live-gauge values of an exited pool child (no-op without multiprocess mode)."""
    if multiprocess_dir() is not None:
        multiprocess.mark_process_dead(pid)


def start_metrics_server(
    port: int, addr: str = "127.0.0.1", registry: CollectorRegistry | None = None
) -> tuple[WSGIServer, int]:
    """Serve /metrics on `addr:port` from a daemon thread; port 0 picks a free port.

    Returns (server, bound port); `server.shutdown()` stops it. Without `registry`, serves
    the default registry, or the sum over all processes when PROMETHEUS_MULTIPROC_DIR is set,
    and sets fxport_build_info there first.
    """
    if registry is None:
        if multiprocess_dir() is not None:
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
        else:
            registry = REGISTRY
        METRICS.set_build_info()
    try:
        server, _thread = start_http_server(port, addr=addr, registry=registry)
    except OSError as exc:
        raise MetricsPortUnavailable(port, addr, exc) from None
    log.info("metrics on http://%s:%d/metrics", addr, server.server_port,
             extra={"metrics_port": server.server_port, "metrics_addr": addr})
    return server, server.server_port


class MetricsPortUnavailable(OSError):
    """/metrics could not listen where it was told: one line that says where, why and what to set."""

    def __init__(self, port: int, addr: str, cause: OSError) -> None:
        busy = cause.errno == errno.EADDRINUSE
        why = "another process listens there" if busy else (cause.strerror or str(cause))
        self.message = f"cannot serve metrics on {addr}:{port}: {why}"
        super().__init__(cause.errno, self.message)
        self.port, self.addr, self.busy = port, addr, busy

    def __str__(self) -> str:
        return self.message


def job_running(queue: str) -> contextlib.AbstractContextManager[None]:
    """`with job_running("cpu"):` around a job's execution keeps fxport_jobs_running{queue} current."""
    return METRICS.job_running(queue)


class MeteredJobStore:
    """A JobStore that counts what it records: every state a job enters (fxport_jobs_total),
    and on a terminal state the job's total and per-stage durations (from the record's own
    timestamps). Wrapping the store, not its callers, means no transition goes uncounted,
    whichever process — API, Celery worker, embedded pool — makes it."""

    def __init__(self, store: Any, metrics: FxportMetrics | None = None) -> None:
        self._store = store
        self._metrics = metrics or METRICS

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def create(self, record: Any) -> Any:
        rec, created = self._store.create(record)
        if created:
            # A result-cache hit is created SUCCEEDED: it never queued.
            state = rec.state.value.lower() if hasattr(rec.state, "value") else "queued"
            self._metrics.jobs_total.labels(state if state in JOB_STATES else "queued").inc()
            if state in TERMINAL_STATE_LABELS:
                self._observe_durations(rec, state)
        return rec, created

    def transition(self, job_id: str, **changes: Any) -> Any:
        before = self._store.get(job_id) if changes.get("state") is not None else None
        rec, changed = self._store.transition(job_id, **changes)
        if changed and rec is not None and before is not None and rec.state != before.state:
            state = rec.state.value.lower() if hasattr(rec.state, "value") else str(rec.state).lower()
            if state in JOB_STATES:
                self._metrics.jobs_total.labels(state).inc()
            if state in TERMINAL_STATE_LABELS:
                self._observe_durations(rec, state)
        return rec, changed

    def _observe_durations(self, rec: Any, state: str) -> None:
        if state == "failed":  # why: the error's stage and code (a verification failure is no store outage)
            error = getattr(rec, "error", None)
            self._metrics.record_job_failure(getattr(error, "stage", None), getattr(error, "code", None))
        finished = getattr(rec, "finished_at", None) or time.time()
        created = getattr(rec, "created_at", None)
        if created:
            self._metrics.job_duration_seconds.labels(state).observe(max(0.0, finished - created))
        for stage, timing in (getattr(rec, "stage_timings", None) or {}).items():
            if stage in STAGES and timing.started_at is not None:
                end = timing.finished_at or finished
                self._metrics.stage_duration_seconds.labels(stage).observe(max(0.0, end - timing.started_at))


def sample_queue_depth(broker_url: str, interval_s: float = 5.0, queues: tuple[str, ...] = QUEUES,
                       metrics: FxportMetrics | None = None) -> Any:
    """Keep fxport_queue_depth{queue} current from a daemon thread: Celery's Redis transport
    keeps each queue as a list named after it. Returns the thread's stop event."""
    import threading

    import redis

    metrics = metrics or METRICS
    client = redis.Redis.from_url(broker_url, socket_timeout=1, socket_connect_timeout=1)
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            for queue in queues:
                try:
                    metrics.queue_depth.labels(queue).set(client.llen(queue))
                except Exception:  # broker down: keep the last value, try again next round
                    pass
            stop.wait(interval_s)

    threading.Thread(target=loop, name="fxport-queue-depth", daemon=True).start()
    return stop
