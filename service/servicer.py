"""ConversionService: validate, store, enqueue, answer. Handlers raise typed errors (fxport.errors);
service/status.py answers each with the gRPC status its code maps to."""

from __future__ import annotations

import functools
import hashlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import grpc

from fxport import tracing
from fxport.cache import Lookup, ResultCache, wants_engine
from fxport.config import Settings
from fxport.errors import (
    DataLoss,
    ErrorRecord,
    InvalidRequest,
    NotFound,
    PreconditionFailed,
    QuotaExceeded,
    ServiceUnavailable,
)
from fxport.jobs import (
    KEEP_FOREVER,
    IdempotencyConflict,
    InputRef,
    JobRecord,
    JobState,
    JobStore,
    SharedArtifactsGone,
    new_job_id,
)
from fxport.logs import job_context
from fxport.metrics import METRICS
from fxport.retention import RetentionPolicy, RetentionSweeper, span_text
from fxport.service.dispatch import Dispatcher
from fxport.service.limits import InFlightLimit, SpoolBudget
from fxport.service.messages import STATE_FROM_PROTO, event_to_proto, job_to_proto, timestamp
from fxport.service.tenancy import current_tenant
from fxport.service.uploads import SpooledFile, SpooledUpload, check_header, declared_bytes
from fxport.spec import JobSpec, load_spec_text, parse_spec
from fxport.storage import (
    JOB_ID_RE,
    SHA256_RE,
    ArtifactStore,
    ObjectNotFound,
    StorageError,
    input_key,
    job_prefix,
)
from fxport.v1 import conversion_pb2 as pb
from fxport.v1 import conversion_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

STREAM_TO_STORE_BYTES = 16 << 20  # smaller models go up in one request after the upload
WATCH_POLL_S = 1.0  # how long one blocking read waits before re-checking the client is still there
DEFAULT_URL_EXPIRY_S = 900
# How long an input counted before its bytes are stored (a submit's declared inputs, a presigned
# upload) is kept without the job that names it: an upload's time, then the retention sweep
# deletes what arrived for a submit that never came.
PENDING_INPUT_S = 3600.0
MAX_URL_EXPIRY_S = 7 * 24 * 3600
MAX_IDEMPOTENCY_KEY = 256
# A model this small goes to the store without asking first whether it is there: the HEAD would
# cost as much as the PUT, and the same bytes under their content address are the same object.
SMALL_INPUT_BYTES = 1 << 20
MISS_MEMO_S = 30.0  # how long CheckUpload's miss stands for the SubmitJob that follows it


def _toolchain_source(settings: Settings) -> Any:
    """Embedded: this process runs the jobs, so its own versions. Distributed: what the
    workers published in Redis (the API image has no torch). None: no Redis to read it from."""
    from fxport.toolchain import LocalToolchains, PublishedToolchains

    if settings.embedded:
        return LocalToolchains()
    url = settings.job_store_url() or settings.broker_url or ""
    if url.startswith(("redis://", "rediss://", "unix://")):
        return PublishedToolchains(url)
    return None


class RecentMisses:
    """Cache keys that CheckUpload looked up and missed a moment ago. The SubmitJob that follows
    (the client's next call) takes that miss instead of reading the entry again: one object-store
    read less for every new job. Each miss is taken once and stands for `ttl_s` at most; a result
    stored in between is then converted again, never served wrong."""

    def __init__(self, ttl_s: float = MISS_MEMO_S, limit: int = 4096) -> None:
        self.ttl_s, self.limit = ttl_s, limit
        self._at: dict[str, float] = {}
        self._lock = threading.Lock()

    def add(self, key: str) -> None:
        with self._lock:
            self._at.pop(key, None)
            self._at[key] = time.monotonic()
            while len(self._at) > self.limit:  # the oldest first (dicts keep insertion order)
                del self._at[next(iter(self._at))]

    def take(self, key: str) -> bool:
        with self._lock:
            at = self._at.pop(key, None)
        return at is not None and time.monotonic() - at < self.ttl_s


