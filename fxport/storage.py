"""Artifact and input storage: one interface, an S3 backend and a filesystem backend.

Every object carries its sha256 (S3 user metadata `sha256`, or a sidecar record in the
filesystem store) and `get` verifies it, so a corrupted or truncated object is an error,
never a silently wrong model. Keys are built only by the key builders below, from ids
that match strict patterns: no user-supplied text ever becomes a path component
unchecked.

boto3 is imported only when an S3 store is opened: the thin client never pays for it.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import logging
import os
import random
import re
import shutil
import tempfile
import time
import urllib.parse
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, TypeVar

from fxport.digest import CHUNK, sha256_file, write_checked  # noqa: F401 (sha256_file: re-exported)
from fxport.errors import FxportError

log = logging.getLogger(__name__)

_T = TypeVar("_T")

# ---------------------------------------------------------------------------------------
# Keys (DESIGN.md §4): {tenant}/inputs/{sha256}, {tenant}/jobs/{job_id}/{name}
# ---------------------------------------------------------------------------------------

TENANT_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
JOB_ID_RE = re.compile(r"^[0-9a-z]{26}$")  # a lowercase ULID (fxport.jobs.new_job_id)
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_SEGMENT_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+-]{0,127}$")
MAX_NAME_SEGMENTS = 4


class StorageError(FxportError):
    code = "storage"


class ObjectNotFound(StorageError):
    code = "not_found"


class StoreUnreachable(StorageError):
    """The object store did not answer within the retry budget."""

    code = "store_unreachable"


class IntegrityError(StorageError):
    """Bytes read back do not match the sha256 recorded when they were written."""

    code = "integrity"


class InvalidKey(StorageError):
    code = "invalid_key"


class _Exactly(io.RawIOBase):
    """The first `n` bytes of the open file `f`, as a request body: a file that shrinks while it
    is sent (a sandboxed model rewriting its output) raises IntegrityError at once, where a plain
    file would send fewer bytes than the request's Content-Length and leave the store waiting for
    the rest until its read timeout (60 s: a failed job's upload once took that long)."""

    def __init__(self, f: IO[bytes], n: int, path: Path) -> None:
        super().__init__()
        self.f, self.n, self.path, self.pos = f, n, path, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.n}[whence]
        self.pos = max(0, min(self.n, base + offset))
        self.f.seek(self.pos)
        return self.pos

    def read(self, size: int | None = -1) -> bytes:
        want = self.n - self.pos if size is None or size < 0 else min(size, self.n - self.pos)
        data = self.f.read(want) if want else b""
        if len(data) < want:
            raise IntegrityError(f"{self.path} changed while it was being stored")
        self.pos += len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)


def _check(pattern: re.Pattern[str], value: str, what: str) -> str:
    if not isinstance(value, str) or not pattern.match(value):
        raise InvalidKey(f"invalid {what} {value!r}: must match {pattern.pattern}", stage="upload")
    return value


def check_artifact_name(name: str) -> str:
    """A relative artifact path: 1-4 segments of [A-Za-z0-9_.+-], none starting with '.'."""
    if not isinstance(name, str) or len(name) > 512:
        raise InvalidKey(f"invalid artifact name {name!r}", stage="upload")
    parts = name.split("/")
    if len(parts) > MAX_NAME_SEGMENTS or not all(_SEGMENT_RE.match(p) for p in parts):
        raise InvalidKey(
            f"invalid artifact name {name!r}: up to {MAX_NAME_SEGMENTS} '/'-separated segments of "
            "letters, digits, _ . + -, none starting with '.'",
            stage="upload",
        )
    return name


def check_tenant(tenant: str) -> str:
    """A tenant name as keys use it (InvalidKey otherwise)."""
    return _check(TENANT_RE, tenant, "tenant")


def input_key(tenant: str, sha256: str) -> str:
    return f"{_check(TENANT_RE, tenant, 'tenant')}/inputs/{_check(SHA256_RE, sha256, 'sha256')}"


