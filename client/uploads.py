"""What a submit sends: the files, their digests and the spec (`SubmitFiles`), the CheckUpload
question and the SubmitJob header built from them, and the SubmitJob request stream
(`UploadStream`), which sends the bytes the server does not hold yet."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fxport.client.errors import TooLarge
from fxport.digest import remembered_sha256
from fxport.errors import InvalidInput
from fxport.v1 import conversion_pb2 as pb

KINDS = ("model", "calibration")


def spec_text(spec: Any) -> str:
    """The spec as the server reads it: YAML or JSON text."""
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


@dataclass(frozen=True)
class SubmitFile:
    """One file a submit names: where it is, its sha256 and size."""

    path: Path
    sha256: str
    size: int

    def header(self, stored: bool) -> pb.FileHeader:
        return pb.FileHeader(filename=self.path.name, size=self.size, sha256=self.sha256, stored=stored)


@dataclass(frozen=True)
class SubmitFiles:
    """What one submit sends: the model (and calibration file), the spec text and the request's
    options."""

    model: SubmitFile
    calibration: SubmitFile | None
    spec: str
    idempotency_key: str
    no_cache: bool

    @classmethod
    def read(cls, model_path: str | os.PathLike[str], spec: Any, calibration: str | os.PathLike[str] | None,
             idempotency_key: str, no_cache: bool) -> SubmitFiles:
        """The files checked to exist and hashed (a file's digest is remembered while it is unchanged)."""
        model = Path(model_path)
        if not model.is_file():
            raise InvalidInput(f"model file {str(model)!r} not found", field="model")
        calib = Path(calibration) if calibration is not None else None
        if calib is not None and not calib.is_file():
            raise InvalidInput(f"calibration file {str(calib)!r} not found", field="calibration")
        text = spec_text(spec)
        return cls(model=SubmitFile(model, *remembered_sha256(model)),
                   calibration=SubmitFile(calib, *remembered_sha256(calib)) if calib is not None else None,
                   spec=text, idempotency_key=idempotency_key, no_cache=no_cache)

    def file(self, kind: str) -> SubmitFile | None:
        return self.model if kind == "model" else self.calibration

    def size(self, kind: str) -> int:
        file = self.file(kind)
        return file.size if file is not None else 0

    def check_request(self, direct_upload: bool) -> pb.CheckUploadRequest:
        """CheckUpload's question: the digests, the spec and, unless `no_cache`, the submit to
        make at once if the result is cached (a cached result comes back as the job itself)."""
        calib = self.calibration
        ask = pb.CheckUploadRequest(
            model_sha256=self.model.sha256, calibration_sha256=calib.sha256 if calib else "", spec=self.spec,
            no_cache=self.no_cache, model_size=self.model.size, calibration_size=calib.size if calib else 0,
            direct_upload=direct_upload)
        if not self.no_cache:
            ask.submit_if_cached.CopyFrom(pb.SubmitHeader(spec=self.spec, idempotency_key=self.idempotency_key,
                                                          model=self.model.header(stored=True)))
            if calib is not None:
                ask.submit_if_cached.calibration.CopyFrom(calib.header(stored=True))
        return ask

    def check_size(self, max_upload_bytes: int) -> None:
        """TooLarge when a file is past the server's limit (0: none)."""
        calib_size = self.calibration.size if self.calibration else 0
        biggest = max(self.model.size, calib_size)
        if max_upload_bytes and biggest > max_upload_bytes:
            big = "model" if self.model.size >= calib_size else "calibration"
            raise TooLarge(f"{big} is {biggest} bytes; the server accepts at most {max_upload_bytes} bytes")

    def header(self, stored: dict[str, bool]) -> pb.SubmitHeader:
        """SubmitJob's header; `stored`: per kind, whether the server holds the bytes already."""
        header = pb.SubmitHeader(spec=self.spec, idempotency_key=self.idempotency_key, no_cache=self.no_cache,
                                 model=self.model.header(stored["model"]))
        if self.calibration is not None:
            header.calibration.CopyFrom(self.calibration.header(stored["calibration"]))
        return header


class UploadStream:
    """SubmitJob's requests: the header, then the bytes of each file the header does not mark
    stored, in chunks, hashed as they are read. `sent`: the bytes sent so far (counting any a
    presigned PUT already sent); `changed`: files whose bytes no longer match their sha256."""

    def __init__(self, files: SubmitFiles, header: pb.SubmitHeader, chunk_size: int, sent: int = 0) -> None:
        self.files, self.header, self.chunk_size = files, header, chunk_size
        self.sent = sent
        self.changed: list[str] = []

    def requests(self) -> Iterator[pb.SubmitJobRequest]:
        """A fresh request stream (one per try)."""
        yield pb.SubmitJobRequest(header=self.header)
        if not self.header.model.stored:
            yield from self._chunks(self.files.model, "model_chunk")
        if self.files.calibration is not None and not self.header.calibration.stored:
            yield from self._chunks(self.files.calibration, "calibration_chunk")

    def _chunks(self, file: SubmitFile, field_name: str) -> Iterator[pb.SubmitJobRequest]:
        h = hashlib.sha256()
        with open(file.path, "rb") as f:
            while data := f.read(self.chunk_size):
                h.update(data)
                self.sent += len(data)
                chunk: dict[str, Any] = {field_name: data}  # the oneof field: model_chunk or calibration_chunk
                yield pb.SubmitJobRequest(**chunk)
        if h.hexdigest() != file.sha256:  # the server refuses it too; say why here
            self.changed.append(str(file.path))
