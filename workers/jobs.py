"""The job function: ids in, artifacts under deterministic keys out. Shared by the Celery
tasks (workers/tasks.py) and the embedded worker pool (workers/embedded.py).

`execute_job(job_id, ctx)`:
  fetch inputs to a temp dir → run the engine in its sandbox (workers/sandbox/) →
  upload every output file under `{tenant}/jobs/{job_id}/{name}` → record SUCCEEDED with
  the artifacts, or FAILED with {stage, code, message}. Progress events go to the job store
  as they come. With a `tensorrt` target, the CPU part ends by handing the job to the
  `tensorrt` stage (queue "gpu"), which builds the engine from the uploaded ONNX.

Idempotent by construction: keys are deterministic, a redelivered task starts from a clean
prefix, and the job store refuses to move a finished job, so a late or replayed run can
neither resurrect a cancelled job nor overwrite a result.
"""

from __future__ import annotations

import logging
import os
import socket
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from fxport import tracing
from fxport.cache import Remembered, forget_job_result, remember_job_result
from fxport.config import Settings
from fxport.errors import ErrorRecord, FxportError, InvalidInput, JobCancelled, ResourceLimitExceeded
from fxport.jobs import InputRef, JobRecord, JobState, JobStore, StoredArtifact
from fxport.logs import job_context
from fxport.manifest import Manifest
from fxport.manifest_sections import TensorRT
from fxport.metrics import job_running
from fxport.spec import JobSpec, parse_spec
from fxport.storage import (
    ArtifactStore,
    StorageError,
    StoredObject,
    StoredObjectCorrupt,
    artifact_key,
    check_artifact_name,
    job_prefix,
)
from fxport.toolchain import local_toolchain
from fxport.workers.artifact_upload import LATE_FILES, EarlyUpload
from fxport.workers.engine.exporters.registry import TENSORRT_STAGE, later_stage, later_targets
from fxport.workers.engine.request import EngineRequest, TimingCachePaths, cpu_stage

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 3  # a job that kills its worker this many times fails instead of looping
CANCEL_POLL_S = 0.5
PROGRESS_EVERY_S = 0.25  # progress events within one stage, at most this often per job
MESSAGES_PER_STAGE = 8  # …except a stage's first few distinct messages ("[export] torchscript"), recorded at once
_KEEP_ON_FAILURE = ("manifest.json", "report.html")  # what a failed job still publishes
ENGINE_ONNX = TENSORRT_STAGE.source_paths  # what the GPU stage builds from, in order of preference


class RetryLater(Exception):
    """A transient infrastructure failure (object store unreachable): run the job again later."""


@dataclass
class WorkerContext:
    jobs: JobStore
    artifacts: ArtifactStore
    settings: Settings = field(default_factory=Settings)
    # Hands a job to its next stage as a separate task: ("tensorrt", job_id) → queue "gpu".
    enqueue_stage: Callable[[str, str], None] | None = None
    # Whether some worker consumes queue "gpu" (None: cannot tell); what a job handed to the
    # tensorrt stage says on its record while it waits (workers/queue_consumers.py).
    gpu_workers: Callable[[], bool | None] | None = None
    worker_id: str = field(default_factory=lambda: f"{socket.gethostname()}:{os.getpid()}")
    # Runs one conversion: (request, on_progress=, cancel_event=, work_parent=) → Manifest.
    # Default: the sandboxed run_engine_job; tests give a stand-in.
    engine: Callable[..., Manifest] | None = None
    # Set by the embedded pool when the server stops: an interrupted job is left as it is
    # (RUNNING) to be re-run on the next start, not recorded as failed.
    stopping: threading.Event = field(default_factory=threading.Event)
    # Job lease TTL (workers/job_lease.py): set where several workers may get the same job
    # (Celery); None in the embedded pool, whose one process owns every job.
    lease_s: float | None = None

    def run_engine(self, request: EngineRequest, *, on_progress: Callable[[dict[str, Any]], None],
                   cancel_event: threading.Event | None = None, work_parent: Path | None = None) -> Manifest:
        engine = self.engine
        if engine is None:
            from fxport.workers.sandbox import run_engine_job

            # the sandbox loads this worker's custom op libraries before the model (FXPORT_OP_LIBRARIES)
            return run_engine_job(request, on_progress=on_progress, cancel_event=cancel_event,
                                  work_parent=work_parent, op_libraries=self.settings.op_libraries)
        return engine(request, on_progress=on_progress, cancel_event=cancel_event, work_parent=work_parent)


