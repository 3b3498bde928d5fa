"""The client library: `Client` submits jobs and `Job` follows and downloads them (re-exported by
`fxport.client`; see its docstring for the whole story)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from fxport.client import presigned
from fxport.client.downloads import EarlyDownloads, safe_relative
from fxport.client.errors import (
    IntegrityError,
    JobNotFound,
    RequestRefused,
    ServerUnreachable,
    WaitTimeout,
    from_rpc_error,
    is_busy,
    is_queue_full,
    retry_after,
)
from fxport.client.events import TERMINAL, ProgressEvent, artifact_dict, state_name, timestamp
from fxport.client.presigned import CHUNK
from fxport.client.uploads import KINDS, SubmitFiles, UploadStream
from fxport.digest import write_checked
from fxport.errors import InvalidInput
from fxport.retry import Backoff, retry_call
from fxport.text import printable
from fxport.v1 import conversion_pb2 as pb
from fxport.v1 import conversion_pb2_grpc as pb_grpc

__all__ = ["Client", "Job", "ProgressEvent", "JobPage", "DEFAULT_SERVER"]

log = logging.getLogger(__name__)

DEFAULT_SERVER = "127.0.0.1:50051"
DOWNLOAD_STREAMS = 4
_MAX_MESSAGE = 8 << 20

# Between tries of a call the server refused for now (UNAVAILABLE, busy, a full queue), and
# between reconnects of a dropped WatchJob stream: 0.2 s, doubling, at most 5 s, ±20 %.
CALL_BACKOFF = Backoff(first_s=0.2, max_s=5.0)
# Between the tries of one artifact's download when the server cannot be reached: 0.5 s, then 1 s.
DOWNLOAD_BACKOFF = Backoff(first_s=0.5, max_s=1.0, jitter=0.0)
DOWNLOAD_ATTEMPTS = 3


def _refused_for_now(err: BaseException) -> bool:
    """A refusal worth trying again: the tenant's queue is full, a capacity every tenant shares
    is taken, or the server (or its backend) is UNAVAILABLE."""
    return isinstance(err, grpc.RpcError) and (
        is_queue_full(err) or is_busy(err) or err.code() == grpc.StatusCode.UNAVAILABLE)


def _queue_wait(err: BaseException) -> float | None:
    """The `retry-after` a full queue's refusal asks for; None: the backoff's own pause."""
    return (retry_after(err) or None) if isinstance(err, grpc.RpcError) and is_queue_full(err) else None


class Job:
    """A job on the server. Attributes reflect the last fetch; `refresh()` re-reads."""

    def __init__(self, client: Client, message: pb.Job) -> None:
        self._client = client
        self._msg = message
        # Set by Client.submit: {"sent_bytes": N, "skipped": "cache_hit" | "model_stored" | None,
        # "direct": whether the bytes sent went straight to the object store (a presigned PUT)}.
        self.upload: dict[str, Any] | None = None
        # Set by wait(download_to=...) when the finished job lists artifacts (a failed one: its
        # manifest.json and report.html): the paths written there.
        self.downloaded: list[Path] | None = None

    def __repr__(self) -> str:
        return f"Job(id={self.id!r}, state={self.state!r}, stage={self.stage!r})"

    # -- fields ----------------------------------------------------------------------------
    @property
    def id(self) -> str:
        return self._msg.id

    @property
    def state(self) -> str:
        return state_name(self._msg.state)

    @property
    def stage(self) -> str:
        return printable(self._msg.stage)

    @property
    def progress(self) -> float:
        return self._msg.progress

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    @property
    def succeeded(self) -> bool:
        return self.state == "SUCCEEDED"

    @property
    def error(self) -> dict[str, str | None] | None:
        """The job's error record (fxport.errors.ErrorRecord's fields), or None."""
        if not self._msg.HasField("error"):
            return None
        e = self._msg.error
        return {"stage": printable(e.stage), "code": printable(e.code), "message": printable(e.message),
                "detail": printable(e.detail), "field": printable(e.field) or None}

    @property
    def artifacts(self) -> list[dict[str, Any]]:
        return [artifact_dict(a) for a in self._msg.artifacts]

    @property
    def staged_artifacts(self) -> list[dict[str, Any]]:
        """Artifacts already stored while the job runs, before verification ended (empty once it ends)."""
        return [artifact_dict(a) for a in self._msg.staged_artifacts]

    @property
    def spec(self) -> dict[str, Any]:
        return json.loads(self._msg.spec_json or "{}")

    @property
    def message(self) -> pb.Job:
        """The raw fxport.v1.Job protobuf message."""
        return self._msg

    def to_dict(self) -> dict[str, Any]:
        m = self._msg
        out: dict[str, Any] = {
            "id": m.id, "tenant": m.tenant, "state": self.state, "stage": self.stage, "progress": m.progress,
            "message": printable(m.message), "error": self.error, "artifacts": self.artifacts, "labels": dict(m.labels),
            "model": {"sha256": m.model.sha256, "bytes": m.model.bytes, "filename": m.model.filename},
            "calibration": ({"sha256": m.calibration.sha256, "bytes": m.calibration.bytes,
                             "filename": m.calibration.filename} if m.HasField("calibration") else None),
            "spec": self.spec, "spec_digest": m.spec_digest, "cache_hit": m.cache_hit, "worker": m.worker,
            "attempts": m.attempts, "idempotency_key": m.idempotency_key or None, "last_seq": m.last_seq,
            "stage_timings": [{"stage": t.stage, "started_at": timestamp(t, "started_at"),
                               "finished_at": timestamp(t, "finished_at")} for t in m.stage_timings],
        }
        for f in ("created_at", "updated_at", "started_at", "finished_at"):
            out[f] = timestamp(m, f)
        return out

    # -- calls -----------------------------------------------------------------------------
    def refresh(self) -> Job:
        self._msg = self._client._call(self._client._stub.GetJob, pb.GetJobRequest(job_id=self.id))
        return self

    def cancel(self) -> Job:
        self._msg = self._client._call(self._client._stub.CancelJob, pb.CancelJobRequest(job_id=self.id))
        return self

    def events(self, after_seq: int = 0, timeout: float | None = None) -> Iterator[ProgressEvent]:
        """Events until the job ends, reconnecting (from the last seq) when the stream drops."""
        c = self._client
        deadline = None if timeout is None else time.monotonic() + timeout
        after, reconnects, down_since = after_seq, 0, None
        while True:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise WaitTimeout(f"job {self.id} did not finish within {timeout:g} s (last state {self.state})")
            try:
                stream = c._stub.WatchJob(pb.WatchJobRequest(job_id=self.id, after_seq=after),
                                          timeout=remaining, metadata=c._metadata)
                for ev in stream:
                    down_since, reconnects = None, 0
                    after = ev.seq
                    if ev.HasField("job"):
                        self._msg = ev.job
                    event = ProgressEvent.from_pb(ev)
                    yield event
                    if event.terminal:
                        if not ev.HasField("job"):
                            self.refresh()
                        return
            except grpc.RpcError as err:
                code = err.code()
                if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise WaitTimeout(f"job {self.id} did not finish within {timeout:g} s "
                                      f"(last state {self.state})") from None
                if is_busy(err):
                    # No stream slot free on the server for now: follow the job by polling it
                    # (a short call, which always finds a thread) until one is.
                    self.refresh()
                    if self.terminal:
                        yield self._final_event()
                        return
                elif code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL,
                                  grpc.StatusCode.UNKNOWN):
                    raise from_rpc_error(err, c.target) from None
                else:
                    down_since = down_since or time.monotonic()
                    if time.monotonic() - down_since > c.reconnect_s:
                        raise from_rpc_error(err, c.target) from None
            # The stream ended without a terminal event (server restart), dropped, or was refused: resume.
            reconnects += 1
            pause = CALL_BACKOFF.pause(reconnects)
            time.sleep(pause if deadline is None else min(pause, max(0.0, deadline - time.monotonic())))

    def _final_event(self) -> ProgressEvent:
        """The terminal event, from the job record just read (when no stream told it)."""
        m = self._msg
        return ProgressEvent(seq=m.last_seq, job_id=m.id, state=self.state, stage=m.stage, progress=m.progress,
                        message=m.message, time=timestamp(m, "finished_at") or timestamp(m, "updated_at"))

    def wait(self, timeout: float | None = None, on_event: Callable[[ProgressEvent], Any] | None = None,
             download_to: str | os.PathLike[str] | None = None) -> Job:
        """Block until the job is SUCCEEDED, FAILED or CANCELLED; WaitTimeout after `timeout` s.

        `download_to`: then fetch what the finished job lists into that folder, as `download`
        does (every sha256 checked), and set `downloaded` to the paths: every artifact of a
        SUCCEEDED job; of a FAILED one, the manifest.json and report.html that say what went
        wrong (its error message sends the reader there); a CANCELLED job lists nothing.
        Artifacts the worker stores while the job still runs (it uploads each as soon as
        export wrote it) come down meanwhile, into a hidden folder there, so at SUCCEEDED only
        the rest is left to fetch; an early copy is kept only if its sha256 is the one the
        finished job lists, and the hidden folder is always removed. A job that failed or was
        cancelled raises nothing here, with or without `download_to`: `state` and `error` say so."""
        dest = None if download_to is None else Path(download_to)
        with EarlyDownloads(self, dest) if dest is not None else contextlib.nullcontext() as early:
            for event in self.events(timeout=timeout):
                if early is not None and event.staged is not None:
                    early.fetch(event.staged)
                if on_event is not None:
                    on_event(event)
            if early is not None:
                assert dest is not None  # early downloads run only with a destination
                self.downloaded = self._download_outcome(dest, early.finish())
        return self

    def _download_outcome(self, dest: Path, early: dict[str, tuple[Path, str]] | None = None) -> list[Path] | None:
        """What a finished job lists, into `dest`: every artifact of a SUCCEEDED job, the
        manifest.json and report.html a FAILED one keeps (the worker publishes only those).
        None when it lists nothing (a cancelled job): then nothing is put in `dest`.
        The one place `wait(download_to=...)`, and so `fxport submit --out`, fetch a result."""
        if not self.artifacts and not self.succeeded:
            return None
        return self._download(dest, None, early or {})

    def download(self, dest: str | os.PathLike[str], names: list[str] | None = None) -> list[Path]:
        """Fetch artifacts into `dest` (their names are relative paths), checking each sha256
        against both the stream header and the job record. Returns the written paths."""
        return self._download(Path(dest), names, {})

    def _download(self, dest_dir: Path, names: list[str] | None, early: dict[str, tuple[Path, str]]) -> list[Path]:
        """`early`: name → (file, sha256) fetched while the job ran; moved into place where the
        sha256 is the record's, instead of fetched again."""
        dest_dir.mkdir(parents=True, exist_ok=True)
        wanted = [a for a in self.artifacts if names is None or a["name"] in names]
        if names is not None and len(wanted) != len(set(names)):
            missing = set(names) - {a["name"] for a in wanted}
            raise JobNotFound(f"job {self.id} has no artifact(s) {sorted(missing)}")
        targets = [dest_dir.joinpath(*safe_relative(art["name"]).parts) for art in wanted]

        def fetch(art: dict[str, Any], target: Path) -> Path:
            have = early.get(art["name"])
            if have is not None and have[1] == art["sha256"]:
                target.parent.mkdir(parents=True, exist_ok=True)
                os.replace(have[0], target)  # checked against this sha256 as it was written
                return target
            retry_call(lambda: self._client._download_one(self.id, art, target), retry_if=ServerUnreachable,
                       max_attempts=DOWNLOAD_ATTEMPTS, backoff=DOWNLOAD_BACKOFF)
            return target

        if len(wanted) <= 1:
            return [fetch(art, target) for art, target in zip(wanted, targets)]
        # Several streams at once: the server reads the store while this side hashes and writes.
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=min(DOWNLOAD_STREAMS, len(wanted))) as pool:
            return list(pool.map(fetch, wanted, targets))


