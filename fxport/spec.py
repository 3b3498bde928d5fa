"""The job spec: one pydantic model shared by the CLI, the API, the workers and the manifest.

Validation errors name the field path and the valid choices (see `parse_spec`).
This module must stay light: the API server and the thin client import it.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from fxport.errors import SpecError
from fxport.pass_catalog import DEFAULT_PASSES, PASS_CATALOG, PASS_NAMES
from fxport.text import short_repr

TARGETS = ("torchscript", "onnx", "exported_program", "fx_source", "tensorrt")
Target = Literal["torchscript", "onnx", "exported_program", "fx_source", "tensorrt"]
DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int8", "uint8", "bool")
DType = Literal["float32", "float16", "bfloat16", "float64", "int64", "int32", "int8", "uint8", "bool"]

# Server-side ceilings that no spec may exceed (docs/architecture.md, "Trust boundaries").
MAX_INPUTS = 32
MAX_RANK = 8
MAX_DIM = 1 << 16
MAX_ELEMENTS_PER_INPUT = 1 << 28
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
_TENSOR_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.:/\-]{0,127}$")


class _Strict(BaseModel):
    # Frozen: one validated spec is shared by everything that handles the job (model_copy derives another).
    model_config = ConfigDict(extra="forbid", frozen=True)


# A spec's rules are checked where it crosses a trust boundary: the API (parse_spec) and the
# sandbox child (reading its request). In between it travels typed, and a copy read back from the
# job store is decoded with this context, which skips the cross-field rules it already passed.
TRUSTED = {"fxport_spec_trusted": True}


class RuleChecks:
    """How many times this process checked a spec's rules (tests count the checks per job)."""

    count = 0