def artifact_format(name: str, manifest_formats: dict[str, str]) -> str:
    if name in manifest_formats:
        return manifest_formats[name]
    if name == "manifest.json":
        return "manifest"
    if name.endswith(".html"):
        return "report"
    from fxport.workers.engine.exporters.registry import REGISTRY

    for target in REGISTRY.values():
        if name == target.path or name.startswith(target.path + "/") or (target.onnx and name == target.path + ".data"):
            return target.name
    return "file"


def upload_outputs(
    ctx: WorkerContext, rec: JobRecord, out_dir: Path, manifest: Manifest | None,
    only: tuple[str, ...] | None = None, early: dict[str, StoredObject] | None = None,
) -> list[StoredArtifact]:
    """Upload what `manifest` lists (its artifacts, plus manifest.json and report.html, which the
    worker wrote), or the names in `only`; nothing else the child left in out_dir is read.

    The sandbox wrote out_dir: each file is opened beneath it without following links, and
    hashed and uploaded from that open file (workers/sandbox/beneath.py); a link, FIFO or hard
    link anywhere fails the upload. `early`: what an EarlyUpload already stored
    (workers/artifact_upload.py). One is kept when its digest is the file's: the manifest's,
    which the sandbox validated against the file (`ctx.engine` unset: run_engine_job), or else
    the file's digest now."""
    from fxport.digest import sha256_file
    from fxport.workers.sandbox import beneath

    listed = manifest.artifacts if manifest is not None else []
    formats = {a.path: a.format for a in listed if a.path}
    validated = {a.path: a.sha256 for a in listed} if ctx.engine is None else {}
    early = dict(early or {})
    if only is None:
        only = (*formats, *LATE_FILES)
    with beneath.opened_dir(out_dir) as out_fd:
        files = []
        try:
            for name in dict.fromkeys(only):
                try:
                    files.append(beneath.open_file(out_fd, name))
                except FileNotFoundError:
                    continue
            total = sum(f.size for f in files)  # fstat'ed as opened, before a byte is read
            if total > ctx.settings.max_job_output_bytes:
                raise ResourceLimitExceeded(
                    f"the job's outputs come to {total} bytes; the bound is {ctx.settings.max_job_output_bytes} "
                    "(FXPORT_MAX_JOB_OUTPUT_BYTES)", stage="upload")
            todo = [(f.name, artifact_key(rec.tenant, rec.id, check_artifact_name(f.name)), f, early.pop(f.name, None))
                    for f in files]

            def store(item: tuple[str, str, beneath.OutputFile, StoredObject | None]) -> StoredArtifact:
                name, key, f, before = item
                if before is not None and before.sha256 == (validated.get(name) or sha256_file(f.path)[0]):
                    stored = before
                else:
                    stored = ctx.artifacts.put_file(key, f.path)
                return StoredArtifact(name=name, format=artifact_format(name, formats), key=key,
                                      bytes=stored.bytes, sha256=stored.sha256)

            # A few objects at once: each is mostly a round trip to the store.
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(max_workers=max(1, min(4, len(todo)))) as pool:
                uploaded = list(pool.map(store, todo))
        finally:
            for f in files:
                f.close()
    for gone in early.values():  # uploaded early, no longer an output
        ctx.artifacts.delete_object(gone.key)
    return uploaded


def clamp_limits(spec: JobSpec, settings: Settings) -> tuple[JobSpec, list[str]]:
    """spec.limits within the server's maximums: a spec cannot grant its sandbox more memory or
    time than FXPORT_MAX_JOB_MEMORY_MB / FXPORT_MAX_JOB_TIMEOUT_S. Clamped here, in the worker,
    because the worker is what applies them; returns the spec to run and what was lowered."""
    lim = spec.limits
    memory = min(lim.memory_mb, settings.max_job_memory_mb)
    timeout = min(lim.timeout_s, settings.max_job_timeout_s)
    notes = [f"{name} {asked} lowered to the server maximum {got}" for name, asked, got in
             (("limits.memory_mb", lim.memory_mb, memory), ("limits.timeout_s", lim.timeout_s, timeout)) if got < asked]
    if not notes:
        return spec, []
    return spec.model_copy(update={"limits": lim.model_copy(update={"memory_mb": memory, "timeout_s": timeout})}), notes


def _suffix(filename: str) -> str:
    suffix = Path(filename or "").suffix.lower()
    return suffix if suffix in (".pt2", ".pt", ".pth", ".ts", ".onnx", ".zip", ".npz", ".npy", ".pt2z") else ""