@functools.lru_cache(maxsize=64)
def _spec_of(text: str) -> JobSpec:
    """The spec a request's text holds, validated once per distinct text: CheckUpload and the
    SubmitJob that follows it carry the same text, and a CI fleet submits a few specs many times.
    A spec is frozen, so one validated instance serves every job that sends its text. Raises
    SpecError (not cached: a bad spec is checked again, and answered the same)."""
    return parse_spec(load_spec_text(text, source="spec"))


def _cache_allowed(header: pb.SubmitHeader) -> bool:
    """The submit may be answered from the cache: no `no_cache`, and a calibration file, if any,
    named by its digest."""
    return not header.no_cache and (not header.HasField("calibration") or bool(header.calibration.sha256))


class ConversionServicer(pb_grpc.ConversionServiceServicer):
    def __init__(
        self,
        settings: Settings,
        jobs: JobStore,
        artifacts: ArtifactStore,
        dispatcher: Dispatcher,
        tenant_of: Callable[[grpc.ServicerContext], str] = current_tenant,
        cache: ResultCache | None = None,
        toolchains: Any = None,
    ) -> None:
        self.settings = settings
        self.jobs = jobs
        self.artifacts = artifacts
        self.dispatcher = dispatcher
        self.tenant_of = tenant_of
        self.stopping = threading.Event()  # set when the server stops: open WatchJob streams end
        self.in_flight = InFlightLimit(jobs, settings.max_jobs_in_flight)
        self.spool = SpoolBudget(settings.max_spool_bytes)
        self.cache = cache if cache is not None else ResultCache.from_settings(artifacts, settings)
        self.recent_misses = RecentMisses()
        self.retention = RetentionPolicy(settings.job_retention_s, settings.max_finished_jobs_per_tenant)
        self.retention_sweeper: RetentionSweeper | None = None  # set by create_server when it sweeps
        # Where the workers' toolchain fingerprint comes from (fxport/toolchain.py).
        self.toolchains = toolchains if toolchains is not None else _toolchain_source(settings)

    # -- helpers ---------------------------------------------------------------------------

    def _after_create(self, tenant: str) -> None:
        """A new record: past the tenant's count limit, the retention sweep runs now rather than
        at its next interval, so a submit loop cannot outgrow the limit by more than one sweep."""
        keep = self.retention.keep_per_tenant
        if keep and self.retention_sweeper is not None and self.jobs.count_jobs(tenant) > keep:
            self.retention_sweeper.wake_for(tenant)

    def _owned(self, job_id: str, context: grpc.ServicerContext) -> JobRecord:
        """The job, if it exists and belongs to the caller's tenant; NOT_FOUND otherwise
        (another tenant's job is indistinguishable from a missing one)."""
        if not JOB_ID_RE.match(job_id or ""):
            raise InvalidRequest(f"job_id: {job_id[:80]!r} is not a job id")
        rec = self.jobs.get(job_id)
        if rec is None or rec.tenant != self.tenant_of(context):
            kept = f"; {self.retention.describe()}" if self.retention.active else ""
            raise NotFound(f"no job {job_id}{kept}")
        return rec

    def _stored_input(self, tenant: str, what: str, header: pb.FileHeader) -> InputRef:
        key = input_key(tenant, header.sha256)
        meta = self.artifacts.head(key)
        if meta is None:
            raise PreconditionFailed(f"{what}.stored is set but this server has no {what} with sha256 {header.sha256}; "
                                     "send the bytes")
        self._count_input(tenant, what, meta.sha256, meta.bytes, self._input_keep_until())
        return InputRef(sha256=meta.sha256, bytes=meta.bytes, filename=header.filename, key=key)

    def _count_input(self, tenant: str, what: str, sha256: str, size: int, keep_until: float) -> None:
        """Count one input against the tenant's quota (fxport/retention.py: the input ledger), or
        end the call with RESOURCE_EXHAUSTED naming the quota, its setting and what to do."""
        quota = self.settings.max_input_bytes_per_tenant
        admitted = self.jobs.reserve_input(tenant, sha256, size, keep_until, quota)
        if admitted.admitted:
            return
        METRICS.input_quota_refusals_total.inc()
        retention = self.settings.input_retention_s
        kept = (f"an input no QUEUED or RUNNING job names is deleted {span_text(retention)} after the last submit "
                "that used it" if retention else "inputs are kept for good")
        raise QuotaExceeded(
            f"{what}: tenant {tenant} has {admitted.used_bytes} bytes of stored inputs; these {size} bytes would pass "
            f"its quota of {quota} bytes (FXPORT_MAX_INPUT_BYTES_PER_TENANT). {kept.capitalize()} "
            "(FXPORT_INPUT_RETENTION_S): submit again once older inputs are gone, reuse a model already stored, or ask "
            "the operator to raise the quota")

    def _input_keep_until(self) -> float:
        """Until when an input a job was just submitted with is kept (FXPORT_INPUT_RETENTION_S)."""
        retention = self.settings.input_retention_s
        return self.jobs.clock() + retention if retention else KEEP_FOREVER

    def _count_declared_inputs(self, tenant: str, header: pb.SubmitHeader) -> None:
        """Before any byte moves: the inputs the header names by digest and size, counted for as
        long as an upload may take (the job's creation then keeps them for the retention time)."""
        until = self.jobs.clock() + PENDING_INPUT_S
        for what in ("model", "calibration"):
            file = getattr(header, what)
            if header.HasField(what) and file.sha256 and file.size:
                self._count_input(tenant, what, file.sha256, file.size, until)

    def _cache_lookup(self, tenant: str, model_sha256: str, calibration_sha256: str | None, spec: JobSpec,
                      *, prove: bool, before_submit: bool = False) -> Lookup:
        """The cached result for these inputs, spec and the workers' current toolchain (if any).
        A miss of CheckUpload's (`prove` False, or `before_submit`) is remembered for the
        SubmitJob that follows it, which then does not read the entry again."""
        from fxport.toolchain import job_fingerprint

        if not self.cache.enabled or self.toolchains is None:
            return Lookup(None, reason="cache off")
        engine = wants_engine(spec)
        fingerprint = job_fingerprint(self.toolchains.get("cpu"), self.toolchains.get("gpu") if engine else None,
                                      engine=engine)
        key = self.cache.key_for(tenant, model_sha256, calibration_sha256, spec, fingerprint)
        if key is None:
            return Lookup(None, reason="toolchain unknown")
        if prove and self.recent_misses.take(key):
            if before_submit:
                self.recent_misses.add(key)  # still missed, for the SubmitJob after this CheckUpload
            return Lookup(key, reason="CheckUpload missed it moments ago")
        try:
            METRICS.cache_entry_reads_total.inc()
            found = self.cache.lookup(key, prove=prove)
        except StorageError as exc:  # a store hiccup costs the hit, not the submit
            log.warning("cache lookup failed: %s", exc)
            return Lookup(key, reason=f"lookup failed: {exc}")
        if (before_submit or not prove) and not found.hit:  # CheckUpload: its SubmitJob comes next
            self.recent_misses.add(key)
        return found

    def _answer_from_cache(self, tenant: str, spec: JobSpec, header: pb.SubmitHeader, found: Lookup,
                           idempotency_key: str | None) -> pb.Job | None:
        """A new job in the caller's tenant, SUCCEEDED at once, sharing the cached artifacts; None when
        the job that made them was removed meanwhile (the submit then converts)."""
        entry = found.entry
        assert entry is not None
        now = time.time()
        calibration = None
        if entry.calibration_sha256:
            calibration = InputRef(sha256=entry.calibration_sha256, bytes=entry.calibration_bytes,
                                   filename=header.calibration.filename,
                                   key=input_key(tenant, entry.calibration_sha256))
        source = f" of job {entry.job_id}" if entry.tenant == tenant else ""
        rec = JobRecord(
            id=new_job_id(now), tenant=tenant, state=JobState.SUCCEEDED, progress=1.0,
            message=f"cache hit: the artifacts{source}, proof-checked", spec=spec,
            spec_digest=spec.digest(), labels=spec.labels,
            model=InputRef(sha256=entry.model_sha256, bytes=entry.model_bytes, filename=header.model.filename,
                           key=input_key(tenant, entry.model_sha256)),
            calibration=calibration, artifacts=entry.artifacts, cache_hit=True, idempotency_key=idempotency_key,
            created_at=now, updated_at=now, started_at=now, finished_at=now, artifacts_of=entry.job_id,
        )
        try:
            rec, created = self.jobs.create(rec)
        except IdempotencyConflict as exc:
            raise PreconditionFailed(str(exc)) from None
        except SharedArtifactsGone:  # retention removed the job that made them: convert instead
            log.info("cache entry of a removed job dropped", extra={"cache_key": found.key, "source": entry.job_id})
            self.cache.drop(entry.key)
            return None
        if created:
            self._after_create(tenant)
        METRICS.cache_hits_total.inc()
        with job_context(rec.id):
            log.info("job answered from the cache", extra={"tenant": tenant, "cache_key": found.key,
                                                          "check_s": round(found.check_s, 4),
                                                          "rehashed_bytes": found.rehashed_bytes})
        return job_to_proto(rec)

    def _validated_spec(self, text: str) -> JobSpec:
        """The request's spec text, size-checked and validated; otherwise the call ends with
        RESOURCE_EXHAUSTED (too big) or INVALID_ARGUMENT naming the field."""
        size = len(text.encode())
        if size > self.settings.max_spec_bytes:
            raise QuotaExceeded(f"spec is {size} bytes; the limit is {self.settings.max_spec_bytes}")
        return _spec_of(text)

    def _model_mirror(self, tenant: str, header: pb.FileHeader) -> Any:
        """A large model with a declared digest that the store lacks goes on to the store while
        it arrives (S3 multipart), instead of after: None where that does not apply."""
        if header.stored or not header.sha256 or header.size < STREAM_TO_STORE_BYTES:
            return None
        stream_upload = getattr(self.artifacts, "stream_upload", None)
        if stream_upload is None:
            return None
        try:
            key = input_key(tenant, header.sha256)
            return None if self.artifacts.head(key) is not None else stream_upload(key, header.sha256)
        except StorageError as exc:  # the ordinary path after the upload retries on its own
            log.warning("cannot stream the model to the store: %s", exc)
            return None

    def _store_input(self, tenant: str, what: str, spooled: SpooledFile) -> InputRef:
        key = input_key(tenant, spooled.sha256)
        self._count_input(tenant, what, spooled.sha256, spooled.size, self._input_keep_until())
        if spooled.stored is not None and spooled.stored.key == key:
            pass  # streamed to the store as it arrived, digest checked
        elif spooled.size < SMALL_INPUT_BYTES or self.artifacts.head(key) is None:
            # content-addressed: large bytes already there are not sent again
            self.artifacts.put_file(key, spooled.path, sha256=spooled.sha256)
        return InputRef(sha256=spooled.sha256, bytes=spooled.size, filename=spooled.filename, key=key)

    # -- RPCs ------------------------------------------------------------------------------

    def _answer_without_bytes(self, tenant: str, header: pb.SubmitHeader, *,
                              before_submit: bool = False) -> tuple[JobSpec, pb.Job | None, bool]:
        """SubmitJob's steps before any byte moves: the header checked, then the job its idempotency
        key already names, then the cached result. Returns (the spec, the job answered or None,
        whether the cache was looked up). Shared with CheckUpload's `submit_if_cached`
        (`before_submit`: a miss stands for the SubmitJob that follows)."""
        # 1. The spec, before anything is stored.
        spec = self._validated_spec(header.spec)
        if not header.HasField("model"):
            raise InvalidRequest("header.model is required")
        if len(header.idempotency_key) > MAX_IDEMPOTENCY_KEY:
            raise InvalidRequest(f"idempotency_key is longer than {MAX_IDEMPOTENCY_KEY} characters")
        check_header("model", header.model, self.settings.max_upload_bytes)
        if header.HasField("calibration"):
            check_header("calibration", header.calibration, self.settings.max_upload_bytes)
        # 2. A repeated submit with a known key is answered before any bytes move.
        key = header.idempotency_key or None
        if key:
            existing = self.jobs.find_idempotent(tenant, key)
            if existing is not None:
                if existing.spec_digest == spec.digest() and header.model.sha256 in ("", existing.model.sha256):
                    log.info("idempotent resubmit", extra={"job_id": existing.id})
                    return spec, job_to_proto(existing), False
                raise PreconditionFailed(str(IdempotencyConflict(existing)))
        # 3. The result cache, before any byte moves, when the header names the inputs' digests.
        calib_sha = header.calibration.sha256 if header.HasField("calibration") else None
        if _cache_allowed(header) and header.model.sha256:
            found = self._cache_lookup(tenant, header.model.sha256, calib_sha, spec, prove=True,
                                       before_submit=before_submit)
            if found.hit and not self._holds_inputs(tenant, found):
                return spec, None, False  # another tenant's result: looked up again once the bytes are hashed
            if found.hit:
                return spec, self._answer_from_cache(tenant, spec, header, found, key), True
            return spec, None, True  # looked up and missed: not again after the upload
        return spec, None, False

    def _holds_inputs(self, tenant: str, found: Lookup) -> bool:
        """Whether `tenant` may be answered from `found` before it sends a byte: the entry is its
        own tenant's, or the tenant's own copies of the inputs are in the store (each was checked
        against its sha256 when it came). A digest alone is no proof of holding a model: with
        FXPORT_CACHE_SHARE_ACROSS_TENANTS a tenant that sent only another tenant's model sha256
        got that tenant's artifacts. Such a submit is answered from the cache after its upload,
        from the digest of the bytes it sent."""
        entry = found.entry
        if entry is None or entry.tenant == tenant:
            return True
        digests = [entry.model_sha256, *([entry.calibration_sha256] if entry.calibration_sha256 else [])]
        try:
            return all(self.artifacts.exists(input_key(tenant, sha)) for sha in digests)
        except StorageError as exc:  # a store hiccup costs the early answer, not the submit
            log.warning("could not look for the tenant's inputs: %s", exc)
            return False

    def SubmitJob(self, request_iterator: Iterable[pb.SubmitJobRequest], context: grpc.ServicerContext) -> pb.Job:
        tenant = self.tenant_of(context)
        with tracing.span("fxport.SubmitJob", tenant=tenant) as span:
            job = self._submit(tenant, request_iterator)
            if span is not None:
                span.set_attribute("job_id", job.id)
                span.set_attribute("cache_hit", job.cache_hit)
            return job

    def _submit(self, tenant: str, request_iterator: Iterable[pb.SubmitJobRequest]) -> pb.Job:
        requests = iter(request_iterator)
        first = next(requests, None)
        if first is None or first.WhichOneof("payload") != "header":
            raise InvalidRequest("the first SubmitJobRequest must carry the header")
        header = first.header
        spec, answered, looked_up = self._answer_without_bytes(tenant, header)
        if answered is not None:
            return answered
        key = header.idempotency_key or None
        calib_sha = header.calibration.sha256 if header.HasField("calibration") else None
        use_cache = _cache_allowed(header) and not looked_up  # a header without digests: after the upload
        # A tenant at its in-flight limit, or whose new inputs would pass its quota, is refused
        # before any byte moves (and again at create, and once the bytes are hashed).
        self.in_flight.check(tenant)
        self._count_declared_inputs(tenant, header)
        # 4. Bytes: spooled to disk, checked, stored content-addressed.
        started = time.monotonic()
        # The spool bytes it declares are reserved before any arrive, and given back once its files are deleted.
        with (self.spool.reservation(tenant) as reserve,
              SpooledUpload(self.settings.spool_dir, self.settings.max_upload_bytes, reserve) as upload):
            reserve(declared_bytes(header))
            model_file, calib_file = upload.receive(header, requests, self._model_mirror(tenant, header.model))
            if use_cache and model_file is not None:  # a client that did not send the digest first
                found = self._cache_lookup(tenant, model_file.sha256, calib_file.sha256 if calib_file else calib_sha,
                                           spec, prove=True)
                answered = self._answer_from_cache(tenant, spec, header, found, key) if found.hit else None
                if answered is not None:
                    return answered
            received_s = time.monotonic() - started
            try:
                model = (self._store_input(tenant, "model", model_file) if model_file
                         else self._stored_input(tenant, "model", header.model))
                calibration = None
                if calib_file is not None:
                    calibration = self._store_input(tenant, "calibration", calib_file)
                elif header.HasField("calibration"):
                    calibration = self._stored_input(tenant, "calibration", header.calibration)
            except StorageError as exc:
                log.error("object store failure during submit: %s", exc)
                raise ServiceUnavailable(f"object store unavailable, try again: {exc}") from None
        upload_s = time.monotonic() - started
        if self.cache.enabled and not header.no_cache:
            METRICS.cache_misses_total.inc()
        # 5. The record, then the queue.
        job_id = new_job_id()
        rec = JobRecord(
            id=job_id, tenant=tenant, spec=spec, spec_digest=spec.digest(), labels=spec.labels,
            model=model, calibration=calibration, idempotency_key=key, task_id=job_id, message="queued",
            trace_context=tracing.carrier(),
        )
        try:
            with self.in_flight.admit(tenant):
                rec, created = self.jobs.create(rec)
        except IdempotencyConflict as exc:
            raise PreconditionFailed(str(exc)) from None
        with job_context(rec.id):
            if not created:
                return job_to_proto(rec)
            self._after_create(tenant)
            try:
                self.dispatcher.enqueue(rec.id)
            except Exception as exc:
                log.error("enqueue failed: %s", exc)
                self.jobs.transition(rec.id, state=JobState.FAILED, error=ErrorRecord(
                    stage="submit", code="enqueue_failed", message=f"could not queue the job: {exc}"))
                raise ServiceUnavailable(f"job queue unavailable, try again: {exc}") from None
            log.info("job submitted", extra={"tenant": tenant, "model_bytes": model.bytes,
                                             "upload_s": round(upload_s, 3), "received_s": round(received_s, 3),
                                             "targets": ",".join(spec.targets)})
        return job_to_proto(rec)

    def CheckUpload(self, request: pb.CheckUploadRequest, context: grpc.ServicerContext) -> pb.CheckUploadResponse:
        tenant = self.tenant_of(context)
        out = pb.CheckUploadResponse(max_upload_bytes=self.settings.max_upload_bytes)
        kinds = [kind for kind in ("model", "calibration") if getattr(request, f"{kind}_sha256")]
        for kind in kinds:
            if not SHA256_RE.match(getattr(request, f"{kind}_sha256")):
                raise InvalidRequest(f"{kind}_sha256: expected 64 lowercase hex digits")
        looked_up = False
        if request.HasField("submit_if_cached") and not request.no_cache and not request.submit_if_cached.no_cache:
            # A resubmission in one round trip: the job is made from the cache here, as SubmitJob would.
            _, answered, looked_up = self._answer_without_bytes(tenant, request.submit_if_cached,
                                                                before_submit=True)
            if answered is not None:
                out.job.CopyFrom(answered)
                out.cache_hit = answered.cache_hit
                return out
        if request.model_sha256 and not request.no_cache and not looked_up:
            spec = self._validated_spec(request.spec)
            # The cheap half of the proof (sizes and recorded digests): SubmitJob does the rest.
            found = self._cache_lookup(tenant, request.model_sha256, request.calibration_sha256 or None, spec,
                                       prove=False)
            out.cache_hit = found.hit and self._holds_inputs(tenant, found)
        if out.cache_hit:  # no bytes needed: whether the store holds the inputs is not asked (a round trip each)
            return out
        for kind in kinds:
            present = self.artifacts.exists(input_key(tenant, getattr(request, f"{kind}_sha256")))
            setattr(out, f"{kind}_present", present)
        if request.direct_upload and self.settings.direct_upload:
            self._offer_direct_uploads(tenant, request, out)
        return out

    def _offer_direct_uploads(self, tenant: str, request: pb.CheckUploadRequest, out: pb.CheckUploadResponse) -> None:
        """Presigned PUTs for the inputs the store lacks (S3 only): their bytes then go from the
        client to the store and never through this process. Each URL is bound to the tenant's
        content address, the declared size and sha256 (storage.S3Store.presigned_put)."""
        lo, hi = self.settings.direct_upload_min_bytes, self.settings.max_upload_bytes
        wanted = [(kind, getattr(request, f"{kind}_sha256"), getattr(request, f"{kind}_size"))
                  for kind in ("model", "calibration")]
        wanted = [(kind, sha, size) for kind, sha, size in wanted
                  if sha and not getattr(out, f"{kind}_present") and lo <= size <= hi]
        # A tenant at its in-flight limit gets no URL: SubmitJob refuses it before any byte moves.
        # Nor does a request without the spec of the submit that is to follow, which is validated
        # first: a URL is the first step of a submit, not free storage. Each input it may store is
        # counted against the quota now, and kept only until shortly after the URL expires unless
        # that submit comes (fxport/retention.py).
        if not wanted or not request.spec or self.in_flight.count(tenant) >= self.in_flight.limit:
            return
        self._validated_spec(request.spec)
        until = self.jobs.clock() + DEFAULT_URL_EXPIRY_S + PENDING_INPUT_S
        for kind, sha, size in wanted:
            self._count_input(tenant, kind, sha, size, until)
            try:
                signed = self.artifacts.presigned_put(input_key(tenant, sha), sha256=sha, size=size,
                                                      expires_s=DEFAULT_URL_EXPIRY_S)
            except Exception as exc:  # no URL costs the client a stream through here, nothing else
                log.warning("cannot presign an upload: %s", exc)
                return
            if signed is None:  # a store that cannot presign (file://)
                return
            target = getattr(out, f"{kind}_upload")
            target.url = signed[0]
            target.headers.update(signed[1])
            target.expires_at.CopyFrom(timestamp(time.time() + DEFAULT_URL_EXPIRY_S))
            METRICS.direct_upload_bytes_total.labels(kind).inc(size)

    def GetJob(self, request: pb.GetJobRequest, context: grpc.ServicerContext) -> pb.Job:
        return job_to_proto(self._owned(request.job_id, context))

    def ListJobs(self, request: pb.ListJobsRequest, context: grpc.ServicerContext) -> pb.ListJobsResponse:
        tenant = self.tenant_of(context)
        try:
            states = [STATE_FROM_PROTO[s] for s in request.states]
        except KeyError as exc:
            raise InvalidRequest(f"states: {exc.args[0]} is not a job state to filter on; valid: "
                                 + ", ".join(f"{pb.JobState.Name(v)} ({v})" for v in STATE_FROM_PROTO)) from None
        if request.page_size < 0:
            raise InvalidRequest("page_size: must not be negative")
        try:
            records, token = self.jobs.list(tenant, states=states, labels=dict(request.labels),
                                            page_size=request.page_size or 50, page_token=request.page_token or None)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        return pb.ListJobsResponse(jobs=[job_to_proto(r) for r in records], next_page_token=token or "")

    def WatchJob(self, request: pb.WatchJobRequest, context: grpc.ServicerContext) -> Iterator[pb.JobEvent]:
        rec = self._owned(request.job_id, context)
        after = max(0, request.after_seq)
        while context.is_active() and not self.stopping.is_set():
            events = self.jobs.read_events(rec.id, after, timeout=WATCH_POLL_S)
            for ev in events:
                after = ev.seq
                if ev.terminal:
                    yield event_to_proto(ev, self.jobs.get(rec.id))
                    return
                yield event_to_proto(ev)
            if not events:
                current = self.jobs.get(rec.id)
                if current is not None and current.terminal and (
                        current.last_seq <= after or not self.jobs.read_events(rec.id, after)):
                    # Resuming past the end, or the stream was trimmed or has expired (events_ttl_s):
                    # one terminal event, from the record.
                    yield self._terminal_event(current)
                    return

    @staticmethod
    def _terminal_event(rec: JobRecord) -> pb.JobEvent:
        from fxport.jobs import event_for

        return event_to_proto(event_for(rec, rec.last_seq), rec)

    def CancelJob(self, request: pb.CancelJobRequest, context: grpc.ServicerContext) -> pb.Job:
        rec = self._owned(request.job_id, context)
        with job_context(rec.id):
            if rec.terminal:
                return job_to_proto(rec)
            new, changed = self.jobs.transition(
                rec.id, state=JobState.CANCELLED, message="cancelled",
                error=ErrorRecord(stage=rec.stage, code="cancelled", message="cancelled by request"),
            )
            if new is None:  # removed by retention since _owned found it: it had finished
                raise NotFound(f"no job {rec.id}; {self.retention.describe()}")
            if changed:
                self.dispatcher.cancel(new)
                try:
                    self.artifacts.delete_prefix(job_prefix(rec.tenant, rec.id))
                except StorageError as exc:  # the worker removes them too when it sees the cancel
                    log.warning("could not remove partial artifacts: %s", exc)
                log.info("job cancelled", extra={"stage": rec.stage})
            return job_to_proto(new)

    def _artifact(self, rec: JobRecord, name: str) -> Any:
        """The job's artifact `name`: a result, or while the job runs one it stored early (staged)."""
        for art in (*rec.artifacts, *rec.staged):
            if art.name == name:
                return art
        names = ", ".join(a.name for a in (*rec.artifacts, *rec.staged)) or "none yet"
        raise NotFound(f"job {rec.id} has no artifact {name!r}; it has: {names}")

    def DownloadArtifact(
        self, request: pb.DownloadArtifactRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.DownloadArtifactResponse]:
        rec = self._owned(request.job_id, context)
        art = self._artifact(rec, request.name)
        yield pb.DownloadArtifactResponse(header=pb.ArtifactHeader(name=art.name, bytes=art.bytes, sha256=art.sha256))
        h = hashlib.sha256()
        try:
            for chunk in self.artifacts.iter_chunks(art.key):
                h.update(chunk)
                yield pb.DownloadArtifactResponse(chunk=chunk)
        except ObjectNotFound:
            raise DataLoss(f"artifact {art.name!r} is recorded but missing from the store") from None
        except StorageError as exc:
            raise ServiceUnavailable(f"object store: {exc}") from None
        if h.hexdigest() != art.sha256:
            with job_context(rec.id):
                if art in rec.staged:  # the worker stored it again meanwhile: the client fetches it at the end
                    log.info("staged artifact %s changed while it was read", art.name)
                else:
                    log.error("stored artifact %s does not match its sha256", art.name)
            raise DataLoss(f"artifact {art.name!r} in the store does not match its sha256")

    def GetArtifactUrl(
        self, request: pb.GetArtifactUrlRequest, context: grpc.ServicerContext
    ) -> pb.GetArtifactUrlResponse:
        rec = self._owned(request.job_id, context)
        art = self._artifact(rec, request.name)
        expires = min(max(request.expires_s or DEFAULT_URL_EXPIRY_S, 1), MAX_URL_EXPIRY_S)
        url = self.artifacts.presigned_url(art.key, expires)
        if url is None:
            raise PreconditionFailed("this server's artifact store cannot make presigned URLs; use DownloadArtifact")
        out = pb.GetArtifactUrlResponse(url=url, bytes=art.bytes, sha256=art.sha256)
        out.expires_at.CopyFrom(timestamp(time.time() + expires))
        return out
