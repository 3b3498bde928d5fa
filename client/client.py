"""The client library: `Client` submits jobs and `Job` follows and downloads them (re-exported by
`fxport.client`; see its docstring for the whole story)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import random
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import grpc

from fxport.client.errors import (
    IntegrityError,
    JobNotFound,
    RequestRefused,
    ServerUnreachable,
    TooLarge,
    WaitTimeout,
    from_rpc_error,
    is_busy,
    is_queue_full,
    retry_after,
)
from fxport.digest import remembered_sha256, write_checked
from fxport.errors import InvalidInput
from fxport.text import printable
from fxport.v1 import conversion_pb2 as pb
from fxport.v1 import conversion_pb2_grpc as pb_grpc

__all__ = ["Client", "Job", "JobEvent", "JobPage", "DEFAULT_SERVER"]

log = logging.getLogger(__name__)

DEFAULT_SERVER = "127.0.0.1:50051"
CHUNK = 1 << 20
DOWNLOAD_STREAMS = 4
TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED")
_MAX_MESSAGE = 8 << 20


DIRECT_URL_EXPIRY_S = 300
DIRECT_TIMEOUT_S = 5.0  # connect, and each read: a store that can't be reached from here costs this once
DIRECT_UPLOAD_IO_TIMEOUT_S = 60.0  # once connected, each write of an upload and the store's answer


class _DirectUnavailable(Exception):
    """The object store did not serve a presigned URL from here (unreachable, refused, expired)."""


def _url_chunks(url: str) -> Iterator[bytes]:
    """GET `url` in CHUNK pieces. Any failure to get the bytes (unreachable, refused, expired,
    cut off) raises _DirectUnavailable: the caller has the server relay the artifact instead."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=DIRECT_TIMEOUT_S) as resp:
            while chunk := resp.read(CHUNK):
                yield chunk
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise _DirectUnavailable(str(getattr(exc, "reason", exc))) from None


def _put_file(url: str, headers: Mapping[str, str], path: Path) -> None:
    """PUT the file at `path` to a presigned `url` with exactly `headers`, streamed from disk.
    Any failure (unreachable, refused, expired, the bytes not matching the signed sha256)
    raises _DirectUnavailable: the caller sends the bytes through the server instead."""
    import http.client
    import urllib.parse

    parts = urllib.parse.urlsplit(url)
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = kind(parts.hostname or "", parts.port, timeout=DIRECT_TIMEOUT_S, blocksize=CHUNK)
    try:
        conn.connect()
        if conn.sock is not None:  # connected: from here on the store may take its time per write
            conn.sock.settimeout(DIRECT_UPLOAD_IO_TIMEOUT_S)
        with open(path, "rb") as body:
            conn.request("PUT", parts.path + (f"?{parts.query}" if parts.query else ""), body=body,
                         headers=dict(headers))
            resp = conn.getresponse()
            answer = resp.read(4096)
        if resp.status != 200:
            raise _DirectUnavailable(f"the store answered {resp.status}: {answer[:300].decode('utf-8', 'replace')}")
    except (OSError, http.client.HTTPException, ValueError) as exc:
        raise _DirectUnavailable(str(exc)) from None
    finally:
        conn.close()


def _state_name(value: int) -> str:
    return pb.JobState.Name(value).removeprefix("JOB_STATE_")


def _ts(msg: Any, field_name: str) -> float | None:
    if not msg.HasField(field_name):
        return None
    return getattr(msg, field_name).ToNanoseconds() / 1e9


def _spec_text(spec: Any) -> str:
    if spec is None:
        return ""
    if isinstance(spec, Path):
        return spec.read_text()
    if isinstance(spec, str):
        return spec
    if hasattr(spec, "model_dump"):  # a JobSpec
        return json.dumps(spec.model_dump(mode="json"))
    if isinstance(spec, Mapping):
        return json.dumps(dict(spec))
    raise TypeError(f"spec must be a mapping, a JobSpec, YAML/JSON text or a Path, not {type(spec).__name__}")


def _artifact_dict(a: pb.Artifact) -> dict[str, Any]:
    return {"name": a.name, "format": a.format, "key": a.key, "bytes": a.bytes, "sha256": a.sha256}


def _safe_relative(name: str) -> PurePosixPath:
    """An artifact name from the server, as a path that cannot leave the destination folder."""
    p = PurePosixPath(name)
    if not name or p.is_absolute() or any(part in ("", ".", "..") for part in name.split("/")) or "\\" in name:
        raise IntegrityError(f"server sent an unsafe artifact name {name!r}")
    return p