class _CancelWatch:
    """Polls the job record; on CANCELLED sets `event` and kills this job's sandbox."""

    def __init__(self, ctx: WorkerContext, job_id: str) -> None:
        self.ctx, self.job_id = ctx, job_id
        self.event = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"cancel-watch-{job_id}", daemon=True)

    def __enter__(self) -> _CancelWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(CANCEL_POLL_S):
            try:
                rec = self.ctx.jobs.get(self.job_id)
            except Exception:  # a store hiccup is no reason to stop watching
                continue
            if rec is not None and rec.state is JobState.CANCELLED:
                self.event.set()
                kill_sandboxes_of(self.job_id)
                return


def kill_sandboxes_of(job_id: str) -> int:
    """Kill the sandbox child(ren) this process started for `job_id` (workers/sandbox/launch.py
    keeps them by job while they run); returns how many. Nothing a child wrote is consulted."""
    from fxport.workers.sandbox import kill_job

    return kill_job(job_id)


def execute_job(job_id: str, ctx: WorkerContext, *, final_attempt: bool = True,
                on_heartbeat: Callable[[], Any] | None = None) -> JobRecord | None:
    """Run one job to a terminal state (or hand it to its next stage). Never raises for a
    job failure; raises RetryLater for a transient store failure unless `final_attempt`.

    With `ctx.lease_s`, the job runs under its lease (workers/job_lease.py): LeaseHeld if a
    live worker already runs it; `on_heartbeat` is called with every lease renewal (the
    Celery task keeps its broker message invisible there)."""
    with job_context(job_id), job_running("cpu"):
        if ctx.lease_s is None:
            return _execute_job(job_id, ctx, final_attempt)
        from dataclasses import replace

        from fxport.workers.job_lease import AttemptFence, JobLease

        with JobLease(ctx.jobs, job_id, ctx.lease_s, on_heartbeat=on_heartbeat,
                      on_lost=lambda: kill_sandboxes_of(job_id)) as lease:
            # the fences are proxies with the stores' interfaces
            fenced = replace(ctx, jobs=cast(JobStore, AttemptFence(ctx.jobs, lease)),
                             artifacts=cast(ArtifactStore, AttemptFence(ctx.artifacts, lease)))
            return _execute_job(job_id, fenced, final_attempt)


def _fail(ctx: WorkerContext, job_id: str, stage: str | None, code: str, message: str,
          detail: str | None = None, artifacts: list[StoredArtifact] | None = None) -> JobRecord | None:
    rec, _ = ctx.jobs.transition(
        job_id, state=JobState.FAILED,
        error=ErrorRecord(stage=stage, code=code, message=message, detail=detail),
        artifacts=artifacts, message=message,
    )
    log.info("job failed", extra={"stage": stage, "code": code})
    return rec


def fetch_input(ctx: WorkerContext, ref: InputRef, dest: Path, what: str) -> None:
    """Fetch an input, checked against its sha256. Bytes that do not hash to it (a direct
    upload to a store that does not check x-amz-checksum-sha256, or damage in the store) are
    deleted, so that the next submit of that model uploads it again, and the job fails as
    invalid input: retrying would only read the same bytes."""
    try:
        ctx.artifacts.get(ref.key, dest)
    except StoredObjectCorrupt as exc:
        try:
            ctx.artifacts.delete_object(ref.key)
        except StorageError as gone:
            log.warning("could not remove the corrupt %s %s: %s", what, ref.key, gone)
        raise InvalidInput(f"the stored {what} does not hash to its sha256 {ref.sha256} ({exc}); it was removed",
                           stage="load", field=what, hint="submit the job again: the bytes are uploaded anew") from None


def _announce_staged(ctx: WorkerContext, job_id: str, name: str, stored: StoredObject) -> None:
    """An artifact went up while the engine works on: the client may fetch it already
    (JobRecord.staged); it keeps the copy only if the verified result lists the same sha256."""
    ctx.jobs.transition(job_id, staged=StoredArtifact(name=name, format=artifact_format(name, {}), key=stored.key,
                                                      bytes=stored.bytes, sha256=stored.sha256))