def job_prefix(tenant: str, job_id: str) -> str:
    return f"{_check(TENANT_RE, tenant, 'tenant')}/jobs/{_check(JOB_ID_RE, job_id, 'job id')}/"


def artifact_key(tenant: str, job_id: str, name: str) -> str:
    return job_prefix(tenant, job_id) + check_artifact_name(name)


# ---------------------------------------------------------------------------------------
# Interface
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StoredObject:
    key: str
    bytes: int
    sha256: str
    # Changes whenever the object is rewritten (S3: ETag + Last-Modified; files: inode, size,
    # mtime); "" when unknown. Lets a reader skip re-hashing bytes it already proved.
    version: str = field(default="", compare=False)


def write_verified(key: str, chunks: Iterable[bytes], meta: StoredObject, dest: Path) -> StoredObject:
    """Write `chunks` to `dest` through a .part file, hashing as they come; `dest` appears only
    if size and sha256 match `meta`, else IntegrityError and nothing is left behind."""

    def check(n: int, digest: str) -> None:
        if digest != meta.sha256 or n != meta.bytes:
            raise IntegrityError(
                f"object {key!r} is corrupt: read {n} bytes with sha256 {digest[:12]}…, "
                f"recorded {meta.bytes} bytes with sha256 {meta.sha256[:12]}…"
            )

    write_checked(chunks, dest, check)
    return meta


class ArtifactStore(ABC):
    """Content with its sha256. Keys come from `input_key` / `artifact_key`."""

    url: str

    @abstractmethod
    def put_file(self, key: str, path: Path, *, sha256: str | None = None) -> StoredObject:
        """Store a local file. `sha256` (if the caller already computed it) skips a re-read."""

    def put_stream(self, key: str, stream: IO[bytes], *, spool_dir: Path | None = None) -> StoredObject:
        """Store a byte stream. It is spooled to a temp file first: the sha256 has to be known
        before an S3 upload starts (it travels as object metadata) and memory stays bounded."""
        with tempfile.NamedTemporaryFile(dir=spool_dir, prefix="fxport-put-", delete=True) as tmp:
            h = hashlib.sha256()
            while chunk := stream.read(CHUNK):
                h.update(chunk)
                tmp.write(chunk)
            tmp.flush()
            return self.put_file(key, Path(tmp.name), sha256=h.hexdigest())

    def put_snapshot(self, key: str, path: Path, *, spool_dir: Path | None = None) -> StoredObject:
        """Store what `path` holds now while another process may still write to it (a running
        sandbox's output): the object always holds exactly the bytes its recorded sha256 names,
        or StorageError and nothing is stored. Here by a private copy, hashed as it is made."""
        with open(path, "rb") as f:
            return self.put_stream(key, f, spool_dir=spool_dir)

    @abstractmethod
    def head(self, key: str) -> StoredObject | None:
        """Size and recorded sha256, or None if there is no such object."""

    def exists(self, key: str) -> bool:
        return self.head(key) is not None

    @abstractmethod
    def iter_chunks(self, key: str, chunk_size: int = CHUNK) -> Iterator[bytes]:
        """Stream the object's bytes (unverified: the reader hashes and compares)."""

    def get(self, key: str, dest: Path) -> StoredObject:
        """Download to `dest`, verifying the sha256; a mismatch removes `dest` and raises."""
        meta = self.head(key)
        if meta is None:
            raise ObjectNotFound(f"no object {key!r} in {self.url}")
        return write_verified(key, self.iter_chunks(key), meta, dest)

    @abstractmethod
    def delete_object(self, key: str) -> None:
        """Delete one object (no error if there is none)."""

    @abstractmethod
    def delete_prefix(self, prefix: str) -> int:
        """Delete every object whose key starts with `prefix` (must end with '/'). Returns the count."""

    @abstractmethod
    def list_prefix(self, prefix: str) -> list[StoredObject]:
        """Objects under `prefix`, with their recorded sha256."""

    def presigned_url(self, key: str, expires_s: int = 900) -> str | None:
        """A time-limited GET URL, or None when the backend cannot make one."""
        return None

    def presigned_put(self, key: str, *, sha256: str, size: int,
                      expires_s: int = 900) -> tuple[str, dict[str, str]] | None:
        """A time-limited PUT URL, and the headers to send with it, that can store exactly `size`
        bytes hashing to `sha256` under `key` and nothing else; None when the backend cannot."""
        return None


