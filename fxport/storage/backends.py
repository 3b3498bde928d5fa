"""Which object store a URL names: `open_store`."""

from __future__ import annotations

import urllib.parse
from pathlib import Path

from fxport.storage.errors import StorageError
from fxport.storage.file_store import FileStore
from fxport.storage.s3_store import S3Store
from fxport.storage.store import ArtifactStore


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