@dataclass
class JobPage:
    jobs: list[Job] = field(default_factory=list)
    next_page_token: str = ""

    def __iter__(self) -> Iterator[Job]:
        return iter(self.jobs)


class Client:
    """A connection to an fxport server.

    `tls`: None/False = plaintext (loopback, or behind a TLS-terminating proxy); True = TLS
    with the system roots; a path = TLS trusting that PEM CA bundle; or grpc.ChannelCredentials.
    `token` is sent as `authorization: Bearer <token>` on every call.
    """

    # Nothing answers at all (wrong address, server restarting): retry only this long, so a
    # mistyped --server fails fast; a server reporting its backend down gets `retry_s`.
    UNREACHABLE_RETRY_S = 2.0

    def __init__(self, target: str | None = None, token: str | None = None, tls: Any = None, *,
                 timeout: float = 30.0, reconnect_s: float = 60.0, chunk_size: int = CHUNK,
                 retry_s: float = 30.0, direct_download: bool | None = None, direct_upload: bool = True,
                 queue_wait_s: float = 300.0) -> None:
        """`direct_download`: fetch artifacts straight from the object store through presigned
        URLs (GetArtifactUrl) instead of through the server. None (default): when the server
        can presign and the store answers from here, else through the server; True: only
        directly; False: only through the server.

        `direct_upload`: PUT a model (or calibration file) the server offers a presigned URL for
        straight to the object store; when that fails, and from then on with this client, the
        bytes go through the server. False: always through the server.

        `queue_wait_s`: how long a submit waits for room when the tenant already has as many jobs
        queued or running as the server allows, resubmitting after each `retry-after` the server
        sends; past it QueueFull. 0: at once.

        With no `target` or `token`, FXPORT_SERVER and FXPORT_TOKEN are read, as the CLI reads
        them (default server: 127.0.0.1:50051, the embedded default)."""
        target = target or os.environ.get("FXPORT_SERVER") or DEFAULT_SERVER
        token = token if token is not None else os.environ.get("FXPORT_TOKEN") or None
        self.target = target
        self.direct_download = direct_download
        self._direct_works: bool | None = None  # learnt on the first artifact
        self._direct_upload_works: bool | None = None if direct_upload else False
        self.timeout = timeout
        self.reconnect_s = reconnect_s
        self.retry_s = retry_s
        self.queue_wait_s = queue_wait_s
        self.chunk_size = chunk_size
        options = [("grpc.max_receive_message_length", _MAX_MESSAGE), ("grpc.max_send_message_length", _MAX_MESSAGE)]
        if tls:
            if isinstance(tls, grpc.ChannelCredentials):
                creds = tls
            elif tls is True:
                creds = grpc.ssl_channel_credentials()
            else:
                creds = grpc.ssl_channel_credentials(root_certificates=Path(tls).read_bytes())
            self._channel = grpc.secure_channel(target, creds, options=options)
        else:
            self._channel = grpc.insecure_channel(target, options=options)
        self._stub = pb_grpc.ConversionServiceStub(self._channel)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def _retrying(self, attempt: Callable[[], Any]) -> Any:
        """`attempt()` again with backoff while the server refuses it for now and the budget lasts
        (`_retry_budget`). Only for calls that are safe to repeat."""
        return retry_call(attempt, retry_if=_refused_for_now, deadline_s=self._retry_budget, backoff=CALL_BACKOFF,
                          retry_after=_queue_wait)

    def _retry_budget(self, err: BaseException) -> float:
        """How long a call refused with `err` may be tried again: a full queue (the tenant's own:
        room comes as its jobs finish) for `queue_wait_s`; shared capacity taken (a stream slot,
        spool space: it frees as calls end) or a server reporting its backend down for
        `retry_s`; a server that does not answer at all only briefly."""
        assert isinstance(err, grpc.RpcError)  # _refused_for_now lets nothing else through
        if is_queue_full(err):
            return self.queue_wait_s
        if is_busy(err) or ("fxport-retry", "backend") in tuple(err.trailing_metadata() or ()):
            return self.retry_s
        return min(self.retry_s, self.UNREACHABLE_RETRY_S)

    def _call(self, method: Any, request: Any, timeout: float | None = None) -> Any:
        try:
            return self._retrying(lambda: method(request, timeout=timeout or self.timeout, metadata=self._metadata))
        except grpc.RpcError as err:
            raise from_rpc_error(err, self.target) from None

    def wait_ready(self, timeout: float = 10.0) -> None:
        """Block until the channel connects; ServerUnreachable otherwise."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise ServerUnreachable(f"fxport server {self.target} unreachable after {timeout:g} s") from None

    # -- jobs ------------------------------------------------------------------------------
    def submit(
        self,
        model_path: str | os.PathLike[str],
        spec: Any = None,
        calibration: str | os.PathLike[str] | None = None,
        idempotency_key: str | None = None,
        no_cache: bool = False,
    ) -> Job:
        """Upload a model (+ optional calibration data) with a spec; returns the QUEUED job, or
        a SUCCEEDED one with `cache_hit` when the server had the result already.

        `spec`: a mapping, a JobSpec, YAML/JSON text, or a Path to a spec file. The digests, the
        spec and the submit header go first (CheckUpload): a cached result comes back from it as
        the SUCCEEDED job, in one round trip; when the server already holds the model, no model
        bytes are sent either (`Job.upload` says which). `no_cache`: convert even if a
        cached result exists. Without `idempotency_key` one is generated, so that retrying
        after a lost response returns the same job."""
        files = SubmitFiles.read(model_path, spec, calibration, idempotency_key or f"auto-{uuid.uuid4().hex}",
                                 no_cache)
        check = self._call(self._stub.CheckUpload,
                           files.check_request(direct_upload=self._direct_upload_works is not False))
        if check.HasField("job"):
            job = Job(self, check.job)
            job.upload = {"sent_bytes": 0, "skipped": "cache_hit" if check.job.cache_hit else "model_stored",
                          "direct": False}
            return job
        files.check_size(check.max_upload_bytes)
        direct = self._put_offered(files, check)
        # A cache hit needs no bytes at all, stored or not.
        stored = {"model": check.model_present or check.cache_hit or direct["model"],
                  "calibration": check.calibration_present or check.cache_hit or direct["calibration"]}
        sent = sum(files.size(kind) for kind in KINDS if direct[kind])  # sent already, by presigned PUTs
        upload = UploadStream(files, files.header(stored), self.chunk_size, sent=sent)
        msg = self._submit_stream(upload, check, direct)
        job = Job(self, msg)
        reason = None
        if msg.cache_hit:
            reason = "cache_hit"
        elif upload.header.model.stored and not direct["model"]:
            reason = "model_stored"
        job.upload = {"sent_bytes": upload.sent, "skipped": reason, "direct": any(direct.values())}
        return job

    def _put_offered(self, files: SubmitFiles, check: pb.CheckUploadResponse) -> dict[str, bool]:
        """PUT each file the server offered a presigned URL for straight to the object store (once
        there, it is stored). Per kind: whether its bytes went that way."""
        direct = {"model": False, "calibration": False}
        skip = {"model": check.model_present or check.cache_hit,
                "calibration": check.calibration_present or check.cache_hit}
        offers = {"model": check.model_upload, "calibration": check.calibration_upload}
        for kind in KINDS:
            file, offer = files.file(kind), offers[kind]
            if file is not None and not skip[kind] and offer.url and self._direct_upload_works is not False:
                direct[kind] = self._put_direct(file.path, offer)
        return direct

    def _submit_stream(self, upload: UploadStream, check: pb.CheckUploadResponse, direct: dict[str, bool]) -> Any:
        """SubmitJob with `upload`'s requests, tried again while the server refuses it for now (a
        fresh request stream per try; the idempotency key makes a repeat harmless). A cached
        result that failed its proof check since CheckUpload: the bytes are sent after all."""
        header, calib = upload.header, upload.files.calibration

        def submit() -> Any:
            return self._retrying(lambda: self._stub.SubmitJob(upload.requests(), metadata=self._metadata))

        try:
            try:
                return submit()
            except grpc.RpcError as err:
                relied_on_cache = check.cache_hit and not (check.model_present and
                                                           (calib is None or check.calibration_present))
                if err.code() != grpc.StatusCode.FAILED_PRECONDITION or not relied_on_cache:
                    raise
                header.model.stored = check.model_present or direct["model"]
                if calib is not None:
                    header.calibration.stored = check.calibration_present or direct["calibration"]
                return submit()
        except grpc.RpcError as err:
            if upload.changed:
                raise InvalidInput(f"{upload.changed[0]} changed while it was being uploaded; submit again") from None
            raise from_rpc_error(err, self.target) from None

    def _put_direct(self, path: Path, offer: pb.UploadTarget) -> bool:
        """PUT `path` to the presigned URL the server offered. False when the store cannot be
        reached from here or refuses the bytes: then they go through the server, and this
        client stops asking for URLs (a store behind the cluster's network answers no better
        next time)."""
        try:
            presigned.put_file(offer.url, offer.headers, path)
            return True
        except presigned.DirectUnavailable as exc:
            log.info("direct upload of %s to the object store failed (%s); sending it through the server",
                     path.name, exc)
            self._direct_upload_works = False
            return False

    def get(self, job_id: str) -> Job:
        return Job(self, self._call(self._stub.GetJob, pb.GetJobRequest(job_id=job_id)))

    def job(self, job_id: str) -> Job:
        """Alias of get()."""
        return self.get(job_id)

    def cancel(self, job_id: str) -> Job:
        return Job(self, self._call(self._stub.CancelJob, pb.CancelJobRequest(job_id=job_id)))

    def list(self, *, states: list[str] | None = None, labels: Mapping[str, str] | None = None,
             page_size: int = 50, page_token: str = "") -> JobPage:
        """One page, newest first. `states` like ["RUNNING", "QUEUED"]; labels must all match.
        A page may hold fewer than `page_size` jobs, even none, and still carry a
        `next_page_token`: the server examines a bounded number of jobs per call. `iter_jobs`
        follows the tokens."""
        try:
            enum_states = [pb.JobState.Value("JOB_STATE_" + s.upper().removeprefix("JOB_STATE_")) for s in states or ()]
        except ValueError:
            valid = ", ".join(TERMINAL + ("QUEUED", "RUNNING"))
            raise InvalidInput(f"unknown state in {states}; valid: {valid}") from None
        resp = self._call(self._stub.ListJobs, pb.ListJobsRequest(
            page_size=page_size, page_token=page_token, states=enum_states, labels=dict(labels or {})))
        return JobPage([Job(self, m) for m in resp.jobs], resp.next_page_token)

    def iter_jobs(self, **filters: Any) -> Iterator[Job]:
        """Every job matching the filters, across pages."""
        token = ""
        while True:
            page = self.list(page_token=token, **filters)
            yield from page.jobs
            token = page.next_page_token
            if not token:
                return

    def artifact_url(self, job_id: str, name: str, expires_s: int = 900) -> str:
        resp = self._call(self._stub.GetArtifactUrl,
                          pb.GetArtifactUrlRequest(job_id=job_id, name=name, expires_s=expires_s))
        return resp.url

    def _download_one(self, job_id: str, art: dict[str, Any], target: Path, *, early: bool = False) -> None:
        """One artifact into `target`, its bytes and sha256 checked against the job record:
        from the object store directly when it can be (`direct_download`), else streamed by
        the server (DownloadArtifact). `early`: a staged artifact of a running job, which the
        worker may still replace or delete: a failed direct fetch only raises, and teaches
        nothing about whether the store can be reached from here."""
        if self.direct_download is not False and self._direct_works is not False:
            try:
                url = self.artifact_url(job_id, art["name"], expires_s=presigned.DIRECT_URL_EXPIRY_S)
                self._write_verified(presigned.url_chunks(url), art, target)
                self._direct_works = True
                return
            except (RequestRefused, presigned.DirectUnavailable) as exc:  # no presigned URLs, or no way to the store
                if early and not isinstance(exc, RequestRefused):
                    raise ServerUnreachable(f"{art['name']}: {exc}") from None
                if self.direct_download:
                    raise ServerUnreachable(f"{art['name']}: cannot download directly from the object store "
                                            f"({exc}); use direct_download=False to have the server relay it") from None
                self._direct_works = False  # not from here: the server relays, this time and after
        def relayed() -> None:
            stream = self._stub.DownloadArtifact(pb.DownloadArtifactRequest(job_id=job_id, name=art["name"]),
                                                 metadata=self._metadata)
            header: dict[str, str] = {}

            def chunks() -> Iterator[bytes]:
                for msg in stream:
                    if msg.WhichOneof("payload") == "header":
                        header["sha256"] = msg.header.sha256
                        continue
                    yield msg.chunk

            self._write_verified(chunks(), art, target, header)

        try:
            self._retrying(relayed)  # again only when refused at once (no stream slot, server unreachable)
        except grpc.RpcError as err:
            raise from_rpc_error(err, self.target) from None

    @staticmethod
    def _write_verified(chunks: Iterator[bytes], art: dict[str, Any], target: Path,
                        header: dict[str, str] | None = None) -> None:
        """Write `chunks` to target.part, hashing as they come; rename into place only when size
        and sha256 match the job record (and the stream's own header, if it sent one)."""

        def check(n: int, digest: str) -> None:
            expected = {art["sha256"], (header or {}).get("sha256") or art["sha256"]}
            if len(expected) != 1 or digest not in expected or n != art["bytes"]:
                raise IntegrityError(
                    f"{art['name']}: downloaded {n} bytes with sha256 {digest}, expected {art['bytes']} bytes "
                    f"with sha256 {art['sha256']}"
                )

        write_checked(chunks, target, check)