def _check_prefix(prefix: str) -> None:
    # A bare "" or "tenant" prefix would delete far more than one job's files.
    if not prefix.endswith("/") or prefix.count("/") < 2:
        raise InvalidKey(f"refusing to delete prefix {prefix!r}: expected e.g. 'tenant/jobs/ID/'")


# ---------------------------------------------------------------------------------------
# Filesystem (embedded mode)
# ---------------------------------------------------------------------------------------


class FileStore(ArtifactStore):
    """Objects under ROOT/objects/<key>, their sha256 under ROOT/meta/<key>.json.

    A write goes to a temp file in the same filesystem and is renamed into place, so a
    reader never sees half an object; the meta file is written first and the object
    rename is the commit point (an object without meta is never listed as present).
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root).resolve()
        self.url = f"file://{self.root}"
        (self.root / "objects").mkdir(parents=True, exist_ok=True)
        (self.root / "meta").mkdir(parents=True, exist_ok=True)
        (self.root / "tmp").mkdir(parents=True, exist_ok=True)

    def _paths(self, key: str) -> tuple[Path, Path]:
        if key.startswith("/") or ".." in key.split("/"):
            raise InvalidKey(f"invalid key {key!r}")
        return self.root / "objects" / key, self.root / "meta" / (key + ".json")

    def put_file(self, key: str, path: Path, *, sha256: str | None = None) -> StoredObject:
        obj, meta = self._paths(key)
        obj.parent.mkdir(parents=True, exist_ok=True)
        meta.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.root / "tmp", prefix="put-")
        try:
            h, n = hashlib.sha256(), 0
            with os.fdopen(fd, "wb") as out, open(path, "rb") as src:
                while chunk := src.read(CHUNK):
                    h.update(chunk)
                    n += len(chunk)
                    out.write(chunk)
            digest = h.hexdigest()
            if sha256 is not None and sha256 != digest:
                raise IntegrityError(f"{path} changed while being stored (sha256 {digest} != {sha256})")
            stored = StoredObject(key=key, bytes=n, sha256=digest)
            _atomic_write_text(meta, json.dumps({"sha256": digest, "bytes": n}))
            os.replace(tmp, obj)
        finally:
            Path(tmp).unlink(missing_ok=True)
        return stored

    def put_snapshot(self, key: str, path: Path, *, spool_dir: Path | None = None) -> StoredObject:
        # put_file copies into the store and records the digest of that copy: the copy is the snapshot.
        return self.put_file(key, path)

    def head(self, key: str) -> StoredObject | None:
        obj, meta = self._paths(key)
        try:
            st = obj.stat()
            data = json.loads(meta.read_text())
        except (OSError, ValueError):
            return None
        if not obj.is_file():
            return None
        return StoredObject(key=key, bytes=int(data["bytes"]), sha256=str(data["sha256"]),
                            version=f"{st.st_ino}:{st.st_size}:{st.st_mtime_ns}")

    def iter_chunks(self, key: str, chunk_size: int = CHUNK) -> Iterator[bytes]:
        obj, _ = self._paths(key)
        try:
            f = open(obj, "rb")
        except FileNotFoundError:
            raise ObjectNotFound(f"no object {key!r} in {self.url}") from None
        with f:
            while chunk := f.read(chunk_size):
                yield chunk

    def delete_object(self, key: str) -> None:
        obj, meta = self._paths(key)
        obj.unlink(missing_ok=True)  # first: an object without meta is never listed
        meta.unlink(missing_ok=True)

    def delete_prefix(self, prefix: str) -> int:
        _check_prefix(prefix)
        count = 0
        for base in ("objects", "meta"):
            d = self.root / base / prefix.rstrip("/")
            if d.is_dir():
                if base == "objects":
                    count = sum(1 for p in d.rglob("*") if p.is_file())
                shutil.rmtree(d, ignore_errors=True)
        return count

    def list_prefix(self, prefix: str) -> list[StoredObject]:
        base = self.root / "objects"
        d = base / prefix.rstrip("/")
        if not d.is_dir():
            return []
        out = []
        for p in sorted(d.rglob("*")):
            if p.is_file():
                meta = self.head(p.relative_to(base).as_posix())
                if meta is not None:
                    out.append(meta)
        return out


def _atomic_write_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".meta-")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------
# S3 (distributed mode)
# ---------------------------------------------------------------------------------------


class S3Store(ArtifactStore):
    """An S3 bucket (optionally under a prefix) through boto3 with SigV4.

    Endpoint, region and credentials come the way every AWS tool reads them
    (AWS_ENDPOINT_URL, AWS_DEFAULT_REGION, AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, profiles,
    IRSA). Large files go up as multipart uploads (boto3's transfer manager). Each S3 call is
    retried briefly by botocore ("standard" mode), and the whole operation (a transfer from
    its start) by our own loop with exponential backoff for as long as `retry_s` allows, so
    an object store that is down for a while (a restart, a failover) costs time, not the job.
    Past the budget: StorageError "object store unreachable at <endpoint> after N attempts
    over T s". Only connection failures and 5xx answers are retried; 403/404 fail at once.
    """

    BACKOFF_START_S = 0.2
    BACKOFF_MAX_S = 5.0

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        # Parts of 8 MiB sent 4 at a time from 16 MiB up: a 48 MB model went up in 0.5 s instead
        # of 0.75-0.9 s as one PUT (SeaweedFS on loopback, bench/bench_cache.py's machine).
        multipart_threshold: int = 16 << 20,
        multipart_chunksize: int = 8 << 20,
        max_concurrency: int = 4,
        retry_s: float = 60.0,
    ) -> None:
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.url = f"s3://{bucket}/{self.prefix}".rstrip("/")
        # Without signature_version="s3v4" presigned URLs come out SigV2 (ENVIRONMENT.md).
        cfg = Config(
            signature_version="s3v4",
            # One inner retry (it saves a multipart upload's other parts; it sleeps at random): the
            # budget itself is kept by _retry.
            retries={"max_attempts": 2, "mode": "standard"},
            connect_timeout=5,
            read_timeout=60,
            s3={"addressing_style": "path"},
            # CRC32 on every request and response is botocore's default since 1.36; the sha256 of
            # every object is ours to check already, and S3-compatible stores vary in what they
            # accept. Checksums only where the API requires them.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        session = boto3.session.Session()
        self._s3 = session.client("s3", endpoint_url=endpoint_url, config=cfg)
        self.endpoint = self._s3.meta.endpoint_url
        self.retry_s = float(retry_s)
        self._transfer = TransferConfig(
            multipart_threshold=multipart_threshold,
            multipart_chunksize=multipart_chunksize,
            max_concurrency=max_concurrency,
            use_threads=max_concurrency > 1,
        )

    def _k(self, key: str) -> str:
        return self.prefix + key

    def _retry(self, what: str, fn: Callable[[], _T]) -> _T:
        """Run `fn` until it succeeds, fails for a reason retrying cannot fix, or the budget ends."""
        started = time.monotonic()
        delay, attempt = self.BACKOFF_START_S, 0
        while True:
            attempt += 1
            try:
                return fn()
            except StorageError:
                raise  # an inner operation already spent its budget (or is not transient)
            except Exception as exc:
                if not _transient(exc):
                    raise
                elapsed = time.monotonic() - started
                # The jittered pause is what counts against the budget: no attempt starts past
                # it. The last attempt may still run over by its own length (botocore's inner
                # retry sleeps at random: 0.15-2.7 s per attempt against a dead endpoint), and
                # the message reports the time as it was.
                pause = delay * random.uniform(0.8, 1.2)
                if elapsed + pause > self.retry_s:
                    raise StoreUnreachable(
                        f"{what}: object store unreachable at {self.endpoint} after {attempt} attempts over "
                        f"{elapsed:.1f} s ({type(exc).__name__}: {exc})",
                        hint="check that the S3 endpoint is up and reachable; FXPORT_STORE_RETRY_S sets the budget",
                    ) from exc
                log.warning("retrying %s in %.1f s after %s (attempt %d)", what, pause, type(exc).__name__, attempt)
                time.sleep(pause)
                delay = min(delay * 2, self.BACKOFF_MAX_S)

    def put_file(self, key: str, path: Path, *, sha256: str | None = None) -> StoredObject:
        if sha256 is not None:
            # The caller's digest goes up as metadata at once; the file is re-hashed while it
            # uploads (another core, the page cache) instead of before, and an object that
            # turns out not to match is deleted again.
            return self._put_checked(key, path, sha256)
        digest, n = sha256_file(path)
        self._upload(key, path, digest)
        return StoredObject(key=key, bytes=n, sha256=digest)

    def put_stream(self, key: str, stream: IO[bytes], *, spool_dir: Path | None = None) -> StoredObject:
        # The spool is ours alone and was hashed as it was written: upload it as it is.
        with tempfile.NamedTemporaryFile(dir=spool_dir, prefix="fxport-put-", delete=True) as tmp:
            h, n = hashlib.sha256(), 0
            while chunk := stream.read(CHUNK):
                h.update(chunk)
                n += len(chunk)
                tmp.write(chunk)
            tmp.flush()
            digest = h.hexdigest()
            self._upload(key, Path(tmp.name), digest)
        return StoredObject(key=key, bytes=n, sha256=digest)

    SINGLE_PUT_MAX = 5 << 30  # the largest object S3 takes in one PUT

    def put_snapshot(self, key: str, path: Path, *, spool_dir: Path | None = None) -> StoredObject:
        """No private copy: the file is hashed, then sent in one PUT that carries the digest as
        x-amz-checksum-sha256, which the store checks against the bytes it receives; bytes that
        changed in between are refused (IntegrityError) and nothing is stored. A store that does
        not confirm the checksum gets the copy (the base class) instead."""
        from botocore.exceptions import ClientError

        if path.stat().st_size > self.SINGLE_PUT_MAX:
            return super().put_snapshot(key, path, spool_dir=spool_dir)
        digest, n = sha256_file(path)
        checksum = _checksum_sha256(digest)

        def put() -> dict[str, Any]:
            with open(path, "rb") as f:
                answer: dict[str, Any] = self._s3.put_object(
                    Bucket=self.bucket, Key=self._k(key), Body=_Exactly(f, n, path), ContentLength=n,
                    Metadata={"sha256": digest}, ChecksumSHA256=checksum)
                return answer

        try:
            resp = self._retry(f"upload {key}", put)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("BadDigest", "XAmzContentSHA256Mismatch"):
                raise IntegrityError(f"{path} changed while it was being stored") from None
            raise
        if resp.get("ChecksumSHA256") != checksum:  # the store did not say it checked the bytes
            self.delete_object(key)
            return super().put_snapshot(key, path, spool_dir=spool_dir)
        return StoredObject(key=key, bytes=n, sha256=digest)

    def _put_checked(self, key: str, path: Path, sha256: str) -> StoredObject:
        import concurrent.futures

        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            hashed = pool.submit(sha256_file, path)
            try:
                self._upload(key, path, sha256)
            finally:
                digest, n = hashed.result()
        if digest != sha256:
            self.delete_object(key)
            raise IntegrityError(f"{path} changed while being stored (sha256 {digest} != {sha256})")
        return StoredObject(key=key, bytes=n, sha256=digest)

    def _upload(self, key: str, path: Path, digest: str) -> None:

        def upload() -> None:
            if path.stat().st_size < self._transfer.multipart_threshold:
                # One request, without the transfer manager's threads and futures: most objects
                # of a job (manifest, report, small models) cost a few ms of CPU less each.
                with open(path, "rb") as body:
                    self._s3.put_object(Bucket=self.bucket, Key=self._k(key), Body=body,
                                        Metadata={"sha256": digest})
                return
            # By file name, not file object: the transfer manager then reads each part from
            # disk as it sends it, instead of holding up to max_in_memory_upload_chunks parts
            # in memory (measured: +220 MiB server RSS for a 1 GiB model with a file object).
            self._s3.upload_file(
                str(path),
                self.bucket,
                self._k(key),
                ExtraArgs={"Metadata": {"sha256": digest}},
                Config=self._transfer,
            )

        self._retry(f"upload {key}", upload)

    def head(self, key: str) -> StoredObject | None:
        from botocore.exceptions import ClientError

        def call() -> dict[str, Any] | None:
            try:
                answer: dict[str, Any] = self._s3.head_object(Bucket=self.bucket, Key=self._k(key))
                return answer
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                    return None
                raise

        resp = self._retry(f"head {key}", call)
        if resp is None:
            return None
        sha = resp.get("Metadata", {}).get("sha256")
        if not sha:
            # Not written by fxport (or metadata lost): treat as absent rather than unverifiable.
            log.warning("object %s has no sha256 metadata; ignoring it", key)
            return None
        modified = resp.get("LastModified")
        version = f"{resp.get('ETag', '')}:{modified.timestamp() if modified is not None else ''}"
        return StoredObject(key=key, bytes=int(resp["ContentLength"]), sha256=sha, version=version)

    def iter_chunks(self, key: str, chunk_size: int = CHUNK) -> Iterator[bytes]:
        from botocore.exceptions import ClientError

        def call() -> dict[str, Any]:
            try:
                answer: dict[str, Any] = self._s3.get_object(Bucket=self.bucket, Key=self._k(key))
                return answer
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                    raise ObjectNotFound(f"no object {key!r} in {self.url}") from None
                raise

        body = self._retry(f"get {key}", call)["Body"]
        try:
            yield from body.iter_chunks(chunk_size)
        finally:
            body.close()

    def get(self, key: str, dest: Path) -> StoredObject:
        # One GET (its answer carries the recorded sha256: no HEAD first), verified as in the
        # base class; reconnect-and-restart on a dropped connection mid-download.
        return self._retry(f"download {key}", lambda: self._get_once(key, dest))

    def _get_once(self, key: str, dest: Path) -> StoredObject:
        from botocore.exceptions import ClientError

        try:
            resp = self._s3.get_object(Bucket=self.bucket, Key=self._k(key))
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                raise ObjectNotFound(f"no object {key!r} in {self.url}") from None
            raise
        body = resp["Body"]
        recorded = resp.get("Metadata", {}).get("sha256")
        if not recorded:
            body.close()
            log.warning("object %s has no sha256 metadata; ignoring it", key)
            raise ObjectNotFound(f"no object {key!r} with a recorded sha256 in {self.url}")
        meta = StoredObject(key=key, bytes=int(resp["ContentLength"]), sha256=recorded)
        try:
            write_verified(key, body.iter_chunks(CHUNK), meta, dest)
        finally:
            body.close()
        return meta

    def delete_object(self, key: str) -> None:
        self._retry(f"delete {key}", lambda: self._s3.delete_object(Bucket=self.bucket, Key=self._k(key)))

    def delete_prefix(self, prefix: str) -> int:
        _check_prefix(prefix)
        keys = [{"Key": self._k(o.key)} for o in self._list_raw(prefix)]
        for i in range(0, len(keys), 1000):
            batch = keys[i : i + 1000]
            self._retry(  # which calls the lambda now, in this iteration
                f"delete {prefix}",
                lambda: self._s3.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True}),  # noqa: B023
            )
        return len(keys)

    def stream_upload(self, key: str, sha256: str) -> S3StreamUpload:
        """A multipart upload fed chunk by chunk while the bytes still arrive (an API upload):
        receiving and storing overlap instead of following one another. `sha256` is the digest
        the object will be recorded with; call `complete()` only once the bytes are known to
        hash to it, else `abort()` (nothing is left behind either way)."""
        return S3StreamUpload(self, key, sha256, self._transfer.multipart_chunksize)

    def _list_raw(self, prefix: str) -> list[StoredObject]:
        out: list[StoredObject] = []
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": self._k(prefix)}
            if token:
                kwargs["ContinuationToken"] = token
            # _retry calls the lambda now, in this iteration
            resp = self._retry(f"list {prefix}", lambda: self._s3.list_objects_v2(**kwargs))  # noqa: B023
            for item in resp.get("Contents", []):
                out.append(StoredObject(key=item["Key"][len(self.prefix) :], bytes=int(item["Size"]), sha256=""))
            if not resp.get("IsTruncated"):
                return out
            token = resp.get("NextContinuationToken")

    def list_prefix(self, prefix: str) -> list[StoredObject]:
        out = []
        for raw in self._list_raw(prefix):
            meta = self.head(raw.key)
            if meta is not None:
                out.append(meta)
        return out

    def presigned_url(self, key: str, expires_s: int = 900) -> str | None:
        url: str = self._s3.generate_presigned_url(
            "get_object", Params={"Bucket": self.bucket, "Key": self._k(key)}, ExpiresIn=int(expires_s)
        )
        return url

    def presigned_put(self, key: str, *, sha256: str, size: int,
                      expires_s: int = 900) -> tuple[str, dict[str, str]] | None:
        # Signed with the URL: the length, the sha256 metadata every fxport object carries, and
        # x-amz-checksum-sha256, which the store checks against the bytes it receives (BadDigest
        # otherwise). A client can neither store other bytes under the content address nor
        # change the size it declared; a worker re-checks the sha256 when it fetches the input.
        checksum = _checksum_sha256(sha256)
        url = self._s3.generate_presigned_url("put_object", Params={
            "Bucket": self.bucket, "Key": self._k(key), "Metadata": {"sha256": sha256},
            "ChecksumSHA256": checksum, "ContentLength": int(size)}, ExpiresIn=int(expires_s))
        return url, {"Content-Length": str(int(size)), "x-amz-meta-sha256": sha256,
                     "x-amz-checksum-sha256": checksum}


class S3StreamUpload:
    """See S3Store.stream_upload. Memory: the part being filled plus at most IN_FLIGHT parts
    on their way up (3 × 8 MiB by default), whatever the object's size."""

    IN_FLIGHT = 2

    def __init__(self, store: S3Store, key: str, sha256: str, part_size: int) -> None:
        import concurrent.futures

        self.store, self.key, self.sha256, self.part_size = store, key, sha256, max(part_size, 5 << 20)
        s3, bucket, full_key = store._s3, store.bucket, store._k(key)
        resp = store._retry(f"start upload {key}", lambda: s3.create_multipart_upload(
            Bucket=bucket, Key=full_key, Metadata={"sha256": sha256}))
        self.upload_id = resp["UploadId"]
        self._buffer = bytearray()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=self.IN_FLIGHT, thread_name_prefix="s3-part")
        self._parts: list[Any] = []  # futures of (part number, ETag), in order
        self.size = 0

    def _send(self, data: bytes) -> None:
        while len([f for f in self._parts if not f.done()]) >= self.IN_FLIGHT:  # backpressure
            next(f for f in self._parts if not f.done()).result()
        for f in self._parts:
            if f.done() and f.exception() is not None:
                raise f.exception()
        number = len(self._parts) + 1
        s3, bucket, full_key, upload_id = self.store._s3, self.store.bucket, self.store._k(self.key), self.upload_id

        def put() -> tuple[int, str]:
            resp = self.store._retry(f"upload part {number} of {self.key}", lambda: s3.upload_part(
                Bucket=bucket, Key=full_key, PartNumber=number, UploadId=upload_id, Body=data))
            return number, resp["ETag"]

        self._parts.append(self._pool.submit(put))

    def write(self, chunk: bytes) -> None:
        self._buffer += chunk
        self.size += len(chunk)
        while len(self._buffer) >= self.part_size:
            data = bytes(self._buffer[:self.part_size])
            del self._buffer[:self.part_size]
            self._send(data)

    def complete(self) -> StoredObject:
        if self._buffer or not self._parts:  # the last part may be short
            self._send(bytes(self._buffer))
            self._buffer = bytearray()
        parts = [f.result() for f in self._parts]
        self._pool.shutdown()
        s3, bucket, full_key = self.store._s3, self.store.bucket, self.store._k(self.key)
        self.store._retry(f"finish upload {self.key}", lambda: s3.complete_multipart_upload(
            Bucket=bucket, Key=full_key, UploadId=self.upload_id,
            MultipartUpload={"Parts": [{"PartNumber": n, "ETag": etag} for n, etag in parts]}))
        return StoredObject(key=self.key, bytes=self.size, sha256=self.sha256)

    def abort(self) -> None:
        self._buffer = bytearray()
        for f in self._parts:
            f.cancel()
        self._pool.shutdown(wait=True)
        try:
            self.store._s3.abort_multipart_upload(Bucket=self.store.bucket, Key=self.store._k(self.key),
                                                  UploadId=self.upload_id)
        except Exception as exc:  # an unfinished upload is never visible; the bucket's lifecycle reaps it
            log.warning("could not abort the multipart upload of %s: %s", self.key, exc)


