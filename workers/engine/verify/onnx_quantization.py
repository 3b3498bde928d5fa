"""Checks of a quantized ONNX model: does onnxruntime run it on int8 kernels, would TensorRT accept it.

- `onnxruntime_kernels`: the op histogram of the session's optimized graph (what actually
  runs). QDQ that onnxruntime fused shows up as QLinearConv / QLinearMatMul / QGemm /
  QLinearAdd / ConvInteger / MatMulInteger; a Conv or MatMul left in it runs in float.
- `explicit_quantization_issues`: the rules TensorRT's explicit quantization (and its ONNX
  parser) sets for Q/DQ: int8, zero point 0, positive scales, a QuantizeLinear read by
  DequantizeLinear nodes only, per-channel weight DQ on axis 0 of an int8 initializer.
- `onnxruntime_latency_ms`: median latency of a session on one feed (for the fallback's cost).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

INT8_KERNELS = ("QLinearConv", "QLinearMatMul", "QGemm", "QLinearAdd", "QLinearMul", "ConvInteger", "MatMulInteger",
                "DynamicQuantizeMatMul", "MatMulIntegerToFloat", "QLinearGlobalAveragePool", "QLinearAveragePool",
                "QLinearConcat", "QLinearSigmoid", "QLinearLeakyRelu", "QLinearSoftmax", "QLinearWhere")
FLOAT_COMPUTE = ("Conv", "FusedConv", "MatMul", "Gemm", "FusedMatMul", "NhwcFusedConv")


def _session_options(level: str = "extended") -> Any:
    import onnxruntime as ort

    from fxport.workers.engine.verify.runners import ort_session_options

    opts = ort_session_options()
    opts.graph_optimization_level = {
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }[level]
    return opts


def onnxruntime_kernels(path: Path) -> dict[str, Any]:
    """What onnxruntime's CPU provider runs after its graph optimizations (level "extended":
    all QDQ fusions, without the machine-specific NCHWc layout rewrite of level "all")."""
    import onnx
    import onnxruntime as ort

    with tempfile.TemporaryDirectory(prefix="fxport-ort-") as tmp:
        optimized = Path(tmp) / "optimized.onnx"
        opts = _session_options("extended")
        opts.optimized_model_filepath = str(optimized)
        ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        model = onnx.load(str(optimized), load_external_data=False)
    ops = Counter(n.op_type for n in model.graph.node)
    int8 = {k: v for k, v in ops.items() if k in INT8_KERNELS}
    floats = {k: v for k, v in ops.items() if k in FLOAT_COMPUTE}
    return {"optimization_level": "extended", "int8_kernels": int8, "float_compute": floats,
            "ops": dict(sorted(ops.items(), key=lambda kv: -kv[1]))}


def explicit_quantization_issues(path: Path) -> dict[str, Any]:
    """Q/DQ structure as TensorRT's explicit quantization needs it. `ok` with no issues, else the list."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path))
    graph = model.graph
    consts: dict[str, np.ndarray] = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant":
            for attr in node.attribute:
                if attr.name == "value":
                    consts[node.output[0]] = numpy_helper.to_array(attr.t)
    readers: dict[str, list[Any]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    issues: list[str] = []
    counts: Counter[str] = Counter()
    for node in graph.node:
        if node.op_type not in ("QuantizeLinear", "DequantizeLinear"):
            continue
        counts[node.op_type] += 1
        label = f"{node.op_type} {node.name or node.output[0]}"
        scale = consts.get(node.input[1]) if len(node.input) > 1 else None
        zero = consts.get(node.input[2]) if len(node.input) > 2 and node.input[2] else None
        if scale is None:
            issues.append(f"{label}: scale is not a constant")
        elif not (np.asarray(scale) > 0).all():
            issues.append(f"{label}: non-positive scale")
        if zero is not None:
            if zero.dtype != np.int8:
                issues.append(f"{label}: zero point type {zero.dtype} (TensorRT needs int8)")
            if np.any(zero != 0):
                issues.append(f"{label}: zero point is not 0 (TensorRT needs symmetric quantization)")
        if node.op_type == "QuantizeLinear":
            bad = [r.op_type for r in readers.get(node.output[0], []) if r.op_type != "DequantizeLinear"]
            if bad:
                issues.append(f"{label}: read by {', '.join(sorted(set(bad)))}, not only DequantizeLinear")
        else:
            src = node.input[0]
            if src in consts:  # a weight: int8 initializer, per-channel on its output-channel axis
                if consts[src].dtype != np.int8:
                    issues.append(f"{label}: weight initializer is {consts[src].dtype}, not int8")
                axis = next((a.i for a in node.attribute if a.name == "axis"), 1)
                if scale is not None and np.asarray(scale).size > 1:
                    for reader in readers.get(node.output[0], []):
                        want = _output_channel_axis(reader, node.output[0], consts[src].ndim)
                        if want is not None and axis % consts[src].ndim != want:
                            issues.append(f"{label}: per-channel scale on axis {axis}; {reader.op_type} needs "
                                          f"its output channels, axis {want}")
    return {"ok": not issues, "issues": issues[:50], "quantize_linear": counts["QuantizeLinear"],
            "dequantize_linear": counts["DequantizeLinear"]}


def _output_channel_axis(reader: Any, weight: str, rank: int) -> int | None:
    """The weight axis that indexes output channels for this reader, or None when it is not a weight reader."""
    if reader.op_type in ("Conv", "ConvTranspose") and list(reader.input[1:2]) == [weight]:
        return 0 if reader.op_type == "Conv" else 1
    if reader.op_type == "Gemm" and list(reader.input[1:2]) == [weight]:
        trans_b = next((a.i for a in reader.attribute if a.name == "transB"), 0)
        return 0 if trans_b else 1
    if reader.op_type == "MatMul" and list(reader.input[1:2]) == [weight]:
        return rank - 1
    return None


def onnxruntime_latency_ms(path: Path, feed: dict[str, np.ndarray], *, runs: int = 20, budget_s: float = 5.0) -> float:
    """Median wall time of one session.run at level "all" (what a deployment would use)."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), _session_options("all"), providers=["CPUExecutionProvider"])
    for _ in range(3):
        session.run(None, feed)
    samples: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(samples) < runs and (len(samples) < 5 or time.perf_counter() < deadline):
        start = time.perf_counter()
        session.run(None, feed)
        samples.append((time.perf_counter() - start) * 1000)
    return statistics.median(samples)
