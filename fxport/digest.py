"""sha256 of files, and writing a stream to a file that appears only once its digest checks out.

Shared by the object stores (fxport/storage.py) and the thin client's downloads, so it imports
nothing beyond the standard library."""

from __future__ import annotations

import hashlib
import os
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
