"""The int8 quantize stage: calibrate, convert to Q/DQ, measure per layer, fall back until on target.

`calibrate_int8` observes the activation ranges once; `quantize_int8` turns them into a Q/DQ
graph in one scheme (scheme.py: the runtime the artifacts are for), with its own per-layer
report and fallback. Neither modifies the graph it is given; `Int8Result.qdq.gm` is the
quantized graph the artifacts of that scheme come from.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import GraphModule, Node

from fxport.errors import ConversionFailed
from fxport.spec import QuantizationSpec
from fxport.workers.engine.quantize.fidelity import end_to_end, float_outputs, per_layer
from fxport.workers.engine.quantize.int8 import (
    QdqGraph,
    calibrate,
    convert,
    count_qdq,
    insert_observers,
    plan_qdq,
)
from fxport.workers.engine.quantize.layers import Layer, scan_layers
from fxport.workers.engine.quantize.scheme import TENSORRT, ActivationRange, Int8Scheme

WORST_COUNT = 5
ProgressFn = Callable[[float, str], None]


@dataclass
class Int8Result:
    qdq: QdqGraph
    layers: list[Layer]
    report: dict[str, Any]  # the manifest's "quantization" section (without calibration info)
    base: GraphModule  # the float graph it came from
    qparams: dict[str, tuple[float, int]]  # activation (scale, zero point), by float-graph node name

    @property
    def graph_module(self) -> GraphModule:
        return self.qdq.gm

    @property
    def scheme(self) -> Int8Scheme:
        return self.qdq.scheme

    def convert_with(self, quantized: set[str]) -> QdqGraph:
        """The same calibration, another set of int8 layers (e.g. no fallback, for a latency comparison)."""
        return convert(self.base, self.layers, quantized, self.qparams,
                       _valid(plan_qdq(self.base, self.layers, quantized), self.qparams), self.scheme)


@dataclass
class Calibrated:
    """What calibration found, before any scheme: the layers to quantize and every tensor's range."""

    layers: list[Layer]
    skipped: list[dict[str, str]]
    ranges: dict[str, ActivationRange]  # by float-graph node name
    calibrate_s: float

    def qparams(self, scheme: Int8Scheme) -> dict[str, tuple[float, int]]:
        return {name: scheme.qparams(r) for name, r in self.ranges.items()}


def calibrate_int8(gm: GraphModule, calibration: list[tuple[Any, ...]], qspec: QuantizationSpec, *,
                   on_progress: ProgressFn | None = None) -> Calibrated:
    """Observe every tensor a Q/DQ pair may go on. Raises ConversionFailed when nothing can be quantized."""
    progress = on_progress or (lambda _f, _m: None)
    observer = qspec.calibration.observer
    scan = scan_layers(gm)
    if not scan.layers:
        raise ConversionFailed(
            "int8: the graph has no Conv or Linear layer with a constant weight to quantize"
            + (f" ({'; '.join(s['node'] + ': ' + s['reason'] for s in scan.skipped)})" if scan.skipped else ""),
            stage="quantize", hint="use precision fp16 or fp32 for this model",
        )
    layers = list(scan.layers)
    skipped = list(scan.skipped)

    t0 = time.perf_counter()
    plan_all = plan_qdq(gm, layers, {layer.name for layer in layers})
    obs_gm, observers = insert_observers(gm, plan_all, observer)
    progress(0.05, f"calibrating {len(plan_all)} tensors with the {observer} observer")
    calibrate(obs_gm, calibration, on_batch=lambda i, n: progress(0.05 + 0.9 * i / n, f"calibration batch {i}/{n}"))
    ranges: dict[str, ActivationRange] = {}
    not_float: set[str] = set()
    for name, obs in observers.items():
        if obs.float_tensor and obs.batches:
            ranges[name] = obs.range()
        else:
            not_float.add(name)
    del obs_gm, observers
    if not_float:
        nodes = {n.name: n for n in gm.graph.nodes}
        keep = []
        for layer in layers:
            x = layer.activation(nodes[layer.node])
            if layer.node in not_float or x.name in not_float:
                skipped.append({"node": layer.name, "reason": "its input or output is not a float tensor"})
            else:
                keep.append(layer)
        layers = keep
    return Calibrated(layers, skipped, ranges, time.perf_counter() - t0)


