"""The manifest's stage sections as types: benchmark, quantization, tensorrt, sandbox, profile, graphs.

Each stage writes its section as a JSON object (a dict built where the numbers are made); the
manifest reads it into one of these types (fxport/manifest.py), so a reader gets attributes that
mypy checks (`manifest.benchmark.recommendation.artifact`) instead of `.get()` chains, and a
manifest whose section has another shape is refused where it is read.

What stays as it was written:
- the JSON: a section is written back with the keys it was given, in their order, and without the
  typed fields nobody set (`json_form`); every key a type does not name is kept (`extra="allow"`);
- the dict a writer assigned: `Manifest.quantization = {...}` is read into the type
  (`validate_assignment`), and a writer that still patches its section as a dict
  (`quantization["fallback"]["latency"] = ...`, `setdefault`, `{**section, ...}`) finds the
  dict's methods on it (`Section`), over the keys that were written;
- numbers: an int stays an int (`Number`), and a numpy or torch scalar becomes its Python number,
  as the JSON writer made it before.

Only the fields readers use are typed; the rest of a section (a TensorRT engine's metadata, the
per-step fallback record, the ONNX kernel census) is kept as written and documented where it is
made (docs/artifacts.md, "The manifest").
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Self

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    model_validator,
)


def _python_scalar(value: Any) -> Any:
    """A numpy or torch scalar as its Python number or bool (what the JSON writer made of it)."""
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    item = getattr(value, "item", None)
    if callable(item):
        try:
            return item()
        except (TypeError, ValueError, RuntimeError):  # not a scalar
            return value
    return value


# An int stays an int in the JSON (pydantic would make 5 into 5.0 for a `float`).
Number = Annotated[int | float, BeforeValidator(_python_scalar)]
Flag = Annotated[bool, BeforeValidator(_python_scalar)]


class Section(BaseModel):
    """A section a stage writes as a JSON object: typed fields, unknown keys kept, and the reading and
    writing methods of the dict it was, over the keys that were written (`keys()`), so `{**section}`,
    `section.get("x")`, `section["x"] = y` and `section == {...}` behave as they did on the dict."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)

    # the keys as they came in, so the section is written back in the writer's order
    _key_order: list[str] = PrivateAttr(default_factory=list)
    # fields written first, in the order declared (where a record was typed before it was a Section)
    _written_first: ClassVar[tuple[str, ...]] = ()

    @model_validator(mode="wrap")
    @classmethod
    def _remember_key_order(cls, data: Any, handler: ModelWrapValidatorHandler[Self]) -> Self:
        record = handler(data)
        if isinstance(data, Mapping) and record is not data:
            record._key_order = [str(key) for key in data]
        return record

    # -- the dict's methods ------------------------------------------------------------------

    def keys(self) -> list[str]:
        """The keys that were written (typed or not), in the order they were written."""
        fields = type(self).model_fields
        present = [k for k in fields if k in self.model_fields_set] + list(self.__pydantic_extra__ or {})
        ordered = [k for k in self._key_order if k in present]
        return ordered + [k for k in present if k not in ordered]

    def __getitem__(self, key: str) -> Any:
        if key in type(self).model_fields and key in self.model_fields_set:
            return getattr(self, key)
        extra = self.__pydantic_extra__ or {}
        if key in extra:
            return extra[key]
        raise KeyError(key)

    def __setitem__(self, key: str, value: Any) -> None:
        if key in type(self).model_fields:
            setattr(self, key, value)  # validated into the field's type
        elif self.__pydantic_extra__ is not None:
            self.__pydantic_extra__[key] = value
        if key not in self._key_order:
            self._key_order.append(key)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and key in self.keys()

    def __len__(self) -> int:
        return len(self.keys())

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key in self else default

    def setdefault(self, key: str, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return self[key]  # the stored value: a typed field holds a validated copy of `default`

    def items(self) -> list[tuple[str, Any]]:
        return [(k, self[k]) for k in self.keys()]

    def values(self) -> list[Any]:
        return [self[k] for k in self.keys()]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Section):
            return type(self) is type(other) and json_form(self) == json_form(other)
        if isinstance(other, Mapping):
            other_form: dict[str, Any] = json.loads(json.dumps(dict(other), default=_jsonable))
            return json_form(self) == other_form
        return NotImplemented