def _execute_job(job_id: str, ctx: WorkerContext, final_attempt: bool) -> JobRecord | None:
    """The CPU part of a job: start an attempt, fetch its inputs, run the engine in the sandbox,
    upload what it made; then hand the job to the GPU stage or record it SUCCEEDED."""
    rec, run = _start_attempt(ctx, job_id)
    if not run or rec is None:
        return rec
    if not tracing.enabled():
        tracing.configure_once(ctx.settings.otlp_endpoint, "fxport-worker")
    with tracing.span("fxport.job", parent=rec.trace_context, job_id=job_id, tenant=rec.tenant,
                      attempt=rec.attempts, worker=ctx.worker_id) as job_span:
        spans = tracing.StageSpans(job_span, job_id=job_id, tenant=rec.tenant)
        try:
            return _run_attempt(ctx, rec, final_attempt, spans)
        finally:
            spans.close()


@contextmanager
def _job_folder(prefix: str, parent: str | Path | None) -> Iterator[str]:
    """The job's own folder (tempfile.mkdtemp), removed afterwards with everything the sandbox left
    in it. Not tempfile.TemporaryDirectory: where a removal is refused (in a folder the child made
    unwritable) its cleanup chmods the path, through a symlink the child planted there to a file
    outside the job (CVE-2023-6597: Python before 3.11.8 and 3.12.2). `beneath.remove_tree` follows
    no link; a folder left unremoved is logged, as the job's outcome is already recorded."""
    from fxport.workers.sandbox import beneath

    path = tempfile.mkdtemp(prefix=prefix, dir=parent)
    try:
        yield path
    finally:
        try:
            beneath.remove_tree(Path(path))
        except (OSError, RecursionError) as exc:
            log.warning("could not remove the job's folder %s: %s", path, exc)


def _run_attempt(ctx: WorkerContext, rec: JobRecord, final_attempt: bool, spans: tracing.StageSpans
                 ) -> JobRecord | None:
    """An attempt `_start_attempt` began: the engine in the sandbox, then the upload."""
    job_id = rec.id
    spans.enter("load")  # fetching the inputs, then the engine's own load
    # The CPU part makes every other artifact and the ONNX model the GPU stage builds an engine from.
    spec, deferred = cpu_stage(rec.spec)
    spec, clamped = clamp_limits(spec, ctx.settings)
    if clamped:
        ctx.jobs.transition(job_id, message="; ".join(clamped))
    cancel = _CancelWatch(ctx, job_id)
    progress = _JobProgress(ctx, job_id, cancel.event, spans)
    work_parent = ctx.settings.work_dir
    if work_parent:
        Path(work_parent).mkdir(parents=True, exist_ok=True)
    with _job_folder(f"fxport-job-{job_id}-", work_parent) as tmp_str, cancel:
        tmp = Path(tmp_str)
        out_dir = tmp / "out"
        out_dir.mkdir()
        progress.early = early = EarlyUpload(ctx.artifacts, rec.tenant, rec.id, out_dir, tmp / "spool",
                                             on_stored=lambda name, stored: _announce_staged(ctx, job_id, name, stored),
                                             max_bytes=ctx.settings.max_job_output_bytes)
        try:
            if rec.attempts > 1:  # redelivered: what an earlier attempt stored goes first
                ctx.artifacts.delete_prefix(job_prefix(rec.tenant, rec.id))
            model_path, calibration_path = _fetch_inputs(ctx, rec, tmp / "input")
            request = EngineRequest(
                model_path=model_path, spec=spec, out_dir=out_dir, job_id=job_id, calibration_path=calibration_path,
                deferred_targets=deferred, input_sha256=rec.model.sha256,  # `get` just checked the bytes against it
                timeout_s=min(spec.limits.timeout_s, ctx.settings.job_soft_time_limit_s),
                max_output_bytes=ctx.settings.max_job_output_bytes)
            manifest = ctx.run_engine(
                request, on_progress=progress, cancel_event=cancel.event,
                work_parent=tmp,  # the sandbox's folder beside this job's own, apart from every other job's
            )
            if cancel.event.is_set():
                raise JobCancelled("cancelled by request", stage=progress.stage)
            progress.stage = "upload"
            spans.enter("upload")
            ctx.jobs.transition(job_id, stage="upload", message="uploading artifacts")
            artifacts = upload_outputs(ctx, rec, out_dir, manifest, early=early.wait())
        except StorageError as exc:
            early.abandon()
            if _was_cancelled(ctx, job_id, cancel):
                return _cancelled_cleanup(ctx, rec)
            if not final_attempt:
                log.warning("store failure; the job will be retried: %s", exc)
                raise RetryLater(str(exc)) from exc
            return _fail(ctx, job_id, progress.stage, exc.code, f"object store failure: {exc}")
        except Exception as exc:  # every failure ends as a FAILED record naming its stage
            early.abandon()
            if ctx.stopping.is_set():
                log.info("job interrupted by shutdown; it will re-run on the next start")
                return ctx.jobs.get(job_id)
            # A cancel kills the sandbox (or Celery interrupts the task): that error is not a failure.
            if isinstance(exc, JobCancelled) or _was_cancelled(ctx, job_id, cancel):
                return _cancelled_cleanup(ctx, rec)
            return _failure_from(ctx, rec, exc, progress.stage, out_dir)
    # A model built from its eager form (no graph could be captured) has no ONNX graph to build an
    # engine from: the CPU stage already recorded tensorrt among its failed targets.
    not_built = {f.target for f in manifest.failed_targets} if manifest is not None else set()
    if any(target not in not_built for target in deferred):
        return _hand_to_gpu_stage(ctx, rec, artifacts)
    # Failed targets reach here only with the spec's allow_partial (the engine fails the job otherwise).
    return _succeed(ctx, rec, artifacts, not_built=sorted(not_built))


