"""The embedded object store: files under a folder ($FXPORT_HOME/store by default)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from fxport.digest import CHUNK
from fxport.storage.errors import InvalidKey, ObjectNotFound, StoredObjectCorrupt
from fxport.storage.store import ArtifactStore, StoredObject, check_delete_prefix


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
                raise StoredObjectCorrupt(f"{path} changed while being stored (sha256 {digest} != {sha256})")
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
        check_delete_prefix(prefix)
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
