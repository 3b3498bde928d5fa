"""The object store's interface: content with its sha256, whatever the backend.

Every object carries its sha256 (S3 user metadata `sha256`, or a sidecar record in the
filesystem store) and `get` verifies it, so a corrupted or truncated object is an error
(StoredObjectCorrupt), never a silently wrong model. Two backends: `FileStore` (embedded,
fxport/storage/file_store.py) and `S3Store` (distributed, fxport/storage/s3_store.py);
`open_store` (fxport/storage/backends.py) picks one from a URL.
"""

from __future__ import annotations

import hashlib
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from fxport.digest import CHUNK, write_checked
from fxport.storage.errors import InvalidKey, ObjectNotFound, StoredObjectCorrupt


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
    if size and sha256 match `meta`, else StoredObjectCorrupt and nothing is left behind."""

    def check(n: int, digest: str) -> None:
        if digest != meta.sha256 or n != meta.bytes:
            raise StoredObjectCorrupt(
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


def check_delete_prefix(prefix: str) -> None:
    # A bare "" or "tenant" prefix would delete far more than one job's files.
    if not prefix.endswith("/") or prefix.count("/") < 2:
        raise InvalidKey(f"refusing to delete prefix {prefix!r}: expected e.g. 'tenant/jobs/ID/'")