# ---------------------------------------------------------------- the JSON form


def json_form(model: BaseModel) -> dict[str, Any]:
    """`model` as JSON data: the fields that were set or differ from their default, then unknown keys
    (a section's in the order they were written). A field nobody wrote is left out rather than
    written as its default, so a record read and written back is the record that was read."""
    # through json with a fallback, not model_dump(mode="json"): an open-ended part may hold a numpy
    # scalar or a torch dtype, which must not cost the job its manifest
    return _written(model, json.loads(json.dumps(model.model_dump(), default=_jsonable)))


def _jsonable(value: Any) -> Any:
    """A value JSON has no type for: a record's JSON form, a Python number (for a numpy or torch
    scalar), else its text."""
    if isinstance(value, BaseModel):
        return json_form(value)
    item = getattr(value, "item", None)
    if callable(item):
        try:
            return item()
        except (TypeError, ValueError, RuntimeError):  # not a scalar
            pass
    return str(value)


@functools.cache  # keyed on (class, field): a field's default is fixed once its class is defined
def _default(cls: type[BaseModel], key: str) -> Any:
    """A field's default, made once per class (pydantic inspects the factory's signature on every
    call): only ever compared with, never handed out, so a mutable default is never shared."""
    return cls.model_fields[key].get_default(call_default_factory=True)


def _written(model: BaseModel, data: dict[str, Any]) -> dict[str, Any]:
    """`data` (model's dump) without the fields of `model`, at any depth, that were never set and
    still hold their default; a section's keys in the order they were written."""
    fields = type(model).model_fields
    out: dict[str, Any] = {}
    for key, dumped in data.items():
        if key in fields:
            value = getattr(model, key)
            if key not in model.model_fields_set and value == _default(type(model), key):
                continue
            dumped = _written_value(value, dumped)
        out[key] = dumped
    if isinstance(model, Section) and model._key_order:
        first = model._written_first
        order = {key: i for i, key in enumerate([*first, *(k for k in model._key_order if k not in first)])}
        out = dict(sorted(out.items(), key=lambda kv: order.get(kv[0], len(order))))
    return out


def _written_value(value: Any, dumped: Any) -> Any:
    if isinstance(value, BaseModel):
        return _written(value, dumped)
    if isinstance(value, list) and isinstance(dumped, list):
        return [_written_value(v, d) for v, d in zip(value, dumped)]
    if isinstance(value, dict) and isinstance(dumped, dict):
        return {key: _written_value(v, d) for v, (key, d) in zip(value.values(), dumped.items())}
    return dumped


# ---------------------------------------------------------------- benchmark (fxport/benchmark.py)


class BenchmarkRow(Section):
    """One artifact at one batch size (workers/engine/benchmark.py `measure`)."""

    artifact: str
    batch: int
    runtime: str | None = None
    p50_ms: Number | None = None
    p50_range_ms: list[Number] | None = None  # the lowest and highest of the rounds' medians
    round_p50_ms: list[Number] | None = None
    p95_ms: Number | None = None
    mean_ms: Number | None = None
    throughput_per_s: Number | None = None
    runs: int | None = None
    rounds: int | None = None
    memory_mib: Number | None = None  # what the runtime added to the process
    peak_rss_mib: Number | None = None
    verified: Flag = False
    threads: int | None = None


class BenchmarkSkip(Section):
    artifact: str | None = None
    batch: int | None = None
    reason: str = ""