def _checksum_sha256(hex_digest: str) -> str:
    """A sha256 the way S3's x-amz-checksum-sha256 carries it: the raw digest, base64."""
    return base64.b64encode(bytes.fromhex(hex_digest)).decode()


def _transient(exc: BaseException | None) -> bool:
    """A connection failure or a 5xx answer: worth another try. Anything else (403, 404, a
    bad request) fails the same way every time."""
    from botocore.exceptions import (
        ClientError,
        ConnectionClosedError,
        IncompleteReadError,
        ReadTimeoutError,
        ResponseStreamingError,
    )
    from botocore.exceptions import ConnectionError as BotoConnectionError

    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:  # boto3 wraps a transfer's ClientError
        seen.add(id(exc))
        if isinstance(exc, (BotoConnectionError, ReadTimeoutError, ConnectionClosedError, IncompleteReadError,
                            ResponseStreamingError, ConnectionError, TimeoutError)):
            return True
        if isinstance(exc, ClientError):
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
            code = str(exc.response.get("Error", {}).get("Code", ""))
            return status >= 500 or code in ("SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout")
        exc = exc.__cause__ or exc.__context__
    return False


def open_store(url: str, *, retry_s: float = 60.0) -> ArtifactStore:
    """`s3://BUCKET[/prefix]` or `file:///dir` (a plain path is taken as a folder). `retry_s`:
    the S3 backend's retry budget per operation (Settings.store_retry_s)."""
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise StorageError(f"store URL {url!r}: expected s3://BUCKET[/prefix]")
        return S3Store(parsed.netloc, parsed.path, retry_s=retry_s)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise StorageError(f"store URL {url!r}: expected file:///absolute/dir")
        return FileStore(Path(urllib.parse.unquote(parsed.path)))
    if parsed.scheme == "":
        return FileStore(Path(url))
    raise StorageError(f"store URL {url!r}: use s3://BUCKET[/prefix] or file:///dir")
