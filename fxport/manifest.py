"""manifest.json as a type: what a conversion produced, how it was checked, and with what.

One model for every writer and reader: the engine builds it, the sandbox's parent re-reads the
child's copy through it (so a child cannot hand the worker a manifest of the wrong shape), the
TensorRT stage's part merges into the CPU stage's by field (`Manifest.merge_stage`), and the
client, the report and the CLI read it back.

Compatibility rules (the schema is versioned, `schema_version`):
- fields are added, never renamed or retyped; a reader of an older manifest gets the defaults;
- every model keeps unknown keys (`extra="allow"`), so a manifest written by a newer fxport loads
  in an older one and is written back unchanged;
- `tests/test_manifest.py` keeps manifests written by earlier versions loading.

The stage sections (benchmark, quantization, tensorrt, sandbox, profile, the graphs) have types
of their own in fxport/manifest_sections.py: a stage may still assign its section as the dict it
builds, which is read into the type, and is written back as it was given. `read_leniently` reads a
manifest of unknown origin (an old one, a broken one, one a model shaped), leaving out only the
sections that do not have their type's shape. `spec`, `toolchain`, `inputs`, `outputs` and
`package` stay mappings: `signature` is the typed form of `inputs` and `outputs`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fxport.errors import ErrorRecord
from fxport.manifest_sections import (
    Benchmark,
    CaptureAttempt,
    GraphSummary,
    Number,
    Profile,
    Quantization,
    Sandbox,
    Section,
    TensorRT,
    json_form,
)

# A record's text field: stripped whenever a record is built or read (a manifest a sandbox child
# wrote, a job record read back from the store), whoever wrote it.

SCHEMA_VERSION = 3  # 1: every manifest before the field existed (no `schema_version` key); 3: `signature`

Status = Literal["running", "succeeded", "failed"]


class _Record(BaseModel):
    """A manifest section: unknown keys kept, defaults filled, assignment checked."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)


class InputRecord(_Record):
    format: str | None = None  # "pt2", "torch_package", "onnx", ...
    sha256: str | None = None
    bytes: int | None = None


class CaptureRecord(_Record):
    method: str | None = None  # "fx" | "export" | "eager" | "archive"
    level: str | None = None  # "torch" | "aten"
    attempts: list[CaptureAttempt] = Field(default_factory=list)


class PassRecord(_Record):
    name: str
    applied: bool = False
    changed: bool = False
    notes: str = ""
    seconds: float | None = None


class ArtifactRecord(_Record):
    format: str
    path: str
    bytes: int
    sha256: str
    int8_scheme: str | None = None


class OutputCheck(_Record):
    """One output of one artifact against the original."""

    output: int | str
    max_abs_diff: float | None = None
    max_rel_diff: float | None = None
    cosine: float | None = None
    passed: bool = False


class VerificationRecord(Section):
    """One artifact checked against the original model in one runtime (workers/engine/verify). A
    Section: the comparator writes it as a dict, adding keys per case (`comparison`, `outside_range`,
    a TensorRT engine's `profile_extremes`, ...), which are written back in the order it added them."""

    _written_first = ("format", "runtime", "max_abs_diff", "max_rel_diff", "cosine", "passed", "verdict",
                      "shapes_checked", "samples", "outputs")  # typed before the others: written first

    format: str
    runtime: str | None = None
    max_abs_diff: float | None = None
    max_rel_diff: float | None = None
    cosine: float | None = None
    passed: bool = False  # no mismatch found (also when the verdict is "inconclusive")
    verdict: Literal["passed", "failed", "inconclusive"] | None = None  # None: written before verdicts
    # one shape per point, or with several inputs one list of shapes per point
    shapes_checked: list[list[int] | list[list[int]]] = Field(default_factory=list)
    samples: int | None = None
    outputs: list[OutputCheck] = Field(default_factory=list)
    # the tolerances the verdict used (precision.Tolerances.as_dict): atol, rtol, min_cosine, rule, ...
    tolerances: dict[str, Any] | None = None
    error: str | None = None  # what mismatched, for a failed verdict
    top1_agreement: Number | None = None
    inconclusive: list[dict[str, Any]] | None = None  # the constant outputs: {"output", "reference"}
    # a breakdown per shape checked, where a runtime records one
    per_shape: list[dict[str, Any]] | None = None


class FailedTarget(_Record):
    """A requested target that was not made, while others were (e.g. a graph-only target of a model
    no capture method could follow, whose TorchScript and ONNX were built from the eager model)."""

    target: str
    stage: str | None = None
    reason: str = ""


class TensorSignature(_Record):
    name: str
    dtype: str | None = None
    shape: list[int | str] | None = None  # a str is a dynamic dim of `Signature.dynamic_dims`; None: not known


class BatchAxis(_Record):
    """The model's batch axis: a dynamic dim that is dim 0 of every input and every output."""

    dim: str | None = None  # None: the model has none, and `note` says why
    min: int | None = None
    opt: int | None = None
    max: int | None = None
    note: str = ""


class Signature(_Record):
    """What the model takes and returns, as every artifact of the job serves it (fp16 and int8
    artifacts keep float32 inputs and outputs): names in order, dtypes, shapes with the dynamic
    dims named, their ranges, and the batch axis (fxport/serving/signature.py)."""

    inputs: list[TensorSignature] = Field(default_factory=list)
    outputs: list[TensorSignature] = Field(default_factory=list)
    dynamic_dims: dict[str, dict[str, int]] = Field(default_factory=dict)
    batch: BatchAxis = Field(default_factory=BatchAxis)