def _start_attempt(ctx: WorkerContext, job_id: str) -> tuple[JobRecord | None, bool]:
    """The job's record and whether this task runs it: not for a job gone or finished, nor for a
    redelivered task whose work was handed on already, nor past MAX_ATTEMPTS (then FAILED)."""
    rec = ctx.jobs.get(job_id)
    if rec is None:
        log.warning("job not found; dropping the task")
        return None, False
    if rec.terminal:
        log.info("job already %s; nothing to do (a replayed task)", rec.state.value)
        return rec, False
    if rec.state is JobState.QUEUED and rec.stage == "tensorrt" and any(a.name in ENGINE_ONNX for a in rec.artifacts):
        # A redelivered CPU task whose work was done and handed on: hand on again (same task id), nothing more.
        if ctx.enqueue_stage is not None:
            ctx.enqueue_stage("tensorrt", job_id)
        return rec, False
    if rec.attempts >= MAX_ATTEMPTS:
        return _fail(ctx, job_id, rec.stage, "worker_lost",
                     f"the job stopped its worker {rec.attempts} times (crash or kill during {rec.stage}); "
                     "it will not be retried — check the model for excessive memory use"), False
    rec, changed = ctx.jobs.transition(job_id, state=JobState.RUNNING, stage="load", new_attempt=True,
                                       worker=ctx.worker_id, message="fetching inputs")
    if rec is None or not changed:
        return rec, False
    log.info("job started", extra={"attempt": rec.attempts, "worker": ctx.worker_id})
    return rec, True


class _JobProgress:
    """The engine's progress events onto the job's record (and the cue for early uploads).

    A stage's first event and its first few distinct messages (each export target, which come
    milliseconds apart) are recorded at once; the rest at most every PROGRESS_EVERY_S, so a model
    that floods its events (the sandbox checks and bounds each one) costs the job store a few
    writes a second, whatever it sends (each update rewrites the whole record)."""

    def __init__(self, ctx: WorkerContext, job_id: str, cancelled: threading.Event,
                 spans: tracing.StageSpans | None = None) -> None:
        self.ctx, self.job_id, self.cancelled = ctx, job_id, cancelled
        self.spans = spans
        self.stage = "load"  # the stage a failure is recorded in
        self.early: EarlyUpload | None = None
        self._written_at = time.monotonic()
        self._said: dict[str, set[str]] = {}

    def __call__(self, event: dict[str, Any]) -> None:
        stage = event.get("stage") or self.stage
        if self.spans is not None:
            self.spans.enter(stage)
        first_of_stage = stage not in self._said
        news = _news(self._said.setdefault(stage, set()), event.get("message") or "")
        self.stage = stage
        if self.cancelled.is_set():
            return
        if stage in ("export", "verify") and self.early is not None and self.ctx.settings.early_upload:
            self.early.offer()  # go up while the engine works on
        if not (first_of_stage or news) and time.monotonic() - self._written_at < PROGRESS_EVERY_S:
            return
        self._written_at = time.monotonic()
        self.ctx.jobs.transition(self.job_id, stage=stage, progress=event.get("progress"),
                                 message=event.get("message"))


def _fetch_inputs(ctx: WorkerContext, rec: JobRecord, folder: Path) -> tuple[Path, Path | None]:
    """The job's model (and calibration data) from the store into `folder`, each checked against its sha256."""
    model_path = folder / f"model{_suffix(rec.model.filename)}"
    fetch_input(ctx, rec.model, model_path, "model")
    if rec.calibration is None:
        return model_path, None
    calibration_path = folder / f"calibration{_suffix(rec.calibration.filename)}"
    fetch_input(ctx, rec.calibration, calibration_path, "calibration")
    return model_path, calibration_path


