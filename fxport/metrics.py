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

Needs the `[server]` extra (prometheus-client); the thin client never imports it.
"""

from __future__ import annotations

import time
from typing import Any

import os
from dataclasses import dataclass
from pathlib import Path
from wsgiref.simple_server import WSGIServer

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client import multiprocess

# Label values, written out so every series exists (at 0) from the first scrape: rate()
# and absent() work before the first job, and a typo in a caller shows up as a new series.
JOB_STATES = ("queued", "running", "succeeded", "failed", "cancelled")
TERMINAL_STATES = ("succeeded", "failed", "cancelled")
STAGES = ("load", "capture", "passes", "quantize", "export", "verify", "benchmark", "tensorrt", "upload")
QUEUES = ("cpu", "gpu")
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
    upload_bytes_total: Counter
    direct_upload_bytes_total: Counter

    def record_sandbox_failure(self, reason: str) -> None:
        """Count one sandbox failure; a reason outside SANDBOX_FAILURE_REASONS counts as "other"."""
        self.sandbox_failures_total.labels(reason if reason in SANDBOX_FAILURE_REASONS else "other").inc()


def build_metrics(registry: CollectorRegistry | None = REGISTRY) -> FxportMetrics:
    """Define every fxport metric in `registry` (tests pass a fresh CollectorRegistry)."""
    m = FxportMetrics(
        jobs_total=Counter(
            "fxport_jobs_total",
            "Jobs that entered each state (queued on submit, then running, then one terminal state).",
            ["state"],
            registry=registry,
        ),
        jobs_running=Gauge(
            "fxport_jobs_running",
            "Jobs running right now in this process's worker pool, by queue.",
            ["queue"],
            registry=registry,
            multiprocess_mode="livesum",
        ),
        queue_depth=Gauge(
            "fxport_queue_depth",
            "Messages waiting in a Celery queue (Redis list length), sampled by whoever sets it.",
            ["queue"],
            registry=registry,
            multiprocess_mode="mostrecent",
        ),
        stage_duration_seconds=Histogram(
            "fxport_stage_duration_seconds",
            "Wall time of one job stage.",
            ["stage"],
            buckets=STAGE_BUCKETS,
            registry=registry,
        ),
        job_duration_seconds=Histogram(
            "fxport_job_duration_seconds",
            "Wall time of a job from submit to its terminal state.",
            ["state"],
            buckets=JOB_BUCKETS,
            registry=registry,
        ),
        cache_hits_total=Counter(
            "fxport_cache_hits_total",
            "Submits answered from the artifact cache (same model digest, spec and toolchain).",
            registry=registry,
        ),
        cache_misses_total=Counter(
            "fxport_cache_misses_total",
            "Submits that missed the artifact cache and were converted.",
            registry=registry,
        ),
        cache_entry_reads_total=Counter(
            "fxport_cache_entry_reads_total",
            "Cache entries the API read from the object store (CheckUpload and SubmitJob lookups).",
            registry=registry,
        ),
        sandbox_failures_total=Counter(
            "fxport_sandbox_failures_total",
            "Sandbox children that failed, by reason.",
            ["reason"],
            registry=registry,
        ),
        upload_bytes_total=Counter(
            "fxport_upload_bytes_total",
            "Bytes received by SubmitJob uploads, by kind.",
            ["kind"],
            registry=registry,
        ),
        direct_upload_bytes_total=Counter(
            "fxport_direct_upload_bytes_total",
            "Bytes clients were given presigned URLs to PUT straight to the object store (the size each URL "
            "signs), by kind; they never pass through the API.",
            ["kind"],
            registry=registry,
        ),
    )
    for state in JOB_STATES:
        m.jobs_total.labels(state)
    for state in TERMINAL_STATES:
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
    return m


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
    the default registry, or the sum over all processes when PROMETHEUS_MULTIPROC_DIR is set.
    """
    if registry is None:
        if multiprocess_dir() is not None:
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
        else:
            registry = REGISTRY
    server, _thread = start_http_server(port, addr=addr, registry=registry)
    return server, server.server_port


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
            if state in TERMINAL_STATES:
                self._observe_durations(rec, state)
        return rec, created

    def transition(self, job_id: str, **changes: Any) -> Any:
        before = self._store.get(job_id) if changes.get("state") is not None else None
        rec, changed = self._store.transition(job_id, **changes)
        if changed and rec is not None and before is not None and rec.state != before.state:
            state = rec.state.value.lower() if hasattr(rec.state, "value") else str(rec.state).lower()
            if state in JOB_STATES:
                self._metrics.jobs_total.labels(state).inc()
            if state in TERMINAL_STATES:
                self._observe_durations(rec, state)
        return rec, changed

    def _observe_durations(self, rec: Any, state: str) -> None:
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
