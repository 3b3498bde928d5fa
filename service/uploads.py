"""Spool a SubmitJob upload stream to disk: bounded memory, running sha256, size limits.

The stream is `header, model_chunk*, calibration_chunk*`. Each chunk goes straight to a
temp file while its sha256 and size are tallied; a file over the limit is refused with
RESOURCE_EXHAUSTED as soon as the limit is crossed (or up front, from the declared size),
and a size or digest that differs from the header is refused with INVALID_ARGUMENT. The
caller then stores the files content-addressed under `{tenant}/inputs/{sha256}`.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fxport.errors import InvalidRequest, QuotaExceeded
from fxport.metrics import METRICS
from fxport.storage import SHA256_RE
from fxport.v1 import conversion_pb2 as pb

log = logging.getLogger(__name__)
MAX_FILENAME = 255  # informational only (the engine detects formats by content), but stored on the job


# Reserve n more bytes of the spool for this upload, or raise QuotaExceeded (busy: retry later).
Reserve = Callable[[int], None]


@dataclass
class SpooledFile:
    path: Path
    size: int
    sha256: str
    filename: str
    stored: Any = None  # StoredObject: already in the store, streamed there while it arrived


def check_header(what: str, header: pb.FileHeader, max_bytes: int) -> None:
    """Refuse what can be refused before any byte arrives."""
    name = header.filename
    if len(name) > MAX_FILENAME or any(c in name for c in "/\\") or any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise InvalidRequest(f"{what}.filename: a file name (no path, no control characters, at most {MAX_FILENAME} "
                             f"characters), got {name[:80]!r}")
    if header.sha256 and not SHA256_RE.match(header.sha256):
        raise InvalidRequest(f"{what}.sha256: expected 64 lowercase hex digits, got {header.sha256[:80]!r}")
    if header.size < 0:
        raise InvalidRequest(f"{what}.size: must not be negative")
    if header.size > max_bytes:
        raise QuotaExceeded(f"{what} is {header.size} bytes; this server accepts at most {max_bytes} bytes")
    if header.stored and not header.sha256:
        raise InvalidRequest(f"{what}.stored needs {what}.sha256")


class _Sink:
    """One file of the upload: spooled to disk while hashed and counted; with a `mirror` (a
    store's stream upload under the declared digest), also sent on to the store as it arrives.
    The mirror is only a shortcut: it completes only if the bytes hash to the declared digest,
    and on any trouble it is dropped and the spool file is stored the ordinary way."""

    def __init__(self, what: str, header: pb.FileHeader, directory: Path, max_bytes: int, reserve: Reserve,
                 mirror: Any = None) -> None:
        # An upload's declared sizes are reserved before it starts (servicer.SubmitJob); one that
        # declares none reserves its bytes as they arrive.
        self.what, self.header, self.max_bytes, self.reserve = what, header, max_bytes, reserve
        self.path = directory / what
        self.file = open(self.path, "wb")
        self.hash = hashlib.sha256()
        self.size = 0
        self.mirror = mirror

    def write(self, chunk: bytes) -> None:
        METRICS.upload_bytes_total.labels(self.what).inc(len(chunk))  # every byte that arrived, kept or not
        self.size += len(chunk)
        if self.size > self.max_bytes:
            raise QuotaExceeded(f"{self.what} upload passed {self.max_bytes} bytes, this server's limit")
        if self.header.size and self.size > self.header.size:
            raise InvalidRequest(f"{self.what} upload is longer than the {self.header.size} bytes its header declared")
        if not self.header.size:
            self.reserve(len(chunk))
        self.hash.update(chunk)
        self.file.write(chunk)
        if self.mirror is not None:
            try:
                self.mirror.write(chunk)
            except Exception as exc:
                log.warning("streaming the %s to the store failed; it is stored after the upload: %s", self.what, exc)
                self.drop_mirror()

    def drop_mirror(self) -> None:
        if self.mirror is not None:
            mirror, self.mirror = self.mirror, None
            mirror.abort()

    def finish(self) -> SpooledFile:
        self.file.close()
        digest = self.hash.hexdigest()
        if self.size == 0:
            raise InvalidRequest(f"{self.what} upload is empty")
        if self.header.size and self.size != self.header.size:
            raise InvalidRequest(f"{self.what} upload ended after {self.size} of {self.header.size} declared bytes")
        if self.header.sha256 and digest != self.header.sha256:
            raise InvalidRequest(f"{self.what} upload corrupted in transit: "
                                 f"sha256 {digest} != declared {self.header.sha256}")
        stored = None
        if self.mirror is not None and digest == self.mirror.sha256:
            try:
                stored = self.mirror.complete()
                self.mirror = None
            except Exception as exc:
                log.warning("streaming the %s to the store failed; storing it now: %s", self.what, exc)
        self.drop_mirror()
        return SpooledFile(self.path, self.size, digest, self.header.filename, stored)


class SpooledUpload:
    """`with SpooledUpload(dir, max, reserve) as up: model, calib = up.receive(header, rest)`;
    files are deleted on exit. `reserve` takes spool bytes as the upload needs them (the caller
    gives them back after the exit)."""

    def __init__(self, spool_dir: Path | None, max_bytes: int, reserve: Reserve) -> None:
        self.spool_dir, self.max_bytes, self.reserve = spool_dir, max_bytes, reserve
        self.dir: Path | None = None

    def __enter__(self) -> SpooledUpload:
        if self.spool_dir:
            Path(self.spool_dir).mkdir(parents=True, exist_ok=True)
        self.dir = Path(tempfile.mkdtemp(prefix="fxport-upload-", dir=self.spool_dir))
        return self

    def __exit__(self, *exc: object) -> None:
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)

    def receive(
        self, header: pb.SubmitHeader, rest: Iterator[pb.SubmitJobRequest], model_mirror: Any = None
    ) -> tuple[SpooledFile | None, SpooledFile | None]:
        """`model_mirror`: a store stream upload the model's bytes also go to as they arrive."""
        assert self.dir is not None
        has_calib = header.HasField("calibration")
        model = (None if header.model.stored
                 else _Sink("model", header.model, self.dir, self.max_bytes, self.reserve, model_mirror))
        calib = (_Sink("calibration", header.calibration, self.dir, self.max_bytes, self.reserve)
                 if has_calib and not header.calibration.stored else None)
        phase = "model"
        try:
            for req in rest:
                kind = req.WhichOneof("payload")
                if kind == "model_chunk":
                    if phase != "model" or model is None:
                        raise InvalidRequest("model_chunk after calibration data, or with model.stored set")
                    model.write(req.model_chunk)
                elif kind == "calibration_chunk":
                    if calib is None:
                        raise InvalidRequest(
                            "calibration_chunk without a calibration header (or with calibration.stored)")
                    phase = "calibration"
                    calib.write(req.calibration_chunk)
                else:
                    raise InvalidRequest("only the first message may be a header")
            return (model.finish() if model else None), (calib.finish() if calib else None)
        finally:
            for sink in (model, calib):
                if sink is not None:
                    sink.drop_mirror()  # a refused upload leaves nothing in the store
                    if not sink.file.closed:
                        sink.file.close()


def declared_bytes(header: pb.SubmitHeader) -> int:
    """What a submit's header says it will send: the sizes of the files it does not mark stored."""
    files = [header.model, *([header.calibration] if header.HasField("calibration") else [])]
    return sum(f.size for f in files if not f.stored)