def _hand_to_gpu_stage(ctx: WorkerContext, rec: JobRecord, artifacts: list[StoredArtifact]) -> JobRecord | None:
    """Back to QUEUED until a GPU worker takes the tensorrt stage; the record says whether one exists."""
    from fxport.workers.queue_consumers import waiting_message

    waiting = waiting_message("gpu", ctx.gpu_workers() if ctx.gpu_workers is not None else None)
    after, changed = ctx.jobs.transition(rec.id, state=JobState.QUEUED, stage="tensorrt", artifacts=artifacts,
                                         message=waiting)
    if changed and ctx.enqueue_stage is not None:
        ctx.enqueue_stage("tensorrt", rec.id)
    elif changed:
        return _fail(ctx, rec.id, "tensorrt", "no_gpu_queue", "no GPU stage is configured for TensorRT")
    return after


def _succeed(ctx: WorkerContext, rec: JobRecord, artifacts: list[StoredArtifact],
             not_built: list[str] | None = None) -> JobRecord | None:
    """SUCCEEDED with `artifacts`. `not_built`: the failed targets a job with allow_partial accepted;
    such a result is not cached (the cache key leaves allow_partial out, so a job without it, which
    must fail, would be answered with it)."""
    # The cache entry goes first: a client told SUCCEEDED may resubmit at once and must hit.
    cached = None if not_built else _remember(ctx, rec, artifacts,
                                              local_toolchain(op_libraries=ctx.settings.op_libraries))
    message = f"done, without {', '.join(not_built)} (allow_partial; see failed_targets)" if not_built else "done"
    after, changed = ctx.jobs.transition(rec.id, state=JobState.SUCCEEDED, artifacts=artifacts, message=message)
    if not changed:
        forget_job_result(ctx.artifacts, cached)
    if not changed and after is not None and after.state is JobState.CANCELLED:
        return _cancelled_cleanup(ctx, after)
    log.info("job succeeded", extra={"artifacts": len(artifacts)})
    return after


def _remember(ctx: WorkerContext, rec: JobRecord, artifacts: list[StoredArtifact],
              cpu_toolchain: dict[str, Any] | None) -> Remembered | None:
    """Write the result cache entry of a job about to be SUCCEEDED with `artifacts`, keyed with
    the toolchain that made them. Returns what was written (None: not cached)."""
    from fxport.toolchain import job_fingerprint

    if not ctx.settings.cache_enabled:
        return None
    engine = bool(later_targets(rec.spec.targets))
    fingerprint = job_fingerprint(cpu_toolchain, local_toolchain(gpu=True) if engine else None, engine=engine)
    return remember_job_result(ctx.artifacts, ctx.settings, rec.model_copy(update={"artifacts": artifacts}),
                               fingerprint)


def _was_cancelled(ctx: WorkerContext, job_id: str, cancel: _CancelWatch) -> bool:
    if cancel.event.is_set():
        return True
    rec = ctx.jobs.get(job_id)
    return rec is not None and rec.state is JobState.CANCELLED


def _cancelled_cleanup(ctx: WorkerContext, rec: JobRecord) -> JobRecord | None:
    """The job was cancelled while it ran: remove whatever it had uploaded."""
    try:
        ctx.artifacts.delete_prefix(job_prefix(rec.tenant, rec.id))
    except StorageError as exc:
        log.warning("could not remove artifacts of cancelled job: %s", exc)
    log.info("job cancelled; partial artifacts removed")
    return ctx.jobs.get(rec.id)


def _failure_from(ctx: WorkerContext, rec: JobRecord, exc: Exception, stage: str, out_dir: Path) -> JobRecord | None:
    kept: list[StoredArtifact] = []
    try:
        # After a verification failure the manifest (and report) say which output differs and by how much.
        kept = upload_outputs(ctx, rec, out_dir, None, only=_KEEP_ON_FAILURE)
    except Exception as upload_exc:
        log.warning("could not upload the failed job's manifest: %s", upload_exc)
    _drop_unkept(ctx, rec, kept)
    if isinstance(exc, FxportError):
        return _fail(ctx, rec.id, exc.stage or stage, exc.code, str(exc), exc.detail, kept)
    if past_soft_time_limit(exc):
        return _fail(ctx, rec.id, stage, "timeout", soft_time_limit_message(ctx.settings, stage), None, kept)
    log.exception("internal error")
    return _fail(ctx, rec.id, stage, "internal", f"internal error during {stage}: {type(exc).__name__}: {exc}",
                 "".join(traceback.format_exception(exc))[-4000:], kept)