class PassSpec(_Strict):
    name: str
    options: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _from_name(cls, value: Any) -> Any:
        return {"name": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _check(self) -> PassSpec:
        info = PASS_CATALOG.get(self.name)
        if info is None:
            raise ValueError(f"unknown pass {short_repr(self.name)}; valid passes: {', '.join(PASS_NAMES)}")
        try:
            parsed = info.options.model_validate(self.options)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            valid = ", ".join(info.options.model_fields) or "none"
            raise ValueError(
                f"pass {short_repr(self.name)} option {short_repr(where)}: {_plain(first)} (valid options: {valid})"
            ) from None
        object.__setattr__(self, "options", parsed.model_dump())  # normalized while still being built
        return self


# ---------------------------------------------------------------------------------------
# Inputs and the rest of the spec
# ---------------------------------------------------------------------------------------


class DynamicDim(_Strict):
    min: int = Field(ge=1, le=MAX_DIM)
    opt: int = Field(ge=1, le=MAX_DIM)
    max: int = Field(ge=1, le=MAX_DIM)

    @model_validator(mode="after")
    def _ordered(self) -> DynamicDim:
        if not (self.min <= self.opt <= self.max):
            raise ValueError(f"need min <= opt <= max, got min={self.min}, opt={self.opt}, max={self.max}")
        return self


class InputSpec(_Strict):
    name: str
    shape: list[int | str] = Field(min_length=0, max_length=MAX_RANK)
    dtype: DType = "float32"

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError("must be an identifier: letters, digits and _, at most 64 characters")
        return v

    @field_validator("shape")
    @classmethod
    def _shape(cls, v: list[int | str]) -> list[int | str]:
        for i, d in enumerate(v):
            if isinstance(d, int) and not (1 <= d <= MAX_DIM):
                raise ValueError(f"dim {i} is {d}; a static dim must be between 1 and {MAX_DIM}")
            if isinstance(d, str) and not _NAME.match(d):
                raise ValueError(f"dim {i} {short_repr(d)}: a dynamic dim name must be an identifier")
        return v


class CalibrationSpec(_Strict):
    samples: int = Field(64, ge=1, le=100_000)
    observer: Literal["minmax", "percentile", "entropy"] = "minmax"


INT8_RUNTIMES = ("onnxruntime", "tensorrt")
# spec keys that describe the job (its bounds, its labels, what it accepts), not its artifacts
NOT_CONVERSION_INPUTS = ("labels", "limits", "allow_partial")


class QuantizationSpec(_Strict):
    method: Literal["static"] = "static"
    calibration: CalibrationSpec = Field(default_factory=CalibrationSpec)
    target_cosine: float | None = Field(None, gt=0, le=1)
    runtime: Literal["onnxruntime", "tensorrt"] | None = Field(
        None, description="The runtime the int8 artifacts are for: onnxruntime (asymmetric uint8 activations, what "
        "CPU kernels keep accurate) or tensorrt (symmetric int8, zero point 0, what TensorRT takes). Default: from "
        "the targets; with tensorrt and a CPU target, both, each in its own artifact.")
    reduce_range: bool | None = Field(
        None, description="7-bit weights in the onnxruntime scheme, so that CPUs without VNNI cannot saturate "
        "(at a cost in precision everywhere). Default: off.")


class OnnxOptions(_Strict):
    opset: int = Field(20, ge=11, le=23, description="ONNX opset. 18 and up: the torch.export-based exporter; "
                       "11-17: the TorchScript-based one, from a trace of the graph (fp32 and fp16).")
    single_file: bool = True


class TorchScriptOptions(_Strict):
    method: Literal["trace", "script"] = "trace"


class TensorRTOptions(_Strict):
    workspace_mb: int = Field(4096, ge=64, le=1 << 20)
    timing_cache: Literal["shared", "none"] = "shared"


class VerifyOptions(_Strict):
    """How an artifact is compared with the original model (docs/artifacts.md, "Verification").

    An element passes when |artifact - model| <= max(atol, scale_atol * max|model output|) + rtol * |model|:
    float32 rounding grows with the magnitude of the values a layer sums, not with the element's own
    value, so an element near zero in an output whose others are near 500 carries the error of 500."""

    atol: float = Field(1e-4, ge=0, description="Absolute tolerance per element (the floor; see scale_atol).")
    rtol: float = Field(1e-3, ge=0, description="Relative tolerance per element, of the model's own value.")
    scale_atol: float = Field(
        1e-5, ge=0, le=1, description="Absolute tolerance per unit of the output's largest magnitude: the "
        "effective atol of an output is max(atol, scale_atol * max|output|). 1e-5 is about 84 float32 ulps; "
        "0 makes atol a fixed bound.")
    min_cosine: float = Field(0.999, ge=-1, le=1)
    max_unmatched_detections: int = Field(
        0, ge=0, le=10_000, description="Detections (boxes with scores) per sample allowed to have no partner in "
        "the other side's output, for models whose score threshold or NMS can flip on a last-bit difference. "
        "Default: every detection must pair up.")
    samples: int = Field(4, ge=1, le=64)
    seed: int = 0
    fail_on_mismatch: bool = True


class BenchmarkOptions(_Strict):
    """Measure every artifact in its own runtime, and the eager original, on the worker that
    built them (off unless the spec has a `benchmark` key; `benchmark: true` = these defaults)."""

    batches: list[int] | None = Field(
        None, max_length=16, description="Batch sizes to measure; default: the batch dim's min, opt and max "
        "(or the model's static batch).")
    warmup: int = Field(10, ge=0, le=1000, description="Untimed runs per artifact and batch, first.")
    runs: int = Field(50, ge=1, le=10_000, description="Timed runs per artifact and batch (fewer if max_seconds "
                      "runs short; the manifest says how many).")
    threads: int | None = Field(None, ge=1, le=256, description="Threads each runtime uses; default: the job's "
                                "thread budget (the CPUs the worker may use).")
    max_seconds: float = Field(120.0, gt=0, le=3600, description="Bound on the whole stage; what does not fit is "
                               "reported as skipped, with why.")
    rounds: int = Field(3, ge=1, le=20, description="Rounds that take the runtimes in turn, each with its share of "
                        "`runs`: a spell of load on a shared machine then falls on every runtime, and the rounds' "
                        "medians give each p50 an interval; an artifact is recommended only where intervals "
                        "separate.")

    @field_validator("batches")
    @classmethod
    def _batches(cls, v: list[int] | None) -> list[int] | None:
        if v is None:
            return v
        if not v:
            raise ValueError("give at least one batch size, or leave batches out for the default")
        bad = [b for b in v if not 1 <= b <= MAX_DIM]
        if bad:
            raise ValueError(f"batch sizes must be between 1 and {MAX_DIM}, got {bad}")
        return sorted(set(v))


class Limits(_Strict):
    """Per-job resource limits, clamped to the server's maximums."""

    timeout_s: int = Field(900, ge=10, le=24 * 3600)
    memory_mb: int = Field(8192, ge=256, le=1 << 20)


def _default_targets() -> list[Target]:
    return ["torchscript", "onnx", "exported_program", "fx_source"]


def check_elements(idx: int, inp: InputSpec, dims: dict[str, DynamicDim]) -> None:
    """Refuse an input whose largest shape (each dynamic dim at its max) passes
    MAX_ELEMENTS_PER_INPUT; a dim with no range yet is left out of the product."""
    elements = 1
    for d in inp.shape:
        elements *= d if isinstance(d, int) else (dims[d].max if d in dims else 1)
    if elements > MAX_ELEMENTS_PER_INPUT:
        raise ValueError(f"inputs[{idx}] ({inp.name}) has up to {elements} elements; the limit is "
                         f"{MAX_ELEMENTS_PER_INPUT}")


class JobSpec(_Strict):
    _rules_checked: bool = PrivateAttr(default=False)

    inputs: list[InputSpec] = Field(default_factory=list, max_length=MAX_INPUTS)
    dynamic_dims: dict[str, DynamicDim] = Field(default_factory=dict)
    targets: list[Target] = Field(default_factory=_default_targets, min_length=1)
    outputs: list[str] | None = Field(
        None, max_length=MAX_INPUTS, description="Names of the model's outputs in flattened order, given to the "
        "ONNX model (and the TensorRT engine built from it); default output_0, output_1, ...")
    capture: Literal["auto", "fx", "export"] = "auto"
    passes: list[PassSpec] = Field(default_factory=lambda: [PassSpec(name=n) for n in DEFAULT_PASSES])
    precision: Literal["fp32", "fp16", "int8"] = "fp32"
    quantization: QuantizationSpec = Field(default_factory=QuantizationSpec)
    onnx: OnnxOptions = Field(default_factory=OnnxOptions)
    torchscript: TorchScriptOptions = Field(default_factory=TorchScriptOptions)
    tensorrt: TensorRTOptions = Field(default_factory=TensorRTOptions)
    verify: VerifyOptions = Field(default_factory=VerifyOptions)
    benchmark: BenchmarkOptions | None = Field(
        None, description="Measure latency, throughput and memory of every artifact and recommend one "
        "(`true` or a mapping of options; off when absent).")
    package: list[Literal["triton"]] = Field(
        default_factory=list, max_length=1, description="Deployment packages to write beside the artifacts: "
        "triton = a Triton model repository (triton/, with sample requests and a model card) from the verified "
        "onnx, torchscript and tensorrt artifacts (docs/serving.md).")
    limits: Limits = Field(default_factory=Limits)
    labels: dict[str, str] = Field(default_factory=dict, max_length=32)
    allow_partial: bool | None = Field(
        None, description="Accept a job some of whose targets could not be built (listed in failed_targets with why): "
        "it succeeds with the verified artifacts of the others. Off (absent): a job with a failed target fails and "
        "keeps no model file.")

    @field_validator("targets")
    @classmethod
    def _unique_targets(cls, v: list[str]) -> list[str]:
        return list(dict.fromkeys(v))

    @field_validator("outputs")
    @classmethod
    def _output_names(cls, v: list[str] | None) -> list[str] | None:
        if v is None:
            return v
        for i, name in enumerate(v):
            if not _TENSOR_NAME.match(name):
                raise ValueError(f"outputs[{i}] {short_repr(name)}: use 1-128 of letters, digits, _ . : / - "
                                 "(not starting with a digit or punctuation)")
        dup = sorted({n for n in v if v.count(n) > 1})
        if dup:
            raise ValueError(f"duplicate output names {dup}")
        return v

    @field_validator("benchmark", mode="before")
    @classmethod
    def _benchmark_switch(cls, v: Any) -> Any:
        # `benchmark: true` turns it on with the defaults, `false` (or null) leaves it off
        if v is True:
            return {}
        if v is False:
            return None
        return v

    @field_validator("allow_partial")
    @classmethod
    def _partial_switch(cls, v: bool | None) -> bool | None:
        return True if v else None  # `false` is the default: absent, so it keeps the spec's digest

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        for k, val in v.items():
            if not re.match(r"^[A-Za-z0-9_.\-/]{1,63}$", k):
                raise ValueError(f"label key {short_repr(k)}: use 1-63 of letters, digits, _ . - /")
            if len(val) > 256:
                raise ValueError(f"label {short_repr(k)}: value longer than 256 characters")
        return v

    @field_validator("dynamic_dims")
    @classmethod
    def _dim_names(cls, v: dict[str, DynamicDim]) -> dict[str, DynamicDim]:
        for k in v:
            if not _NAME.match(k):
                raise ValueError(f"dynamic dim name {short_repr(k)} must be an identifier")
        return v

    @model_validator(mode="after")
    def _cross_checks(self, info: ValidationInfo) -> JobSpec:
        # Pydantic runs this again whenever a model holding this instance is built (a JobRecord, an
        # EngineRequest): an instance whose rules were checked, or that was decoded trusted, is not
        # checked again. model_copy keeps the mark: its updates come from code, not from a user.
        if self._rules_checked or (info.context and info.context.get("fxport_spec_trusted")):
            self._rules_checked = True
            return self
        RuleChecks.count += 1
        names = [i.name for i in self.inputs]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"inputs: duplicate input names {sorted(dup)}")
        used: set[str] = set()
        for idx, inp in enumerate(self.inputs):
            used.update(d for d in inp.shape if isinstance(d, str))
            # A dim named without a range takes the exported program's (a .pt2 carries its own); any
            # other model is refused at load, naming the dim (workers/engine/inputs.py).
            check_elements(idx, inp, self.dynamic_dims)
        unused = set(self.dynamic_dims) - used
        if unused and self.inputs:
            raise ValueError(f"dynamic_dims {sorted(unused)} are not used by any input shape")
        q = self.quantization
        for key in ("target_cosine", "runtime", "reduce_range"):
            if self.precision != "int8" and getattr(q, key) is not None:
                raise ValueError(f"quantization.{key} is set but precision is not int8")
        if q.runtime == "onnxruntime" and "tensorrt" in self.targets:
            raise ValueError("quantization.runtime onnxruntime cannot feed the tensorrt target: TensorRT takes only "
                             "symmetric int8 (zero point 0); leave quantization.runtime out to get an artifact "
                             "for each")
        if self.precision == "int8" and self.onnx.opset < 18 and any(t in ("onnx", "tensorrt") for t in self.targets):
            raise ValueError(f"onnx.opset {self.onnx.opset} cannot hold int8: fxport writes int8 as per-channel "
                             "Q/DQ through the torch.export-based exporter, which needs opset 18 or newer")
        if q.runtime == "tensorrt" and q.reduce_range:
            raise ValueError("quantization.reduce_range applies to the onnxruntime scheme; TensorRT uses 8-bit weights")
        self._rules_checked = True
        return self

    def int8_runtimes(self, also_targets: Sequence[str] = ()) -> list[str]:
        """The runtimes int8 artifacts are made for, in order (the first is the CPU artifacts' own).
        `also_targets`: targets built later from this run's ONNX (a worker's CPU stage defers tensorrt)."""
        if self.precision != "int8":
            return []
        if self.quantization.runtime is not None:
            return [self.quantization.runtime]
        targets = [*self.targets, *also_targets]
        if "tensorrt" not in targets:
            return ["onnxruntime"]
        return ["onnxruntime", "tensorrt"] if any(t != "tensorrt" for t in targets) else ["tensorrt"]

    # -- derived -------------------------------------------------------------------------

    def normalized(self) -> dict[str, Any]:
        """The spec with every default filled in, as plain JSON data (for manifest + cache key).
        An absent benchmark stays absent, so specs without one keep the digests they had."""
        data = self.model_dump(mode="json")
        if data.get("benchmark") is None:
            data.pop("benchmark", None)
        if data.get("outputs") is None:
            data.pop("outputs", None)
        if data.get("allow_partial") is None:  # likewise for a job that accepts only every target
            data.pop("allow_partial", None)
        for key in ("runtime", "reduce_range"):  # likewise for the int8 scheme's options
            if data["quantization"].get(key) is None:
                data["quantization"].pop(key, None)
        return data

    def artifact_digest(self) -> str:
        """sha256 of what in the spec shapes the artifacts: the normalized spec without `labels`,
        `limits` and `allow_partial` (they describe the job), and with the int8 runtimes resolved (an
        older fxport made symmetric int8 for every runtime). The result cache's key and the artifacts'
        provenance."""
        data = {k: v for k, v in self.normalized().items() if k not in NOT_CONVERSION_INPUTS}
        if self.precision == "int8":
            data["int8_runtimes"] = self.int8_runtimes()
        return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()

    def digest(self) -> str:
        """sha256 of the normalized spec: key order and omitted defaults do not change it."""
        blob = json.dumps(self.normalized(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()


# ---------------------------------------------------------------------------------------
# Parsing with errors a person can act on
# ---------------------------------------------------------------------------------------


def _plain(err: Mapping[str, Any]) -> str:
    kind = err.get("type", "")
    if kind == "extra_forbidden":
        return "unknown key"
    msg: str = err.get("msg", "invalid")
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    if kind == "literal_error":
        msg = f"{msg} (got {short_repr(err.get('input'))})"
    return msg


def _loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            # pydantic inserts union-branch tags ("int", "str", "function-after[...]"); drop them
            if part in ("int", "str") or "[" in str(part):
                continue
            out += ("." if out else "") + str(part)
    return out or "spec"


def _valid_keys_hint(model: type[BaseModel], loc: tuple[Any, ...]) -> str:
    """For an unknown key, list the keys valid at that place in the spec."""
    current: Any = model
    for part in loc[:-1]:
        if isinstance(part, int) or current is None:
            continue
        field = getattr(current, "model_fields", {}).get(part)
        if field is None:
            return ""
        ann = field.annotation
        args = getattr(ann, "__args__", ())
        current = next((a for a in (ann, *args) if isinstance(a, type) and issubclass(a, BaseModel)), None)
    if current is None:
        return ""
    return "; valid keys here: " + ", ".join(current.model_fields)


def parse_spec(data: dict[str, Any] | None) -> JobSpec:
    """Validate a spec mapping. Raises SpecError listing every violation with its field path."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SpecError([("spec", f"must be a mapping of keys to values, got {type(data).__name__}")])
    try:
        return JobSpec.model_validate(data)
    except ValidationError as exc:
        violations = []
        hinted: set[tuple[Any, ...]] = set()  # the valid keys are listed once per mapping
        for err in exc.errors():
            path = _loc(tuple(err["loc"]))
            msg = _plain(err)
            if err.get("type") == "extra_forbidden":
                parent = tuple(err["loc"][:-1])
                hint = "" if parent in hinted else _valid_keys_hint(JobSpec, tuple(err["loc"]))
                hinted.add(parent)
                msg = f"unknown key {short_repr(err['loc'][-1])}{hint}"
            violations.append((path, msg))
        raise SpecError(violations) from None


MAX_SPEC_DEPTH = 10  # nesting of mappings and lists; a spec needs 5 (passes[i].options.swaps[j])


class _Refused(yaml.MarkedYAMLError):  # type: ignore[misc]  # PyYAML has no type hints
    pass


class _SpecLoader(yaml.SafeLoader):  # type: ignore[misc]
    """YAML's safe loader without anchors and aliases, and with nesting at most MAX_SPEC_DEPTH deep.

    An alias repeats a node: nine lines of `&a [*b, *b, ...]` stand for billions of values, which
    validation would then walk and quote (a 400-byte spec took an API to gigabytes). A spec never
    needs one; JSON has none."""

    depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None):
            what = "an alias (*name)" if isinstance(event, yaml.AliasEvent) else "an anchor (&name)"
            raise _Refused(problem=f"{what}: a spec may not use YAML anchors or aliases; write the values out",
                           problem_mark=event.start_mark)
        self.depth += 1
        try:
            if self.depth > MAX_SPEC_DEPTH:
                raise _Refused(problem=f"nested more than {MAX_SPEC_DEPTH} levels deep", problem_mark=event.start_mark)
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1


def load_spec_text(text: str, *, source: str = "spec") -> dict[str, Any]:
    """Parse YAML or JSON (JSON is YAML) text into a mapping; syntax errors name the line. Anchors,
    aliases and nesting past MAX_SPEC_DEPTH are refused (`_SpecLoader`)."""
    try:
        data = yaml.load(text, Loader=_SpecLoader)  # noqa: S506 - a SafeLoader, stricter still
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise SpecError([(source, f"not valid YAML/JSON{where}: {problem}")]) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise SpecError([(source, f"must be a mapping of keys to values, got {type(data).__name__}")])
    return data


def load_spec_file(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise SpecError([(str(p), f"cannot read spec file: {exc.strerror}")]) from None
    return load_spec_text(text, source=p.name)


def parse_input_flag(flag: str) -> dict[str, Any]:
    """`--input NAME:DIMS:DTYPE`, DIMS like `batch,3,224,224` → an InputSpec mapping."""
    parts = flag.split(":")
    if len(parts) not in (2, 3) or not parts[0] or not parts[1]:
        raise SpecError([("--input",
                          f"{short_repr(flag)}: expected NAME:DIMS[:DTYPE], e.g. x:batch,3,224,224:float32")])
    dims: list[int | str] = [int(d) if d.strip().lstrip("-").isdigit() else d.strip() for d in parts[1].split(",")]
    out: dict[str, Any] = {"name": parts[0], "shape": dims}
    if len(parts) == 3:
        out["dtype"] = parts[2]
    return out


def parse_range_flag(flag: str, name: str = "--dynamic-batch") -> dict[str, int]:
    """`MIN:OPT:MAX` → a DynamicDim mapping."""
    parts = flag.split(":")
    try:
        lo, opt, hi = (int(p) for p in parts)
    except ValueError:
        raise SpecError([(name, f"{short_repr(flag)}: expected MIN:OPT:MAX integers, e.g. 1:8:64")]) from None
    return {"min": lo, "opt": opt, "max": hi}


def parse_dynamic_dim_flag(flag: str) -> tuple[str, dict[str, int]]:
    """`--dynamic-dim NAME=MIN:OPT:MAX` → (NAME, a DynamicDim mapping)."""
    name, sep, rng = flag.partition("=")
    if not sep or not _NAME.match(name.strip()):
        raise SpecError([("--dynamic-dim", f"{short_repr(flag)}: expected NAME=MIN:OPT:MAX, e.g. seq=1:128:512")])
    return name.strip(), parse_range_flag(rng, "--dynamic-dim")


def spec_from_flags(
    base: dict[str, Any] | None = None,
    *,
    targets: list[str] | None = None,
    inputs: list[str] | None = None,
    dynamic_batch: str | None = None,
    dynamic_dims: list[str] | None = None,
    passes: list[str] | None = None,
    precision: str | None = None,
    benchmark: bool = False,
    outputs: list[str] | None = None,
    package: list[str] | None = None,
) -> dict[str, Any]:
    """Overlay CLI flags on a spec mapping (flags win). Returns a mapping for `parse_spec`.
    `benchmark`: turn the benchmark on (with the spec file's options, or the defaults)."""
    data = dict(base or {})
    if targets:
        data["targets"] = list(targets)
    if inputs:
        data["inputs"] = [parse_input_flag(f) for f in inputs]
    if dynamic_batch or dynamic_dims:
        dims = dict(data.get("dynamic_dims") or {})
        if dynamic_batch:
            dims["batch"] = parse_range_flag(dynamic_batch)
        for flag in dynamic_dims or ():
            name, rng = parse_dynamic_dim_flag(flag)
            dims[name] = rng
        data["dynamic_dims"] = dims
    if passes:
        data["passes"] = list(passes)
    if precision:
        data["precision"] = precision
    if benchmark and not data.get("benchmark"):
        data["benchmark"] = {}
    if outputs:
        data["outputs"] = list(outputs)
    if package:
        data["package"] = list(dict.fromkeys(package))
    return data
