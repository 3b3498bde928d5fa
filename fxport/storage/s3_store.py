"""The distributed object store: an S3 bucket (SeaweedFS, MinIO, AWS S3 ...) through boto3.

boto3 is imported only when an S3 store is opened: the thin client never pays for it.
"""

from __future__ import annotations

import base64
import hashlib
import io
import logging
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any, TypeVar

from fxport.digest import CHUNK, sha256_file
from fxport.retry import Backoff, retry_call
from fxport.storage.errors import ObjectNotFound, StorageError, StoredObjectCorrupt, StoreUnreachable
from fxport.storage.store import ArtifactStore, StoredObject, check_delete_prefix, write_verified
from fxport.storage.streaming import S3StreamUpload

log = logging.getLogger(__name__)

_T = TypeVar("_T")


class S3Store(ArtifactStore):
    """An S3 bucket (optionally under a prefix) through boto3 with SigV4.

    Endpoint, region and credentials come the way every AWS tool reads them
    (AWS_ENDPOINT_URL, AWS_DEFAULT_REGION, AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, profiles,
    IRSA). Large files go up as multipart uploads (boto3's transfer manager). Each S3 call is
    retried briefly by botocore ("standard" mode), and the whole operation (a transfer from
    its start) by fxport.retry (exponential backoff, jitter) for as long as `retry_s` allows, so
    an object store that is down for a while (a restart, a failover) costs time, not the job.
    Past the budget: StorageError "object store unreachable at <endpoint> after N attempts
    over T s". Only connection failures and 5xx answers are retried; 403/404 fail at once.
    """

    BACKOFF = Backoff(first_s=0.2, max_s=5.0)  # between attempts of one operation

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
        # Without signature_version="s3v4" presigned URLs come out SigV2.
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
        """Run `fn` until it succeeds, fails for a reason retrying cannot fix, or the budget ends
        (StoreUnreachable). The jittered pause is what counts against the budget: no attempt
        starts past it. The last attempt may still run over by its own length (botocore's inner
        retry sleeps at random: 0.15-2.7 s per attempt against a dead endpoint), and the message
        reports the time as it was."""

        def retrying(exc: BaseException, attempt: int, pause: float) -> None:
            log.warning("retrying %s in %.1f s after %s (attempt %d)", what, pause, type(exc).__name__, attempt)

        def unreachable(exc: BaseException, attempts: int, elapsed: float) -> BaseException:
            return StoreUnreachable(
                f"{what}: object store unreachable at {self.endpoint} after {attempts} attempts over "
                f"{elapsed:.1f} s ({type(exc).__name__}: {exc})",
                hint="check that the S3 endpoint is up and reachable; FXPORT_STORE_RETRY_S sets the budget",
            )

        return retry_call(fn, retry_if=_worth_retrying, deadline_s=self.retry_s, backoff=self.BACKOFF,
                          on_retry=retrying, on_give_up=unreachable)

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
        changed in between are refused (StoredObjectCorrupt) and nothing is stored. A store that does
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
                raise StoredObjectCorrupt(f"{path} changed while it was being stored") from None
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
            raise StoredObjectCorrupt(f"{path} changed while being stored (sha256 {digest} != {sha256})")
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
        check_delete_prefix(prefix)
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


class _Exactly(io.RawIOBase):
    """The first `n` bytes of the open file `f`, as a request body: a file that shrinks while it
    is sent (a sandboxed model rewriting its output) raises StoredObjectCorrupt at once, where a plain
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
            raise StoredObjectCorrupt(f"{self.path} changed while it was being stored")
        self.pos += len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)


def _checksum_sha256(hex_digest: str) -> str:
    """A sha256 the way S3's x-amz-checksum-sha256 carries it: the raw digest, base64."""
    return base64.b64encode(bytes.fromhex(hex_digest)).decode()


def _worth_retrying(exc: BaseException) -> bool:
    """A failure S3Store._retry tries again: a transient one, unless an inner operation already
    spent its budget (a StorageError) or it is not transient at all."""
    return not isinstance(exc, StorageError) and _transient(exc)


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
