"""sha256 of files, and writing a stream to a file that appears only once its digest checks out.

Shared by the object stores (fxport/storage/) and the thin client's downloads, so it imports
nothing beyond the standard library."""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path

CHUNK = 1 << 20


def sha256_file(path: Path) -> tuple[str, int]:
    """(hex sha256, size) of the file at `path`, read in CHUNK pieces."""
    h, n = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            n += len(chunk)
    return h.hexdigest(), n


# A digest is remembered only for a file whose status last changed at least this long before it was
# hashed: a change within the file system's timestamp granularity (ext4: one clock tick, FAT: 2 s)
# could otherwise leave size, mtime and ctime as they were (git's "racy" index entries, the same rule).
RACY_S = 2.0


def remembered_sha256(path: Path, cache_dir: Path | None = None) -> tuple[str, int]:
    """sha256_file, remembered across runs for a file that has not changed since: keyed by
    device and inode, trusted only while size, mtime and ctime are all as they were (ctime is
    set by the kernel on every write and cannot be set back). A client resubmitting the same
    46 MB model then spends no 36 ms hashing it again. `cache_dir`: default
    FXPORT_DIGEST_CACHE_DIR, else $XDG_CACHE_HOME/fxport/digests (~/.cache/...);
    FXPORT_DIGEST_CACHE=0 turns it off. Any
    problem with the cache means hashing, never an error."""
    if os.environ.get("FXPORT_DIGEST_CACHE", "1") == "0":
        return sha256_file(path)
    try:
        before = os.stat(path)
    except OSError:
        return sha256_file(path)  # raises what is wrong with the path
    stamp = _stamp(before)
    entry = (cache_dir or _digest_cache_dir()) / f"{before.st_dev}-{before.st_ino}"
    try:
        known = json.loads(entry.read_text())
        if known["stat"] == stamp and len(known["sha256"]) == 64:
            return str(known["sha256"]), before.st_size
    except (OSError, ValueError, KeyError, TypeError):
        pass  # not remembered, or not readable: hash it
    started_ns = time.time_ns()
    digest, size = sha256_file(path)
    if size == before.st_size and started_ns - before.st_ctime_ns >= RACY_S * 1e9:
        try:
            if _stamp(os.stat(path)) == stamp:  # unchanged while it was read
                entry.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                tmp = entry.with_name(f"{entry.name}.{os.getpid()}.tmp")
                tmp.write_text(json.dumps({"stat": stamp, "sha256": digest}))
                os.replace(tmp, entry)
        except OSError:  # nowhere to remember it: hashed all the same
            pass
    return digest, size


def _stamp(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _digest_cache_dir() -> Path:
    if os.environ.get("FXPORT_DIGEST_CACHE_DIR"):
        return Path(os.environ["FXPORT_DIGEST_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fxport" / "digests"


def write_checked(chunks: Iterable[bytes], dest: Path, check: Callable[[int, str], None]) -> tuple[str, int]:
    """Write `chunks` to dest.part, hashing as they come, then call `check(size, sha256)`;
    `dest` appears (renamed into place) only if it returns. Whatever `check` or the stream
    raises propagates, and nothing is left behind."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    h, n = hashlib.sha256(), 0
    try:
        with open(part, "wb") as f:
            for chunk in chunks:
                h.update(chunk)
                n += len(chunk)
                f.write(chunk)
        digest = h.hexdigest()
        check(n, digest)
        os.replace(part, dest)
    finally:
        part.unlink(missing_ok=True)
    return digest, n