@dataclass(frozen=True)
class JobEvent:
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
    def from_pb(cls, ev: pb.JobEvent) -> JobEvent:
        return cls(seq=ev.seq, job_id=ev.job_id, state=_state_name(ev.state), stage=printable(ev.stage),
                   progress=ev.progress, message=printable(ev.message), time=_ts(ev, "time"),
                   staged=_artifact_dict(ev.staged) if ev.HasField("staged") else None)

    def to_dict(self) -> dict[str, Any]:
        return {"seq": self.seq, "job_id": self.job_id, "state": self.state, "stage": self.stage,
                "progress": self.progress, "message": self.message, "time": self.time, "staged": self.staged}


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
        return _state_name(self._msg.state)

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
    def error(self) -> dict[str, str] | None:
        if not self._msg.HasField("error"):
            return None
        e = self._msg.error
        return {"stage": printable(e.stage), "code": printable(e.code), "message": printable(e.message),
                "detail": printable(e.detail)}

    @property
    def artifacts(self) -> list[dict[str, Any]]:
        return [_artifact_dict(a) for a in self._msg.artifacts]

    @property
    def staged_artifacts(self) -> list[dict[str, Any]]:
        """Artifacts already stored while the job runs, before verification ended (empty once it ends)."""
        return [_artifact_dict(a) for a in self._msg.staged_artifacts]

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
            "stage_timings": [{"stage": t.stage, "started_at": _ts(t, "started_at"),
                               "finished_at": _ts(t, "finished_at")} for t in m.stage_timings],
        }
        for f in ("created_at", "updated_at", "started_at", "finished_at"):
            out[f] = _ts(m, f)
        return out

    # -- calls -----------------------------------------------------------------------------
    def refresh(self) -> Job:
        self._msg = self._client._call(self._client._stub.GetJob, pb.GetJobRequest(job_id=self.id))
        return self

    def cancel(self) -> Job:
        self._msg = self._client._call(self._client._stub.CancelJob, pb.CancelJobRequest(job_id=self.id))
        return self

    def events(self, after_seq: int = 0, timeout: float | None = None) -> Iterator[JobEvent]:
        """Events until the job ends, reconnecting (from the last seq) when the stream drops."""
        c = self._client
        deadline = None if timeout is None else time.monotonic() + timeout
        after, backoff, down_since = after_seq, 0.2, None
        while True:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise WaitTimeout(f"job {self.id} did not finish within {timeout:g} s (last state {self.state})")
            try:
                stream = c._stub.WatchJob(pb.WatchJobRequest(job_id=self.id, after_seq=after),
                                          timeout=remaining, metadata=c._metadata)
                for ev in stream:
                    down_since, backoff = None, 0.2
                    after = ev.seq
                    if ev.HasField("job"):
                        self._msg = ev.job
                    event = JobEvent.from_pb(ev)
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
            pause = backoff if deadline is None else min(backoff, max(0.0, deadline - time.monotonic()))
            time.sleep(pause)
            backoff = min(backoff * 2, 5.0)

    def _final_event(self) -> JobEvent:
        """The terminal event, from the job record just read (when no stream told it)."""
        m = self._msg
        return JobEvent(seq=m.last_seq, job_id=m.id, state=self.state, stage=m.stage, progress=m.progress,
                        message=m.message, time=_ts(m, "finished_at") or _ts(m, "updated_at"))

    def wait(self, timeout: float | None = None, on_event: Callable[[JobEvent], Any] | None = None,
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
        with _EarlyDownloads(self, dest) if dest is not None else contextlib.nullcontext() as early:
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
        targets = [dest_dir.joinpath(*_safe_relative(art["name"]).parts) for art in wanted]

        def fetch(art: dict[str, Any], target: Path) -> Path:
            have = early.get(art["name"])
            if have is not None and have[1] == art["sha256"]:
                target.parent.mkdir(parents=True, exist_ok=True)
                os.replace(have[0], target)  # checked against this sha256 as it was written
                return target
            for attempt in range(3):
                try:
                    self._client._download_one(self.id, art, target)
                    break
                except ServerUnreachable:
                    if attempt == 2:
                        raise
                    time.sleep(0.5 * (attempt + 1))
            return target

        if len(wanted) <= 1:
            return [fetch(art, target) for art, target in zip(wanted, targets)]
        # Several streams at once: the server reads the store while this side hashes and writes.
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=min(DOWNLOAD_STREAMS, len(wanted))) as pool:
            return list(pool.map(fetch, wanted, targets))