class Manifest(_Record):
    schema_version: int = 1  # absent in manifests written before versioning
    fxport_version: str | None = None
    job_id: str | None = None
    toolchain: dict[str, Any] = Field(default_factory=dict)
    input: InputRecord = Field(default_factory=InputRecord)
    spec: dict[str, Any] = Field(default_factory=dict)
    capture: CaptureRecord | None = None
    passes: list[PassRecord] = Field(default_factory=list)
    artifacts: list[ArtifactRecord] = Field(default_factory=list)
    failed_targets: list[FailedTarget] = Field(default_factory=list)
    verification: list[VerificationRecord] = Field(default_factory=list)
    profile: Profile | None = None
    warnings: list[str] = Field(default_factory=list)
    timings_s: dict[str, float] = Field(default_factory=dict)
    status: Status = "running"
    error: ErrorRecord | None = None
    inputs: dict[str, Any] | None = None  # the input signature (names, shapes, dynamic dims)
    outputs: list[dict[str, Any]] | None = None
    signature: Signature | None = None  # inputs and outputs together, with the batch axis (schema 3)
    graph_before: GraphSummary | None = None
    graph_after: GraphSummary | None = None
    quantization: Quantization | None = None
    benchmark: Benchmark | None = None
    tensorrt: TensorRT | None = None
    sandbox: Sandbox | None = None
    package: dict[str, Any] | None = None  # what `spec.package` wrote: {"triton": TritonPackage.to_dict()}

    # -- reading and writing --------------------------------------------------------------

    @classmethod
    def read(cls, path: Path) -> Manifest:
        return cls.from_json(path.read_bytes())

    @classmethod
    def from_json(cls, data: bytes | str) -> Manifest:
        return cls.model_validate_json(data)

    def to_dict(self) -> dict[str, Any]:
        """The manifest as JSON data: the fields that were set or differ from their default, then
        unknown keys. A field nobody wrote is left out rather than written as its default, so a
        manifest read and written back is the manifest that was read, whatever version wrote it."""
        return json_form(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=str)

    def write(self, path: Path) -> None:
        path.write_text(self.to_json())

    # -- queries ---------------------------------------------------------------------------

    def artifact(self, fmt: str) -> ArtifactRecord | None:
        return next((a for a in self.artifacts if a.format == fmt), None)

    def digests(self) -> dict[str, str]:
        """Artifact path -> sha256, as the engine recorded them while writing."""
        return {a.path: a.sha256 for a in self.artifacts}

    def warn(self, message: str) -> None:
        if message not in self.warnings:
            self.warnings.append(message)

    # -- merging a later stage's part --------------------------------------------------------

    def merge_stage(self, stage: Manifest, *, name: str) -> Manifest:
        """This (the CPU stage's) manifest with a later stage's part added: its artifacts,
        verifications, new warnings, toolchain versions it knows, its section (`tensorrt`), its
        benchmark rows, and its total time under `timings_s[name]`. The CPU stage's record of
        input, capture, passes and spec is kept: the later stage did not redo them."""
        from fxport.benchmark import merge as merge_benchmarks

        merged = self.model_copy(deep=True)
        merged.artifacts.extend(stage.artifacts)
        merged.verification.extend(stage.verification)
        merged.toolchain.update({k: v for k, v in stage.toolchain.items() if v})
        merged.timings_s[name] = sum(stage.timings_s.values())
        if stage.tensorrt:
            merged.tensorrt = TensorRT.model_validate({**json_form(merged.tensorrt or TensorRT()),
                                                       **json_form(stage.tensorrt)})
        if merged.benchmark or stage.benchmark:
            both = merge_benchmarks(merged.benchmark.as_dict() if merged.benchmark else None,
                                    stage.benchmark.as_dict() if stage.benchmark else None)
            merged.benchmark = Benchmark.model_validate(both) if both is not None else None
        for warning in stage.warnings:
            merged.warn(warning)
        if stage.status == "failed":
            merged.status, merged.error = "failed", stage.error
        return merged



def read_leniently(data: Mapping[str, Any]) -> tuple[Manifest, dict[str, str]]:
    """`data` (a parsed manifest.json of unknown origin: an old one, a broken one, one a model
    shaped) as a Manifest, leaving out each top-level field that does not have its type's shape,
    and why, per field left out. Readers that show what they can (the report, the CLI's table, the
    result document) use this; a reader that must refuse a wrong shape uses `Manifest.model_validate`."""
    kept, unreadable = dict(data), dict[str, str]()
    for _ in range(len(kept) + 1):
        try:
            return Manifest.model_validate(kept), unreadable
        except ValidationError as exc:
            bad: dict[str, str] = {}
            for error in exc.errors():
                loc = error.get("loc") or ()
                if loc and str(loc[0]) in kept:
                    where = ".".join(str(part) for part in loc)
                    bad.setdefault(str(loc[0]), f"{where}: {error.get('msg')}")
            if not bad:
                raise
            for key, why in bad.items():
                del kept[key]
                unreadable[key] = why
    raise AssertionError("unreachable: every round leaves out a field")