def quantize_int8(gm: GraphModule, calibration: list[tuple[Any, ...]], held_out: list[tuple[Any, ...]],
                  qspec: QuantizationSpec, *, scheme: Int8Scheme = TENSORRT, calibrated: Calibrated | None = None,
                  on_progress: ProgressFn | None = None) -> Int8Result:
    """int8 static PTQ of `gm` (not modified) in `scheme`; calibrates first unless given `calibrated`.
    Raises ConversionFailed when nothing can be quantized."""
    progress = on_progress or (lambda _f, _m: None)
    if calibrated is None:
        calibrated = calibrate_int8(gm, calibration, qspec, on_progress=lambda f, m: progress(0.4 * f, m))
    layers, skipped, calibrate_s = calibrated.layers, calibrated.skipped, calibrated.calibrate_s
    scales = calibrated.qparams(scheme)

    all_names = {layer.name for layer in layers}
    qdq = convert(gm, layers, all_names, scales, _valid(plan_qdq(gm, layers, all_names), scales), scheme)
    progress(0.45, "measuring per-layer error on held-out data")
    measured, e2e_all = per_layer(gm, qdq, layers, held_out)
    metrics: dict[str, dict[str, Any]] = measured  # a fallback layer's cumulative figures become None

    target = qspec.target_cosine
    steps: list[dict[str, Any]] = []
    fallback: list[str] = []
    e2e = e2e_all
    if target is not None and e2e_all["cosine"] < target:
        reference = float_outputs(gm, held_out)
        ranked = sorted((layer for layer in layers if layer.name in metrics),
                        key=lambda lyr: metrics[lyr.name]["sqnr_db"])
        for i, layer in enumerate(ranked):
            fallback.append(layer.name)
            keep = all_names - set(fallback)
            progress(0.5 + 0.4 * (i + 1) / len(ranked), f"fallback: {layer.name} kept in fp32")
            candidate = convert(gm, layers, keep, scales, _valid(plan_qdq(gm, layers, keep), scales), scheme)
            result = end_to_end(candidate.gm, held_out, reference)
            steps.append({"layer": layer.name, "sqnr_db": metrics[layer.name]["sqnr_db"],
                          "cosine_after": result["cosine"], "top1_after": result["top1_agreement"]})
            qdq, e2e = candidate, result
            if result["cosine"] >= target:
                break
        if fallback:
            metrics_final, e2e = per_layer(gm, qdq, layers, held_out)
            for name, m in metrics_final.items():  # cumulative figures change with the fallback
                metrics[name].update(cumulative_sqnr_db=m["cumulative_sqnr_db"],
                                     cumulative_cosine=m["cumulative_cosine"])
            for name in fallback:
                metrics[name].update(cumulative_sqnr_db=None, cumulative_cosine=None)

    report = _report(layers, skipped, metrics, qdq, qspec, e2e, e2e_all, fallback, steps, calibrate_s)
    norms = [n.name for n in gm.graph.nodes if _is_batch_norm(gm, n)]
    if norms:
        report["notes"] = [f"{len(norms)} BatchNorm op(s) left in the graph run in float between Q/DQ pairs "
                           "(and cost int8 fusions); add fuse_conv_bn to spec.passes to fold them into the convs"]
    int8_result = Int8Result(qdq=qdq, layers=layers, report=report, base=gm, qparams=scales)
    progress(1.0, "done")
    return int8_result


def _is_batch_norm(gm: GraphModule, node: Node) -> bool:
    if node.op == "call_module":
        return isinstance(gm.get_submodule(str(node.target)), torch.nn.modules.batchnorm._BatchNorm)
    return node.op == "call_function" and "batch_norm" in str(node.target)


def _valid(plan: dict[str, str], scales: dict[str, Any]) -> dict[str, str]:
    return {name: src for name, src in plan.items() if src in scales}


def _report(layers: list[Layer], skipped: list[dict[str, str]], metrics: dict[str, dict[str, Any]], qdq: QdqGraph,
            qspec: QuantizationSpec, e2e: dict[str, Any], e2e_all: dict[str, Any], fallback: list[str],
            steps: list[dict[str, Any]], calibrate_s: float) -> dict[str, Any]:
    rows = []
    for layer in layers:
        m = metrics.get(layer.name)
        if m is None:
            continue
        rows.append({
            "node": layer.name, "op": layer.op, "sqnr_db": round(m["sqnr_db"], 3), "cosine": round(m["cosine"], 6),
            "cumulative_sqnr_db": None if m["cumulative_sqnr_db"] is None else round(m["cumulative_sqnr_db"], 3),
            "cumulative_cosine": None if m["cumulative_cosine"] is None else round(m["cumulative_cosine"], 6),
            "fallback": layer.name in fallback,
            "input_scale": qdq.input_scales.get(layer.name), "output_scale": qdq.output_scales.get(layer.name),
            "input_zero_point": qdq.input_zero_points.get(layer.name),
            "output_zero_point": qdq.output_zero_points.get(layer.name),
        })
    worst = [r["node"] for r in sorted(rows, key=lambda r: r["sqnr_db"])[:WORST_COUNT]]
    total_macs = sum(m["macs"] for m in metrics.values()) or 1
    fallback_macs = sum(metrics[name]["macs"] for name in fallback)
    target = qspec.target_cosine
    return {
        "precision": "int8",
        "method": qspec.method,
        "observer": qspec.calibration.observer,
        "runtime": qdq.scheme.runtime,
        "scheme": qdq.scheme.describe(),
        "layers": rows,
        "worst": worst,
        "fallback_layers": list(fallback),
        "skipped_layers": skipped,
        "target_cosine": target,
        "end_to_end": {**{k: v for k, v in e2e.items() if k != "per_output"},
                       "target_met": None if target is None else e2e["cosine"] >= target,
                       "cosine_all_int8": e2e_all["cosine"], "top1_all_int8": e2e_all["top1_agreement"],
                       "per_output": e2e["per_output"]},
        "fallback": {
            "steps": steps,
            # what the fp32 layers cost, as their share of the model's conv/linear multiply-adds;
            # the pipeline adds measured latency when it builds an ONNX model
            "fp32_macs_share": round(fallback_macs / total_macs, 4),
        },
        "qdq_nodes": count_qdq(qdq.gm),
        "calibrate_s": round(calibrate_s, 3),
    }


def layer_table(report: dict[str, Any], limit: int = 12) -> str:
    """The per-layer table as plain text, worst first (for error messages and logs)."""
    rows = sorted(report.get("layers", []), key=lambda r: r["sqnr_db"])
    lines = [f"{'layer':<32} {'SQNR dB':>8} {'cosine':>9} {'kept as':>8}"]
    for r in rows[:limit]:
        kept = "fp32" if r["fallback"] else "int8"
        lines.append(f"{r['node'][:32]:<32} {r['sqnr_db']:>8.2f} {r['cosine']:>9.5f} {kept:>8}")
    if len(rows) > limit:
        lines.append(f"... {len(rows) - limit} more layers in manifest.json 'quantization.layers'")
    return "\n".join(lines)