class Recommendation(Section):
    """What to deploy: the artifact and the batch (`fxport.benchmark.recommend`)."""

    artifact: str
    batch: int | None = None
    reason: str = ""
    per_batch: list[dict[str, Any]] = Field(default_factory=list)


class UnclearBatch(Section):
    """A batch where the fastest verified artifact's interval overlaps another's."""

    batch: int | None = None
    artifacts: list[str] = Field(default_factory=list)
    reason: str = ""


class NoisyRow(Section):
    artifact: str | None = None
    batch: int | None = None
    spread: Number | None = None  # highest ÷ lowest of its rounds' medians
    round_p50_ms: list[Number] | None = None


class BenchmarkNoise(Section):
    noisy: Flag = False
    threshold: Number | None = None
    worst: NoisyRow | None = None


class Machine(Section):
    """The machine a benchmark ran on (`fxport.benchmark.machine_info`, the GPU stage adds `gpu`)."""

    cpu: str | None = None
    cores: int | None = None
    usable_cpus: int | None = None
    arch: str | None = None
    isa: list[str] = Field(default_factory=list)
    gpu: str | None = None


class BenchmarkSettings(Section):
    batches: list[int] = Field(default_factory=list)
    warmup: int | None = None
    runs: int | None = None
    rounds: int | None = None
    threads: int | None = None
    max_seconds: Number | None = None


class Benchmark(Section):
    """The manifest's `benchmark`: latency and throughput per artifact and batch, and the pick."""

    results: list[BenchmarkRow] = Field(default_factory=list)
    skipped: list[BenchmarkSkip] = Field(default_factory=list)
    recommendation: Recommendation | None = None
    machine: Machine | None = None
    noise: BenchmarkNoise | None = None
    no_clear_winner: list[UnclearBatch] = Field(default_factory=list)
    settings: BenchmarkSettings | None = None
    seconds: Number | None = None

    def as_dict(self) -> dict[str, Any]:
        """The section as the plain dict `fxport.benchmark`'s functions take."""
        return json_form(self)


# ---------------------------------------------------------------- quantization (workers/engine/quantize)


class Int8Scheme(Section):
    """How an int8 scheme quantizes (workers/engine/quantize/scheme.py `describe`)."""

    runtime: str | None = None
    activations: str | None = None
    weights: str | None = None
    reduce_range: Flag | None = None


class LayerReport(Section):
    """One quantized layer, measured on held-out data."""

    node: str | None = None
    op: str | None = None
    sqnr_db: Number | None = None
    cosine: Number | None = None
    cumulative_sqnr_db: Number | None = None
    cumulative_cosine: Number | None = None
    fallback: Flag = False  # kept in fp32 to reach quantization.target_cosine


class EndToEnd(Section):
    """The quantized model against fp32 on the held-out samples."""

    cosine: Number | None = None
    sqnr_db: Number | None = None
    top1_agreement: Number | None = None
    samples: int | None = None
    target_met: Flag | None = None  # None: no target_cosine
    cosine_all_int8: Number | None = None
    top1_all_int8: Number | None = None


class FallbackLatency(Section):
    """What the fp32 layers cost in onnxruntime (added after the ONNX model is built)."""

    runtime: str | None = None
    ms_all_int8: Number | None = None
    ms_with_fallback: Number | None = None
    cost_ms: Number | None = None
    ratio: Number | None = None


class Fallback(Section):
    steps: list[dict[str, Any]] = Field(default_factory=list)  # each layer put back in fp32, in order
    fp32_macs_share: Number | None = None
    latency: FallbackLatency | None = None


class Calibration(Section):
    """Where the int8 ranges came from (workers/engine/calibration.py)."""

    source: str | None = None  # "file" | "random"
    samples: int | None = None
    held_out: int | None = None
    batch_size: int | None = None
    observer: str | None = None


class KeptOp(Section):
    """An op an fp16 graph keeps in fp32."""

    node: str | None = None
    op: str | None = None