def _drop_unkept(ctx: WorkerContext, rec: JobRecord, kept: list[StoredArtifact]) -> None:
    """A failed job stores no model file (README, "What a conversion does"): what an earlier stage
    stored (the CPU stage's artifacts, when the engine build fails) or an upload cut short left goes."""
    keep = {a.key for a in kept} | {artifact_key(rec.tenant, rec.id, name) for name in _KEEP_ON_FAILURE}
    try:
        for stored in ctx.artifacts.list_prefix(job_prefix(rec.tenant, rec.id)):
            if stored.key not in keep:
                ctx.artifacts.delete_object(stored.key)
    except StorageError as exc:
        log.warning("could not remove the failed job's artifacts: %s", exc)


def execute_stage(stage: str, job_id: str, ctx: WorkerContext, *, final_attempt: bool = True) -> JobRecord | None:
    """A later stage of a job (a registry target's `later`), run as its own task. Only `tensorrt` (queue
    "gpu") exists."""
    queue = later_stage(stage).queue  # ValueError for a stage that is no registry target's
    with job_context(job_id), job_running(queue):
        rec = ctx.jobs.get(job_id)
        if not tracing.enabled():
            tracing.configure_once(ctx.settings.otlp_endpoint, "fxport-worker")
        with tracing.span(f"fxport.stage {stage}", parent=rec.trace_context if rec else None, job_id=job_id,
                          tenant=rec.tenant if rec else None, worker=ctx.worker_id):
            return _execute_tensorrt(job_id, ctx, final_attempt)


def _execute_tensorrt(job_id: str, ctx: WorkerContext, final_attempt: bool) -> JobRecord | None:
    rec = ctx.jobs.get(job_id)
    if rec is None or rec.terminal:
        return rec
    rec, changed = ctx.jobs.transition(job_id, state=JobState.RUNNING, stage="tensorrt", worker=ctx.worker_id,
                                       message="building the TensorRT engine")
    if rec is None or not changed:
        return rec
    earlier = {a.name: a for a in rec.artifacts}
    # an int8 job with a CPU target made the engine its own (symmetric) ONNX beside model.onnx
    onnx_name = next((name for name in ENGINE_ONNX if name in earlier), None)
    if onnx_name is None:
        return _fail(ctx, job_id, "tensorrt", "missing_input",
                     "the TensorRT stage found no model.onnx from the CPU stage")
    onnx = earlier[onnx_name]
    spec, _ = clamp_limits(rec.spec.model_copy(update={"targets": ["tensorrt"]}), ctx.settings)
    with _job_folder(f"fxport-trt-{job_id}-", ctx.settings.work_dir) as tmp_str:
        tmp = Path(tmp_str)
        out_dir = tmp / "out"
        out_dir.mkdir()
        cpu_manifest: Manifest | None = None
        try:
            from fxport.workers.engine.tensorrt.timing_cache import fetch_shared_cache, publish_shared_cache
            from fxport.workers.sandbox import beneath

            onnx_path = tmp / "input" / onnx_name
            ctx.artifacts.get(onnx.key, onnx_path)
            if f"{onnx_name}.data" in earlier:  # weights beside the graph (spec.onnx.single_file: false)
                ctx.artifacts.get(earlier[f"{onnx_name}.data"].key, onnx_path.with_name(f"{onnx_name}.data"))
            cpu_manifest = _stored_manifest(ctx, earlier.get("manifest.json"), tmp / "cpu-manifest.json")
            spec = _with_cpu_signature(spec, cpu_manifest)
            cache = (fetch_shared_cache(ctx.artifacts, tmp / "cache" / "timing.cache",
                                        tenant=None if ctx.settings.cache_share_across_tenants else rec.tenant)
                     if spec.tensorrt.timing_cache == "shared" else None)
            last_write = [0.0]
            said: set[str] = set()

            def on_progress(event: dict[str, Any]) -> None:  # as for the CPU stage
                news = _news(said, event.get("message") or "")
                if news or time.monotonic() - last_write[0] >= PROGRESS_EVERY_S:
                    last_write[0] = time.monotonic()
                    ctx.jobs.transition(job_id, stage="tensorrt", progress=event.get("progress"),
                                        message=event.get("message"))

            request = EngineRequest(
                model_path=onnx_path, spec=spec, out_dir=out_dir, job_id=job_id,
                timeout_s=min(spec.limits.timeout_s, ctx.settings.job_soft_time_limit_s),
                max_output_bytes=ctx.settings.max_job_output_bytes,
                timing_cache=TimingCachePaths(read=cache.path, write=cache.path) if cache is not None else None)
            stage = ctx.run_engine(request, on_progress=on_progress, work_parent=tmp)
            if cache is not None:  # written back under the same key, if the build added timings
                stage.tensorrt = TensorRT.model_validate({**(stage.tensorrt or {}),
                                                          "shared_timing_cache": publish_shared_cache(ctx.artifacts,
                                                                                                      cache)})
                stage.warnings.extend(cache.warnings)
            merged = cpu_manifest.merge_stage(stage, name="tensorrt") if cpu_manifest is not None else stage
            with beneath.opened_dir(out_dir) as out_fd:
                beneath.replace_file(out_fd, "manifest.json", merged.to_json().encode())
            _rewrite_report(out_dir / "manifest.json")
            new = {a.name: a for a in upload_outputs(ctx, rec, out_dir, stage)}
        except StorageError as exc:
            if not final_attempt:
                raise RetryLater(str(exc)) from exc
            return _fail(ctx, job_id, "tensorrt", exc.code, f"object store failure: {exc}")
        except Exception as exc:
            _merge_failed_manifest(cpu_manifest, out_dir / "manifest.json")
            return _failure_from(ctx, rec, exc, "tensorrt", out_dir)
    artifacts = list({**earlier, **new}.values())
    # The CPU part's versions are the CPU stage's, as its manifest records them.
    cached = _remember(ctx, rec, artifacts, cpu_manifest.toolchain if cpu_manifest is not None else None)
    rec, changed = ctx.jobs.transition(job_id, state=JobState.SUCCEEDED, artifacts=artifacts, message="done")
    if not changed:
        forget_job_result(ctx.artifacts, cached)
    return rec


