"""Storing bytes while they still arrive: a multipart upload fed chunk by chunk (S3Store.stream_upload)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from fxport.storage.store import StoredObject

if TYPE_CHECKING:
    from fxport.storage.s3_store import S3Store

log = logging.getLogger(__name__)


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
