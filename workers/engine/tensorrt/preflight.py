"""CPU preflight of an ONNX model for TensorRT: the ops, attributes and types its ONNX parser rejects.

Runs where there is no GPU and no TensorRT (the CPU stage), so a model TensorRT cannot take
fails in seconds, naming the node, instead of after a trip through the GPU queue. The op
table is data (`support_matrix.py`, from onnx-tensorrt's operator matrix for TensorRT 10.15);
this module walks the graph — subgraphs of If/Loop/Scan and model-local functions too — and
checks each node against it, plus the restrictions that can be decided without running
anything (attribute values, constant inputs, element types).

A finding is an *error* (the parser is documented to reject it: the job fails) or a
*warning* (it may parse, or may not on an older TensorRT 10.x; recorded in the manifest).
The parser on the GPU worker stays the authority: a model that passes here can still fail
there, and that error names the node too (builder.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from fxport.errors import ConversionFailed
from fxport.workers.engine.tensorrt import support_matrix as sm

Severity = Literal["error", "warning"]
_DEFAULT_DOMAINS = ("", "ai.onnx")
_MAX_LISTED = 5  # findings named in the error message; the manifest has them all


@dataclass(frozen=True)
class Finding:
    severity: Severity
    node: str  # the node's name (or "#index (output name)" when it has none), or a tensor name
    op_type: str  # "" for a graph-level finding (opset, a graph input's type)
    reason: str
    where: str = ""  # "" at the top level, else the subgraph / local function the node sits in

    def describe(self) -> str:
        subject = f"node {self.node!r} (op {self.op_type})" if self.op_type else self.node
        inside = f" in {self.where}" if self.where else ""
        return f"{subject}{inside}: {self.reason}"

    def as_dict(self) -> dict[str, str]:
        return {k: v for k, v in asdict(self).items() if v or k in ("node", "reason", "severity")}


@dataclass
class PreflightReport:
    findings: list[Finding]
    opset: int | None
    node_count: int
    op_counts: dict[str, int] = field(default_factory=dict)
    has_qdq: bool = False

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "warning"]

    @property
    def ok(self) -> bool:
        return not self.errors

    def as_dict(self) -> dict[str, Any]:
        return {
            "checked_against": f"TensorRT {sm.TENSORRT_VERSION} ONNX parser (opsets {sm.OPSET_MIN}-{sm.OPSET_MAX})",
            "source": sm.SOURCE,
            "ok": self.ok,
            "opset": self.opset,
            "nodes": self.node_count,
            "explicit_quantization": self.has_qdq,
            "errors": [f.as_dict() for f in self.errors],
            "warnings": [f.as_dict() for f in self.warnings],
            "op_counts": dict(sorted(self.op_counts.items(), key=lambda kv: (-kv[1], kv[0]))),
        }


def preflight_onnx(model: Any, *, precision: str | None = None) -> PreflightReport:
    """Check an ONNX model (a path or a loaded ModelProto) against TensorRT's ONNX parser.

    `precision` adds the checks that precision needs: int8 builds from explicit Q/DQ.
    Weights are never loaded (external data stays on disk); the model is not modified.
    """
    import onnx

    if isinstance(model, (str, Path)):
        model = onnx.load(str(model), load_external_data=False)
    try:
        inferred = onnx.shape_inference.infer_shapes(model, check_type=False, strict_mode=False)
    except Exception:  # inference is a help for the type checks, never a reason to fail
        inferred = model
    opset = next((o.version for o in model.opset_import if o.domain in _DEFAULT_DOMAINS), None)
    walk = _Walk(model, inferred)
    walk.check_opset(opset)
    walk.check_graph_types(inferred.graph)
    walk.graph(model.graph, where="", outer_constants=set())
    report = PreflightReport(findings=walk.findings, opset=opset, node_count=walk.node_count,
                             op_counts=walk.op_counts, has_qdq=walk.has_qdq)
    if precision == "int8" and not walk.has_qdq:
        report.findings.append(Finding(
            "error", "model", "",
            "precision int8 builds a TensorRT engine from explicit quantization (QuantizeLinear/DequantizeLinear "
            "pairs), and this ONNX model has none"))
    return report


def check_preflight(report: PreflightReport) -> None:
    """Raise ConversionFailed (stage tensorrt) naming the nodes, if the report has errors."""
    errors = report.errors
    if not errors:
        return
    listed = "; ".join(f.describe() for f in errors[:_MAX_LISTED])
    more = (f"; and {len(errors) - _MAX_LISTED} more (manifest.json tensorrt.preflight)"
            if len(errors) > _MAX_LISTED else "")
    raise ConversionFailed(
        f"TensorRT preflight: {len(errors)} problem(s) TensorRT {sm.TENSORRT_VERSION}'s ONNX parser rejects: "
        f"{listed}{more}",
        stage="tensorrt", field="targets",
        hint="drop tensorrt from targets, or change the model so the named ops are not exported "
             "(an equivalent torch op that exports to a supported ONNX op)",
        detail="\n".join(f.describe() for f in errors),
    )


# ---------------------------------------------------------------------------------------
# The walk
# ---------------------------------------------------------------------------------------


class _Walk:
    def __init__(self, model: Any, inferred: Any) -> None:
        self.findings: list[Finding] = []
        self.node_count = 0
        self.op_counts: dict[str, int] = {}
        self.has_qdq = False
        self.functions = {(f.domain, f.name): f for f in model.functions}
        self.types = _element_types(inferred.graph)
        self._in_function: list[str] = []

    def add(self, severity: Severity, node: str, op_type: str, reason: str, where: str) -> None:
        finding = Finding(severity, node, op_type, reason, where)
        if finding not in self.findings:
            self.findings.append(finding)

    def check_opset(self, opset: int | None) -> None:
        if opset is None:
            self.add("error", "model", "", "imports no default-domain (ai.onnx) opset", "")
        elif opset < sm.OPSET_MIN:
            self.add("error", "model", "", f"opset {opset} is older than TensorRT's parser accepts "
                     f"({sm.OPSET_MIN}-{sm.OPSET_MAX}); re-export with a newer opset", "")
        elif opset > sm.OPSET_MAX:
            self.add("warning", "model", "", f"opset {opset} is newer than TensorRT {sm.TENSORRT_VERSION}'s parser "
                     f"documents ({sm.OPSET_MIN}-{sm.OPSET_MAX})", "")

    def check_graph_types(self, graph: Any) -> None:
        """Element types TensorRT has no tensor type for, anywhere in the top-level graph."""
        io = {v.name for v in graph.input} | {v.name for v in graph.output}
        qdq_io: set[str] = set()
        for node in graph.node:
            if node.op_type == "QuantizeLinear":
                qdq_io.update(node.output)
            elif node.op_type == "DequantizeLinear":
                qdq_io.update(i for i in node.input if i)
        producers = {out: n for n in graph.node for out in n.output}
        for name, elem in sorted(self.types.items()):
            type_name = sm.ONNX_TYPE_NAMES.get(elem, f"type {elem}")
            producer = producers.get(name)
            node, op = (_node_label(producer, -1), producer.op_type) if producer is not None else (name, "")
            subject = f"tensor {name!r}" if producer is not None else ("graph input/output" if name in io else "tensor")
            if type_name in sm.UNSUPPORTED_TYPES or elem not in sm.ONNX_TYPE_NAMES:
                self.add("error", node, op, f"{subject} has element type {type_name}, which TensorRT has no tensor "
                         "type for", "")
            elif type_name == "UINT8" and name not in io and (producer is None or producer.op_type != "Cast"):
                self.add("warning", node, op, f"{subject} is UINT8: {sm.LIMITED_TYPES['UINT8']}", "")
            elif type_name == "INT8" and name not in qdq_io:
                self.add("warning", node, op, f"{subject} is INT8 outside a Q/DQ pair: {sm.LIMITED_TYPES['INT8']}", "")
            elif type_name == "DOUBLE":
                self.add("warning", node, op, f"{subject} is DOUBLE: {sm.LIMITED_TYPES['DOUBLE']}", "")

    def graph(self, graph: Any, where: str, outer_constants: set[str]) -> None:
        constants = set(outer_constants) | {i.name for i in graph.initializer}
        constants |= {n.output[0] for n in graph.node if n.op_type == "Constant" and n.output}
        values = _constant_values(graph)
        for index, node in enumerate(graph.node):
            self.node(node, index, where, constants, values)

    def node(self, node: Any, index: int, where: str, constants: set[str], values: dict[str, Any]) -> None:
        self.node_count += 1
        label = _node_label(node, index)
        op = node.op_type
        if node.domain not in _DEFAULT_DOMAINS:
            function = self.functions.get((node.domain, op))
            if function is not None and function.name not in self._in_function:
                # the parser expands model-local functions: what matters is what they contain
                self._in_function.append(function.name)
                inner = {n.output[0] for n in function.node if n.op_type == "Constant" and n.output}
                for i, inner_node in enumerate(function.node):
                    self.node(inner_node, i, _join(where, f"function {function.name!r} (called by {label})"),
                              inner, {})
                self._in_function.pop()
                return
            self.op_counts[f"{node.domain}::{op}"] = self.op_counts.get(f"{node.domain}::{op}", 0) + 1
            self.add("error", label, f"{node.domain}::{op}",
                     "custom-domain op: TensorRT's parser takes it only as a plugin registered under that name, "
                     "and the GPU worker registers none", where)
            return
        self.op_counts[op] = self.op_counts.get(op, 0) + 1
        if op in ("QuantizeLinear", "DequantizeLinear"):
            self.has_qdq = True
        supported = sm.is_supported(op)
        if supported is None:
            self.add("error", label, op, f"not in TensorRT {sm.TENSORRT_VERSION}'s ONNX operator table", where)
        elif not supported:
            self.add("error", label, op, f"not supported by TensorRT {sm.TENSORRT_VERSION}'s ONNX parser", where)
        else:
            if op in sm.ADDED_AFTER_10_0:
                self.add("warning", label, op, f"parsed only by TensorRT {sm.ADDED_AFTER_10_0[op]} or newer; an older "
                         "TensorRT 10.x on the GPU worker rejects it", where)
            check = _ATTRIBUTE_CHECKS.get(op)
            if check is not None:
                for severity, reason in check(node, _Ctx(constants, values)):
                    self.add(severity, label, op, reason, where)
            self.check_input_type(node, label, where)
        for attr in node.attribute:
            if attr.type == _GRAPH:
                self.graph(attr.g, _join(where, f"{op} {label}.{attr.name}"), constants)
            elif attr.type == _GRAPHS:
                for k, g in enumerate(attr.graphs):
                    self.graph(g, _join(where, f"{op} {label}.{attr.name}[{k}]"), constants)

    def check_input_type(self, node: Any, label: str, where: str) -> None:
        """The table's "Supported Types" for the op's first (data) input: a mismatch is a warning,
        since that column is how the table describes the op, not a promise about every input."""
        if node.op_type in _TYPE_AGNOSTIC or not node.input or not node.input[0]:
            return
        allowed = sm.supported_types(node.op_type)
        elem = self.types.get(node.input[0])
        if not allowed or elem is None:
            return
        name = sm.ONNX_TYPE_NAMES.get(elem, f"type {elem}")
        if name not in allowed and name not in sm.UNSUPPORTED_TYPES:  # unsupported types are errors already
            self.add("warning", label, node.op_type,
                     f"input {node.input[0]!r} is {name}; the table lists {', '.join(sorted(allowed))} for this op",
                     where)


_GRAPH, _GRAPHS = 5, 10  # onnx.AttributeProto.GRAPH / GRAPHS
# ops whose first input is a shape, an index, or of any type by design
_TYPE_AGNOSTIC = frozenset({"Cast", "CastLike", "Shape", "Size", "Constant", "ConstantOfShape", "QuantizeLinear",
                            "DequantizeLinear", "Identity", "If", "Loop", "Scan", "Range", "RandomNormal",
                            "RandomUniform", "EyeLike", "Dropout"})


def _join(where: str, part: str) -> str:
    return f"{where} / {part}" if where else part


def _node_label(node: Any, index: int) -> str:
    if node.name:
        return node.name
    out = next((o for o in node.output if o), "")
    return f"#{index} (output {out})" if index >= 0 else f"(output {out})"


def _element_types(graph: Any) -> dict[str, int]:
    types: dict[str, int] = {}
    for value in list(graph.input) + list(graph.output) + list(graph.value_info):
        elem = value.type.tensor_type.elem_type if value.type.HasField("tensor_type") else 0
        if elem:
            types[value.name] = elem
    for init in graph.initializer:
        types[init.name] = init.data_type
    return types


def _constant_values(graph: Any) -> dict[str, Any]:
    """Small constants as numpy arrays (zero points, axes, K...); big or external ones are skipped."""
    from onnx import numpy_helper

    out: dict[str, Any] = {}
    for init in graph.initializer:
        if init.data_location != 1 and _numel(init.dims) <= 4096:  # 1 = EXTERNAL
            try:
                out[init.name] = numpy_helper.to_array(init)
            except Exception:
                pass
    for node in graph.node:
        if node.op_type == "Constant" and node.output:
            for attr in node.attribute:
                if attr.name == "value" and _numel(attr.t.dims) <= 4096:
                    try:
                        out[node.output[0]] = numpy_helper.to_array(attr.t)
                    except Exception:
                        pass
                elif attr.name in ("value_int", "value_ints", "value_float", "value_floats"):
                    import numpy as np

                    raw = {"value_int": attr.i, "value_ints": list(attr.ints), "value_float": attr.f,
                           "value_floats": list(attr.floats)}[attr.name]
                    out[node.output[0]] = np.asarray(raw)
    return out


def _numel(dims: Iterable[int]) -> int:
    n = 1
    for d in dims:
        n *= d
    return n


# ---------------------------------------------------------------------------------------
# Attribute / input restrictions (support_matrix.RESTRICTIONS that can be decided statically)
# ---------------------------------------------------------------------------------------


@dataclass
class _Ctx:
    constants: set[str]  # names that are initializers or Constant outputs (build-time constants)
    values: dict[str, Any]  # their values, where small and inline

    def is_constant(self, name: str) -> bool:
        return name in self.constants

    def value(self, name: str) -> Any:
        return self.values.get(name)


Issue = tuple[Severity, str]


def _attr(node: Any, name: str, default: Any = None) -> Any:
    for a in node.attribute:
        if a.name == name:
            if a.type == 1:
                return a.f
            if a.type == 2:
                return a.i
            if a.type == 3:
                return a.s.decode("utf-8", "replace")
            if a.type == 6:
                return list(a.floats)
            if a.type == 7:
                return list(a.ints)
            return a
    return default


def _input(node: Any, i: int) -> str:
    return node.input[i] if len(node.input) > i else ""


def _pooling(node: Any, ctx: _Ctx) -> list[Issue]:
    issues: list[Issue] = []
    kernel = _attr(node, "kernel_shape") or []
    if kernel and len(kernel) not in (2, 3):
        issues.append(("warning", f"{len(kernel)}D pooling: the table lists 2D or 3D pooling only"))
    dilations = _attr(node, "dilations") or []
    if any(d != 1 for d in dilations):
        issues.append(("error", f"dilations {dilations}: TensorRT needs them empty or all ones"))
    if node.op_type == "MaxPool" and len(node.output) > 1 and node.output[1]:
        issues.append(("error", "the Indices output is unsupported"))
    return issues


_RESIZE_COORDS = {"half_pixel", "pytorch_half_pixel", "tf_half_pixel_for_nn", "asymmetric", "align_corners"}
_RESIZE_NEAREST = {"floor", "ceil", "round_prefer_floor", "round_prefer_ceil"}


def _resize(node: Any, ctx: _Ctx) -> list[Issue]:
    issues: list[Issue] = []
    mode = _attr(node, "mode", "nearest")
    if mode not in ("nearest", "linear"):
        issues.append(("error", f"mode {mode!r}: TensorRT resizes with nearest or linear only"))
    coords = _attr(node, "coordinate_transformation_mode", "half_pixel")
    if coords not in _RESIZE_COORDS:
        issues.append(("error", f"coordinate_transformation_mode {coords!r} is unsupported "
                                f"(supported: {', '.join(sorted(_RESIZE_COORDS))})"))
    nearest = _attr(node, "nearest_mode", "round_prefer_floor")
    if mode == "nearest" and nearest not in _RESIZE_NEAREST:
        issues.append(("error", f"nearest_mode {nearest!r} is unsupported"))
    if _attr(node, "antialias", 0):
        issues.append(("error", "antialiasing is not supported"))
    policy = _attr(node, "keep_aspect_ratio_policy", "stretch")
    if policy != "stretch":
        issues.append(("error", f"keep_aspect_ratio_policy {policy!r}: only 'stretch' is supported"))
    return issues


def _dropout(node: Any, ctx: _Ctx) -> list[Issue]:
    training = _input(node, 2)
    if not training:
        return []
    if not ctx.is_constant(training):
        return [("error", f"training_mode input {training!r} must be an initializer that is False")]
    value = ctx.value(training)
    if value is not None and bool(value.any()):
        return [("error", "training_mode is True; TensorRT runs Dropout in inference mode only")]
    return []


def _layer_norm(node: Any, ctx: _Ctx) -> list[Issue]:
    if any(o for o in node.output[1:]):
        return [("error", "only the first output (Y) is supported; Mean / InvStdDev are used here")]
    return []


def _lstm(node: Any, ctx: _Ctx) -> list[Issue]:
    issues: list[Issue] = []
    if _attr(node, "input_forget", 0):
        issues.append(("error", "input_forget must be 0"))
    if _attr(node, "layout", 0):
        issues.append(("error", "layout must be 0"))
    return issues


def _scatter_nd(node: Any, ctx: _Ctx) -> list[Issue]:
    reduction = _attr(node, "reduction", "none")
    return [("error", f"reduction {reduction!r} is not supported (only 'none')")] if reduction != "none" else []


def _topk(node: Any, ctx: _Ctx) -> list[Issue]:
    issues: list[Issue] = []
    if _attr(node, "sorted", 1) == 0:
        issues.append(("error", "sorted=0 is not supported"))
    k = ctx.value(_input(node, 1))
    if k is not None and k.size and int(k.max()) >= 3840:
        issues.append(("error", f"K={int(k.max())}: TensorRT needs K < 3840"))
    return issues


def _constant_input(index: int, what: str, severity: Severity = "error") -> Callable[[Any, _Ctx], list[Issue]]:
    def check(node: Any, ctx: _Ctx) -> list[Issue]:
        name = _input(node, index)
        if name and not ctx.is_constant(name):
            return [(severity, f"{what} ({name!r}) must be a build-time constant (an initializer or Constant)")]
        return []
    return check


def _zero_point(index: int, name: str) -> Callable[[Any, _Ctx], list[Issue]]:
    def check(node: Any, ctx: _Ctx) -> list[Issue]:
        zp = _input(node, index)
        if not zp:
            return []
        value = ctx.value(zp)
        if value is None:
            if not ctx.is_constant(zp):
                return [("error", f"{name} ({zp!r}) must be a constant 0")]
            return []
        if str(value.dtype) == "uint8":
            return [("error", f"{name} is uint8 (asymmetric quantization): TensorRT takes int8 with zero point 0")]
        if value.size and bool((value != 0).any()):
            return [("error", f"{name} is not 0: TensorRT takes symmetric quantization only")]
        return []
    return check


def _constant(node: Any, ctx: _Ctx) -> list[Issue]:
    bad = [a.name for a in node.attribute if a.name in ("sparse_value", "value_string", "value_strings")]
    return [("error", f"attribute {bad[0]} is unsupported")] if bad else []


def _cast(node: Any, ctx: _Ctx) -> list[Issue]:
    to = _attr(node, "to")
    name = sm.ONNX_TYPE_NAMES.get(to, f"type {to}") if isinstance(to, int) else None
    if name is not None and name in sm.UNSUPPORTED_TYPES:
        return [("error", f"casts to {name}, which TensorRT has no tensor type for")]
    return []


def _stft(node: Any, ctx: _Ctx) -> list[Issue]:
    return _constant_input(1, "frame_step")(node, ctx) + _constant_input(2, "window")(node, ctx)


def _reduce(node: Any, ctx: _Ctx) -> list[Issue]:
    return _constant_input(1, "axes")(node, ctx)


_ATTRIBUTE_CHECKS: dict[str, Callable[[Any, _Ctx], list[Issue]]] = {
    "AveragePool": _pooling, "MaxPool": _pooling, "LpPool": _pooling,
    "Resize": _resize,
    "Dropout": _dropout,
    "LayerNormalization": _layer_norm,
    "LSTM": _lstm,
    "ScatterND": _scatter_nd,
    "TopK": _topk,
    "CumSum": _constant_input(1, "axis"),
    "OneHot": _constant_input(1, "depth"),
    "Squeeze": _constant_input(1, "axes", "warning"),
    "Unsqueeze": _constant_input(1, "axes", "warning"),
    "QuantizeLinear": _zero_point(2, "y_zero_point"),
    "DequantizeLinear": _zero_point(2, "x_zero_point"),
    "Constant": _constant,
    "Cast": _cast,
    "STFT": _stft,
    **{op: _reduce for op in ("ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceMax", "ReduceMean",
                              "ReduceMin", "ReduceProd", "ReduceSum", "ReduceSumSquare")},
}
