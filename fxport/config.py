"""One typed settings object, read from FXPORT_* environment variables and CLI flags.

The defaults make the embedded mode work with no configuration at all: no broker means an
in-process worker pool, no store means files under $FXPORT_HOME (./.fxport).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

OP_LIBRARIES_ENV = "FXPORT_OP_LIBRARIES"


def parse_op_libraries(raw: Any) -> tuple[str, ...]:
    """FXPORT_OP_LIBRARIES as a tuple of entries: comma-separated (or already a sequence), each an
    absolute path to a shared library of custom ops or an importable module name (`torchvision`).
    Raises ValueError naming an entry that is neither."""
    entries = raw.split(",") if isinstance(raw, str) else list(raw or ())
    out: list[str] = []
    for entry in (str(e).strip() for e in entries):
        if not entry:
            continue
        if not (entry.startswith("/") or all(part.isidentifier() for part in entry.split("."))):
            raise ValueError(f"{OP_LIBRARIES_ENV} entry {entry!r} is neither an absolute path to a shared library "
                             "(/opt/ops/libmyops.so) nor a Python module name (torchvision)")
        if entry not in out:
            out.append(entry)
    return tuple(out)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="FXPORT_", extra="ignore")

    home: Path = Field(Path(".fxport"), description="State folder of the embedded mode (jobs, artifacts).")
    listen: str = Field("127.0.0.1:50051", description="gRPC listen address (host:port; port 0 picks one).")
    broker_url: str | None = Field(
        None, description="Celery broker + job store, e.g. redis://127.0.0.1:6379/0. Unset = embedded pool."
    )
    store: str | None = Field(
        None, description="Artifact store: s3://BUCKET[/prefix] or file:///dir. Unset = file://$FXPORT_HOME/store."
    )
    max_upload_bytes: int = Field(4 << 30, description="Largest model or calibration upload accepted.")
    max_spool_bytes: int = Field(
        12 << 30, ge=1 << 20, description="Upload bytes the API spools at once, all tenants together; one tenant "
        "may hold at most half. Keep it under the spool volume: Kubernetes evicts a pod whose emptyDir passes its "
        "sizeLimit (16 Gi in the manifests).")
    max_spec_bytes: int = Field(64 << 10, description="Largest job spec accepted.")
    embedded_workers: int = Field(2, ge=1, description="Concurrent jobs in the embedded worker pool.")
    job_soft_time_limit_s: int = Field(1800, description="Soft per-job limit: the job FAILS cleanly, naming the stage.")
    job_hard_time_limit_s: int = Field(2100, description="Hard per-job limit: the worker process is killed.")
    metrics_port: int | None = Field(None, description="The API serves Prometheus metrics on this port (unset = "
                                     "off; 0 = any free port, logged). Workers too, unless worker_metrics_port is set.")
    worker_metrics_port: int | None = Field(
        None, description="A worker serves Prometheus metrics on this port (unset = metrics_port's): set it where an "
        "API and a worker share a host, or two workers do.")

    @property
    def worker_metrics(self) -> tuple[int | None, str]:
        """The port a worker's /metrics listens on, and the setting that chose it."""
        if self.worker_metrics_port is not None:
            return self.worker_metrics_port, "FXPORT_WORKER_METRICS_PORT"
        return self.metrics_port, "FXPORT_METRICS_PORT"
    metrics_host: str | None = Field(
        None, description="Address the metrics endpoint binds. Unset: every address in a Kubernetes pod "
        "(KUBERNETES_SERVICE_HOST is set), where Prometheus and the kubelet's probes reach the pod IP; loopback "
        "elsewhere, unless the API itself listens beyond loopback.")

    def metrics_bind_address(self, *, api: bool, env: Mapping[str, str] | None = None) -> str:
        """Where /metrics listens: metrics_host, or the default it describes (`api`: for the API
        server, which keeps its metrics on loopback when it listens there)."""
        if self.metrics_host:
            return self.metrics_host
        if "KUBERNETES_SERVICE_HOST" in (os.environ if env is None else env):
            return "0.0.0.0"
        if api:
            host = self.listen.rsplit(":", 1)[0].strip("[]")
            return host if host in ("127.0.0.1", "localhost", "::1") else "0.0.0.0"
        return "127.0.0.1"
    spool_dir: Path | None = Field(None, description="Where uploads are spooled before storage (default: system temp).")
    jobs_url: str | None = Field(
        None,
        description="Job store: redis://… or sqlite:///path. Unset = the broker URL when it is Redis, "
        "else SQLite under $FXPORT_HOME.",
    )
    grpc_max_workers: int = Field(
        64, ge=4, description="Threads serving RPCs. Each open streaming call (WatchJob, SubmitJob, DownloadArtifact) "
        "holds one; a quarter of them (at least 2) are kept for short calls and health checks.")
    max_streams_per_tenant: int = Field(
        32, ge=1, description="Streaming calls one tenant may hold open on an API process at once (health and "
        "reflection, which need no token, share one such count); past it RESOURCE_EXHAUSTED, and the fxport client "
        "retries, following a job by polling meanwhile. The default lets one tenant's 32 CI pipelines each watch "
        "a job, and leaves 16 of the default 48 stream slots to the other tenants.")
    max_uploads_per_tenant: int = Field(
        8, ge=1, description="SubmitJob streams one tenant may have open at once on an API process. They are "
        "counted apart from its other streams (WatchJob, DownloadArtifact: max_streams_per_tenant), so a burst of CI "
        "pipelines waiting on their jobs never leaves their own submits without a slot; past it RESOURCE_EXHAUSTED, "
        "which the fxport client retries. The server's total of streams covers both.")
    max_calls_per_tenant: int | None = Field(
        None, ge=1, description="Calls that answer at once (GetJob, ListJobs, CancelJob, CheckUpload, GetArtifactUrl) "
        "one tenant may have in progress on an API process at once (unset: an eighth of grpc_max_workers, at least "
        "2: 8 by default); past it RESOURCE_EXHAUSTED, which the fxport client retries. Health and reflection are "
        "not counted.")
    otlp_endpoint: str | None = Field(
        None, description="OpenTelemetry collector (OTLP/HTTP, e.g. http://otel-collector:4318): the API and the "
        "workers export a trace of every job there, SubmitJob to the last stage, with job_id and tenant (needs the "
        "`tracing` extra). Unset = no tracing, and nothing of OpenTelemetry is loaded.")
    log_level: str = Field("INFO", description="Log level of the server and workers.")
    log_format: str = Field("json", description="json (one object per line, with job_id) or text.")
    work_dir: Path | None = Field(None, description="Scratch space for worker jobs (default: system temp).")
    worker_id: str | None = Field(None, description="Name recorded on jobs this worker runs (default: host:pid).")
    op_libraries: Annotated[tuple[str, ...], NoDecode] = Field(
        (), description="Custom op libraries the sandbox loads before it opens a model, comma-separated: a Python "
        "module name (torchvision, torchaudio: imported, which registers its ops) or an absolute path to a shared "
        "library (torch.ops.load_library). Loaded inside the confined child; part of the result cache's key and "
        "recorded in each manifest's toolchain. Without it a model that calls such ops fails to load "
        "(`Unknown builtin op: torchvision::nms`).")

    @field_validator("op_libraries", mode="before")
    @classmethod
    def _split_op_libraries(cls, value: Any) -> tuple[str, ...]:
        return parse_op_libraries(value)

    # Security (docs/architecture.md "Trust boundaries", deploy/README.md "Security model").
    tokens_file: Path | None = Field(
        None, description="Bearer tokens, hashed: one `tenant: sha256-hex` line each (`fxport tokens new`). "
        "Set = every call but health/reflection needs a token or a client certificate.")
    tls_cert_file: Path | None = Field(None, description="Server TLS certificate chain (PEM); with tls_key_file.")
    tls_key_file: Path | None = Field(None, description="Server TLS private key (PEM).")
    tls_client_ca_file: Path | None = Field(
        None, description="CA bundle for client certificates (mTLS): required of every client; tenant = the CN.")
    insecure_no_auth: bool = Field(
        False, description="Allow serving a non-loopback address with no tokens and no mTLS (a proxy in front "
        "authenticates). Without it the server refuses to start.")
    max_jobs_in_flight: int = Field(100, ge=1, description="Jobs one tenant may have QUEUED or RUNNING at once.")
    max_job_memory_mb: int = Field(
        16384, ge=256, description="Ceiling on a job's spec.limits.memory_mb (sandbox address space).")
    max_job_timeout_s: int = Field(
        1800, ge=10, description="Ceiling on a job's spec.limits.timeout_s (sandbox wall clock).")
    max_job_output_bytes: int = Field(
        64 << 30, ge=1 << 20, description="Bytes a job's sandbox may write in all (its files' sizes, sparse ones "
        "at their full size), watched while it runs; past it the job fails, naming this setting. Also the most "
        "the worker uploads for one job.")
    events_ttl_s: int = Field(
        7 * 24 * 3600, ge=60, description="A job's event stream (Redis) expires this long after its last event; "
        "WatchJob on an older job then answers with its final state alone. The job record stays until retention "
        "removes it (job_retention_s).")
    # Reliability (deploy/README.md, "Reliability"). A dead worker's job is redelivered within
    # about visibility_timeout_s + unacked_restore_interval_s; a live worker keeps its job's
    # message invisible and holds a job lease, so no second worker starts it meanwhile.
    visibility_timeout_s: int = Field(
        120, ge=2, description="Redis visibility timeout: a message un-acked this long by a worker that stopped "
        "renewing it (dead) goes back to the queue. Running jobs renew theirs, so it need not exceed the time limits.")
    unacked_restore_interval_s: float = Field(
        15.0, gt=0, description="How often each worker scans Redis for messages past the visibility timeout.")
    job_lease_s: int = Field(
        60, ge=1, description="Lease a worker holds on a running job, renewed every job_lease_s/4; a redelivered job "
        "whose lease is still held by a live worker waits instead of starting a duplicate.")
    orphan_sweep_interval_s: float = Field(
        60.0, ge=0, description="How often the API server requeues (or, after 3 attempts, fails) RUNNING jobs whose "
        "worker lease is gone and that no redelivery picked up; 0 = never.")
    store_retry_s: float = Field(
        60.0, gt=0, description="Retry budget of each object store operation (backoff up to 5 s between tries); "
        "past it the job FAILS naming the endpoint.")
    shutdown_grace_s: float = Field(
        30.0, ge=0, description="On SIGTERM the API turns NOT_SERVING and gives in-flight calls this long to finish.")
    worker_soft_shutdown_s: float = Field(
        540.0, ge=0, description="Celery worker_soft_shutdown_timeout: on SIGTERM (remapped to SIGQUIT) the running "
        "job gets this long to finish before it is cut and requeued; keep it under the pod's grace period.")

    direct_upload: bool = Field(
        True, description="CheckUpload hands a client a presigned PUT for a model or calibration file the store "
        "lacks, so its bytes go straight to the object store instead of through the API (S3 stores only; a "
        "client that cannot reach the store streams them through the API instead).")
    direct_upload_min_bytes: int = Field(
        16 << 20, ge=0, description="Smallest input offered a direct upload: below it one SubmitJob stream "
        "costs less than a second request to the store.")
    early_upload: bool = Field(
        True, description="Workers upload each artifact while the engine goes on exporting and verifying, instead "
        "of after the job; the overlap costs CPU next to the engine (and, on a store that cannot check a "
        "checksum on upload, a private copy of each artifact).")

    # Result cache (fxport/cache.py, deploy/README.md "Result cache").
    cache_enabled: bool = Field(
        True, description="Answer a submit whose model, calibration data, spec and worker toolchain match an "
        "earlier successful job with that job's artifacts (a new SUCCEEDED job marked cache_hit), and skip the "
        "model upload for it.")
    cache_share_across_tenants: bool = Field(
        False, description="Let one tenant's submit be answered from another tenant's cached result (same model "
        "bytes, spec and toolchain). Off: tenants never see each other's cache entries.")
    cache_rehash_interval_s: float = Field(
        3600.0, ge=0, description="A hit re-reads and re-hashes the cached artifacts unless their bytes were "
        "re-hashed within this long and the objects were not rewritten since (same ETag/Last-Modified or "
        "inode/mtime); 0 = re-hash on every hit.")
    cache_max_age_s: float = Field(
        30 * 24 * 3600.0, ge=0, description="Cache entries not used for this long are evicted; 0 = no age limit.")
    cache_max_bytes: int = Field(
        0, ge=0, description="Total artifact bytes the cache entries may point at; past it the least recently used "
        "entries are evicted; 0 = no size limit.")
    cache_sweep_interval_s: float = Field(
        3600.0, ge=0, description="How often the API server applies cache_max_age_s and cache_max_bytes; 0 = never "
        "(call fxport.cache.ResultCache.sweep yourself).")

    # Retention (fxport/retention.py, deploy/README.md "Job retention").
    job_retention_s: float = Field(
        30 * 24 * 3600.0, ge=0, description="A finished job (its record, events and artifacts) is removed this long "
        "after it ends; 0 = no age limit. Artifacts a cache hit shares stay while that job does.")
    max_finished_jobs_per_tenant: int = Field(
        10_000, ge=0, description="Job records one tenant may keep; past it the oldest finished jobs are removed "
        "first (QUEUED and RUNNING ones never); 0 = no count limit. With the age limit off too, job records and "
        "artifacts are kept for good and the job store grows without bound.")
    max_input_bytes_per_tenant: int = Field(
        100 << 30, ge=0, description="Bytes of models and calibration files one tenant may have stored at once; a "
        "submit or upload offer that would pass it is refused (RESOURCE_EXHAUSTED), before any byte moves when the "
        "client declares the sizes (the fxport client does). 0 = no quota.")
    input_retention_s: float = Field(
        7 * 24 * 3600.0, ge=0, description="A stored input is deleted this long after the last job submitted with "
        "it, unless a QUEUED or RUNNING job names it; an input uploaded through a presigned URL whose submit never "
        "came goes once the URL has expired (plus an hour). 0 = inputs of submitted jobs are kept for good.")
    retention_sweep_interval_s: float = Field(
        300.0, ge=0, description="How often the API server removes the finished jobs retention no longer keeps and the "
        "inputs input_retention_s no longer keeps (the jobs also at once when a submit takes a tenant past "
        "max_finished_jobs_per_tenant); 0 = never.")

    @model_validator(mode="after")
    def _lease_expires_before_redelivery(self) -> Settings:
        # A redelivered job must find a dead worker's lease already expired, or it waits once more.
        if self.job_lease_s >= self.visibility_timeout_s:
            raise ValueError(f"job_lease_s ({self.job_lease_s}) must be shorter than visibility_timeout_s "
                             f"({self.visibility_timeout_s}): a dead worker's lease has to expire before "
                             "Redis redelivers its job")
        return self

    @model_validator(mode="after")
    def _largest_upload_fits_a_tenants_spool_share(self) -> Settings:
        if self.max_upload_bytes > self.max_spool_bytes // 2:
            raise ValueError(f"max_upload_bytes ({self.max_upload_bytes}) is more than half of max_spool_bytes "
                             f"({self.max_spool_bytes}), the most one tenant may spool: an upload that size could "
                             "never be taken; raise FXPORT_MAX_SPOOL_BYTES (and the spool volume) with it")
        return self

    @model_validator(mode="after")
    def _largest_upload_fits_the_input_quota(self) -> Settings:
        if self.max_input_bytes_per_tenant and self.max_input_bytes_per_tenant < self.max_upload_bytes:
            raise ValueError(f"max_input_bytes_per_tenant ({self.max_input_bytes_per_tenant}) is less than "
                             f"max_upload_bytes ({self.max_upload_bytes}): an upload that size could never be stored; "
                             "raise FXPORT_MAX_INPUT_BYTES_PER_TENANT or lower FXPORT_MAX_UPLOAD_BYTES")
        return self

    @model_validator(mode="after")
    def _one_tenants_calls_leave_threads_to_others(self) -> Settings:
        if self.max_calls_per_tenant is not None and self.max_calls_per_tenant > self.grpc_max_workers // 2:
            raise ValueError(f"max_calls_per_tenant ({self.max_calls_per_tenant}) is more than half of "
                             f"grpc_max_workers ({self.grpc_max_workers}): one tenant's calls could take the threads "
                             "every other tenant's calls and the health checks need; lower FXPORT_MAX_CALLS_PER_TENANT "
                             "or raise FXPORT_GRPC_MAX_WORKERS")
        return self

    @property
    def calls_per_tenant(self) -> int:
        """max_calls_per_tenant, or an eighth of the RPC threads (at least 2) when unset."""
        return self.max_calls_per_tenant or max(2, self.grpc_max_workers // 8)

    @property
    def stream_slots(self) -> int:
        """Streaming calls an API process admits at once: its RPC threads less those kept for short calls."""
        return self.grpc_max_workers - max(2, self.grpc_max_workers // 4)

    @property
    def redelivery_bound_s(self) -> float:
        """Longest wait, after a worker dies, before its job is back on the queue."""
        return self.visibility_timeout_s + self.unacked_restore_interval_s

    @property
    def embedded(self) -> bool:
        return self.broker_url is None

    def job_store_url(self) -> str | None:
        if self.jobs_url:
            return self.jobs_url
        if self.broker_url and self.broker_url.startswith(("redis://", "rediss://")):
            return self.broker_url
        return None

    def store_url(self) -> str:
        return self.store or f"file://{(self.home / 'store').resolve()}"