def past_soft_time_limit(exc: BaseException | None) -> bool:
    """Whether `exc` is Celery's SoftTimeLimitExceeded: known by name, since this module also runs
    where Celery is not imported (the embedded server's pool)."""
    return type(exc).__name__ == "SoftTimeLimitExceeded"


def soft_time_limit_message(settings: Settings, stage: str | None) -> str:
    return f"the job ran past the worker's {settings.job_soft_time_limit_s} s time limit during {stage}"


def _news(said: set[str], message: str) -> bool:
    """Whether `message` is one of its stage's first MESSAGES_PER_STAGE distinct ones (then noted)."""
    if message in ("", "done") or message in said or len(said) >= MESSAGES_PER_STAGE:
        return False
    said.add(message)
    return True


def _merge_failed_manifest(cpu_manifest: Manifest | None, path: Path) -> None:
    """A failed tensorrt stage publishes the CPU stage's manifest plus the stage's findings and error,
    not the stage's manifest alone (which would hide everything the CPU stage recorded)."""
    from fxport.workers.sandbox import MAX_MANIFEST_BYTES, beneath

    if cpu_manifest is None:
        return
    try:
        with beneath.opened_dir(path.parent) as out_fd:  # the sandbox wrote that folder: no links followed
            failed = Manifest.from_json(beneath.read_bounded(out_fd, path.name, MAX_MANIFEST_BYTES, path.name))
            failed.status = "failed"
            merged = cpu_manifest.merge_stage(failed, name="tensorrt")
            beneath.replace_file(out_fd, path.name, merged.to_json().encode())
        _rewrite_report(path)
    except Exception as exc:
        log.warning("could not merge the failed stage's manifest: %s", exc)


def _rewrite_report(manifest_path: Path) -> None:
    """report.html from the merged manifest (the stage's own report shows the engine alone)."""
    from fxport.workers.sandbox import draw_report

    draw_report(manifest_path.parent)


def _stored_manifest(ctx: WorkerContext, art: StoredArtifact | None, path: Path) -> Manifest | None:
    if art is None:
        return None
    ctx.artifacts.get(art.key, path)
    return Manifest.read(path)


def _with_cpu_signature(spec: JobSpec, cpu_manifest: Manifest | None) -> JobSpec:
    """A spec without inputs (a .pt2 carries its own) gets the signature the CPU stage resolved:
    the GPU stage has only the ONNX model, which records no dynamic-dim ranges."""
    sig = cpu_manifest.inputs if cpu_manifest is not None else None
    if spec.inputs or not sig:
        return spec
    return parse_spec({**spec.normalized(), "inputs": sig["inputs"], "dynamic_dims": sig["dynamic_dims"]})