class _EarlyDownloads:
    """Job.wait(download_to=...): each artifact stored while the job runs is fetched at once
    (two at a time) into `dest/.fxport-<job id>.partial/`, which is always removed on exit."""

    STREAMS = 2

    def __init__(self, job: Job, dest: Path) -> None:
        self.job = job
        self.dir = dest / f".fxport-{job.id}.partial"
        self._pool: Any = None
        self._futures: list[Any] = []
        self._lock = threading.Lock()
        self._fetched: dict[str, tuple[Path, str]] = {}

    def __enter__(self) -> _EarlyDownloads:
        return self

    def fetch(self, art: dict[str, Any]) -> None:
        try:
            rel = _safe_relative(art["name"])
        except IntegrityError as exc:
            log.warning("not fetching early: %s", exc)
            return
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self.dir.mkdir(parents=True, exist_ok=True)
            self._pool = ThreadPoolExecutor(max_workers=self.STREAMS, thread_name_prefix="fxport-early")
        # A folder per offer: the worker may store the same name again while an older copy comes down.
        target = self.dir.joinpath(str(len(self._futures)), *rel.parts)
        self._futures.append(self._pool.submit(self._fetch, art, target))

    def _fetch(self, art: dict[str, Any], target: Path) -> None:
        try:
            self.job._client._download_one(self.job.id, art, target, early=True)
        except Exception as exc:  # noqa: BLE001 - only a head start: fetched again at the end
            log.info("early download of %s failed: %s", art["name"], exc)
            return
        with self._lock:
            self._fetched[art["name"]] = (target, art["sha256"])

    def finish(self) -> dict[str, tuple[Path, str]]:
        """Wait for the fetches under way; name → (file, sha256) of the latest copy of each."""
        for future in self._futures:
            future.result()
        with self._lock:
            return dict(self._fetched)

    def __exit__(self, *exc: Any) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        shutil.rmtree(self.dir, ignore_errors=True)


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
        """`attempt()` again with backoff while it fails UNAVAILABLE and the budget lasts.
        Only for calls that are safe to repeat."""
        started, delay = time.monotonic(), 0.2
        while True:
            try:
                return attempt()
            except grpc.RpcError as err:
                if is_queue_full(err):  # the tenant's own queue: room comes as its jobs finish
                    wait = retry_after(err) or delay
                    if time.monotonic() - started + wait > self.queue_wait_s:
                        raise
                    time.sleep(wait * random.uniform(0.8, 1.2))
                    continue
                if is_busy(err):  # shared capacity taken (a stream slot, spool space): it frees as calls end
                    budget = self.retry_s
                elif err.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                else:
                    backend_down = ("fxport-retry", "backend") in tuple(err.trailing_metadata() or ())
                    budget = self.retry_s if backend_down else min(self.retry_s, self.UNREACHABLE_RETRY_S)
                if time.monotonic() - started + delay > budget:
                    raise
                time.sleep(delay * random.uniform(0.8, 1.2))
                delay = min(delay * 2, 5.0)

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
        model = Path(model_path)
        if not model.is_file():
            raise InvalidInput(f"model file {str(model)!r} not found", field="model")
        calib = Path(calibration) if calibration is not None else None
        if calib is not None and not calib.is_file():
            raise InvalidInput(f"calibration file {str(calib)!r} not found", field="calibration")
        text = _spec_text(spec)
        model_sha, model_size = remembered_sha256(model)
        calib_sha, calib_size = remembered_sha256(calib) if calib else ("", 0)
        idempotency_key = idempotency_key or f"auto-{uuid.uuid4().hex}"
        ask = pb.CheckUploadRequest(
            model_sha256=model_sha, calibration_sha256=calib_sha, spec=text, no_cache=no_cache,
            model_size=model_size, calibration_size=calib_size, direct_upload=self._direct_upload_works is not False)
        if not no_cache:  # a cached result comes back as the job itself: one round trip
            ask.submit_if_cached.CopyFrom(pb.SubmitHeader(
                spec=text, idempotency_key=idempotency_key,
                model=pb.FileHeader(filename=model.name, size=model_size, sha256=model_sha, stored=True)))
            if calib is not None:
                ask.submit_if_cached.calibration.CopyFrom(pb.FileHeader(filename=calib.name, size=calib_size,
                                                                        sha256=calib_sha, stored=True))
        check = self._call(self._stub.CheckUpload, ask)
        if check.HasField("job"):
            job = Job(self, check.job)
            job.upload = {"sent_bytes": 0, "skipped": "cache_hit" if check.job.cache_hit else "model_stored",
                          "direct": False}
            return job
        if check.max_upload_bytes and max(model_size, calib_size) > check.max_upload_bytes:
            big = "model" if model_size >= calib_size else "calibration"
            raise TooLarge(f"{big} is {max(model_size, calib_size)} bytes; the server accepts at most "
                           f"{check.max_upload_bytes} bytes")
        # A cache hit needs no bytes at all, stored or not.
        skip = {"model": check.model_present or check.cache_hit,
                "calibration": check.calibration_present or check.cache_hit}
        # Bytes the server offered a presigned PUT for go straight to the store; then they are stored.
        direct = {"model": False, "calibration": False}
        offers = (("model", model, check.model_upload), ("calibration", calib, check.calibration_upload))
        for kind, path, offer in offers:
            if path is not None and not skip[kind] and offer.url and self._direct_upload_works is not False:
                skip[kind] = direct[kind] = self._put_direct(path, offer)
        sent = [(model_size if direct["model"] else 0) + (calib_size if direct["calibration"] else 0)]
        header = pb.SubmitHeader(
            spec=text, idempotency_key=idempotency_key, no_cache=no_cache,
            model=pb.FileHeader(filename=model.name, size=model_size, sha256=model_sha, stored=skip["model"]),
        )
        if calib is not None:
            header.calibration.CopyFrom(pb.FileHeader(filename=calib.name, size=calib_size, sha256=calib_sha,
                                                      stored=skip["calibration"]))
        changed: list[str] = []

        def chunks(path: Path, expected: str, kind: str) -> Iterator[pb.SubmitJobRequest]:
            h = hashlib.sha256()
            with open(path, "rb") as f:
                while data := f.read(self.chunk_size):
                    h.update(data)
                    sent[0] += len(data)
                    chunk: dict[str, Any] = {kind: data}  # the oneof field: model_chunk or calibration_chunk
                    yield pb.SubmitJobRequest(**chunk)
            if h.hexdigest() != expected:  # the server refuses it too; say why here
                changed.append(str(path))

        def requests() -> Iterator[pb.SubmitJobRequest]:
            yield pb.SubmitJobRequest(header=header)
            if not header.model.stored:
                yield from chunks(model, model_sha, "model_chunk")
            if calib is not None and not header.calibration.stored:
                yield from chunks(calib, calib_sha, "calibration_chunk")

        try:
            try:
                # A fresh request stream per try; the idempotency key makes a repeat harmless.
                msg = self._retrying(lambda: self._stub.SubmitJob(requests(), metadata=self._metadata))
            except grpc.RpcError as err:
                relied_on_cache = check.cache_hit and not (check.model_present and
                                                           (calib is None or check.calibration_present))
                if err.code() != grpc.StatusCode.FAILED_PRECONDITION or not relied_on_cache:
                    raise
                # The cached result failed its proof check since CheckUpload: send the bytes after all.
                header.model.stored = check.model_present or direct["model"]
                if calib is not None:
                    header.calibration.stored = check.calibration_present or direct["calibration"]
                msg = self._retrying(lambda: self._stub.SubmitJob(requests(), metadata=self._metadata))
        except grpc.RpcError as err:
            if changed:
                raise InvalidInput(f"{changed[0]} changed while it was being uploaded; submit again") from None
            raise from_rpc_error(err, self.target) from None
        job = Job(self, msg)
        reason = None
        if msg.cache_hit:
            reason = "cache_hit"
        elif header.model.stored and not direct["model"]:
            reason = "model_stored"
        job.upload = {"sent_bytes": sent[0], "skipped": reason, "direct": any(direct.values())}
        return job

    def _put_direct(self, path: Path, offer: pb.UploadTarget) -> bool:
        """PUT `path` to the presigned URL the server offered. False when the store cannot be
        reached from here or refuses the bytes: then they go through the server, and this
        client stops asking for URLs (a store behind the cluster's network answers no better
        next time)."""
        try:
            _put_file(offer.url, offer.headers, path)
            return True
        except _DirectUnavailable as exc:
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
                url = self.artifact_url(job_id, art["name"], expires_s=DIRECT_URL_EXPIRY_S)
                self._write_verified(_url_chunks(url), art, target)
                self._direct_works = True
                return
            except (RequestRefused, _DirectUnavailable) as exc:  # no presigned URLs, or no way to the store
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