class QuantizationReport(Section):
    """One int8 scheme's report (workers/engine/quantize/ptq.py `_report`)."""

    precision: str | None = None  # "int8" | "fp16"
    method: str | None = None
    observer: str | None = None
    runtime: str | None = None  # the runtime the scheme is for (onnxruntime, fbgemm, tensorrt)
    scheme: Int8Scheme | None = None
    layers: list[LayerReport] = Field(default_factory=list)
    worst: list[str] = Field(default_factory=list)
    fallback_layers: list[str] = Field(default_factory=list)
    target_cosine: Number | None = None
    end_to_end: EndToEnd | None = None
    fallback: Fallback | None = None


class Quantization(QuantizationReport):
    """The manifest's `quantization`: the first int8 scheme's report (or fp16's casts), where the
    calibration came from, and every scheme's report under `schemes` (one per runtime)."""

    kept_fp32: list[KeptOp] = Field(default_factory=list)  # fp16
    casts: int | None = None  # fp16
    calibration: Calibration | None = None
    schemes: dict[str, QuantizationReport] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _share_the_first_schemes_records(self) -> Self:
        """The engine writes the first scheme's report as the section itself and as its `schemes`
        entry: one record in two places, which a later step adds to once (the fallback's latency)
        and both places show. Read into types they would be two copies; this makes them one again."""
        first = self.schemes.get(self.runtime or "")
        if first is not None:
            for name in QuantizationReport.model_fields:
                mine = self.__dict__.get(name)
                if isinstance(mine, Section) and first.__dict__.get(name) == mine:
                    first.__dict__[name] = mine
        return self


# ---------------------------------------------------------------- the other stages


class TensorRT(Section):
    """The manifest's `tensorrt` (docs/tensorrt.md): the parser preflight, the engine's metadata,
    the build, the shared timing cache. Kept as written: no reader here looks inside."""

    preflight: dict[str, Any] | None = None
    engine: dict[str, Any] | None = None
    build: dict[str, Any] | None = None


class Sandbox(Section):
    """The manifest's `sandbox`: the isolation layers the job ran under (workers/sandbox), each
    true when it held; fxport/isolation.py labels them."""

    network_isolated: Flag | None = None
    memory_limit_mb: int | None = None
    cpu_limit_s: Number | None = None
    no_new_processes: Flag | None = None
    sockets_blocked: Flag | None = None
    no_new_privs: Flag | None = None
    capabilities_dropped: Flag | None = None
    filesystem_reads_confined: Flag | None = None
    filesystem_writes_confined: Flag | None = None
    tcp_blocked: Flag | None = None
    unix_sockets_local: Flag | None = None
    setup_ms: Number | None = None

    def as_dict(self) -> dict[str, Any]:
        """The layers as the plain dict fxport/isolation.py `describe_layers` reads."""
        return json_form(self)


class ProfileNode(Section):
    node: str | None = None
    op: str | None = None
    ms: Number | None = None
    share: Number | None = None  # of the whole graph's time


class Profile(Section):
    """The manifest's `profile` (the profile_nodes pass): the slowest nodes, eager."""

    top_nodes: list[ProfileNode] = Field(default_factory=list)
    total_ms: Number | None = None
    runs: int | None = None


class GraphNode(Section):
    name: str
    op: str | None = None  # placeholder, get_attr, call_function, call_module, call_method, output
    target: str | None = None
    inputs: list[str] = Field(default_factory=list)


class GraphSummary(Section):
    """`graph_before` / `graph_after`: the FX graph's nodes (the first 2000), enough to draw it."""

    node_count: int | None = None
    op_counts: dict[str, int] = Field(default_factory=dict)
    nodes: list[GraphNode] = Field(default_factory=list)


class CaptureAttempt(Section):
    """One rung of the capture ladder."""

    method: str | None = None
    strict: Flag | None = None
    ok: Flag = False
    error: str | None = None
    note: str | None = None
    source_line: str | None = None

