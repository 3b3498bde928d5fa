"""The quantize stage: the fp16 or int8 graph every artifact of a reduced-precision job comes from,
and what the rest of the pipeline asks of it — which graph and int8 scheme each target gets, the
int8 ONNX models' inspection, how int8 artifacts are run to verify them, and the error when they
miss their target.

(The tolerances reduced-precision artifacts are judged by live in verify/precision.py; the
quantization itself in quantize/.)
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fxport.errors import VerificationFailed
from fxport.manifest_sections import Quantization
from fxport.spec import JobSpec
from fxport.workers.engine.exporters.registry import REGISTRY, TENSORRT_ONNX
from fxport.workers.engine.inputs import InputSignature
from fxport.workers.engine.run import Run


@dataclass
class Reduced:
    """The quantize stage's output: the graph every artifact comes from, and what made it.

    int8 makes one Q/DQ graph per runtime the artifacts are for (spec.int8_runtimes()): the
    first feeds every CPU artifact, the tensorrt one (when it is not the first) only the ONNX
    the engine is built from, model.tensorrt.onnx."""

    graph_module: Any
    int8: Any = None  # quantize.ptq.Int8Result of the first runtime
    calibration: Any = None  # calibration.CalibrationData
    by_runtime: dict[str, Any] = field(default_factory=dict)  # runtime → Int8Result

    @property
    def separate_tensorrt_onnx(self) -> bool:
        return self.int8 is not None and "tensorrt" in self.by_runtime and self.int8.scheme.runtime != "tensorrt"

    def runtime_for(self, target: str) -> str:
        """The int8 scheme (its runtime) of an int8 job's artifact: a later-stage target's own (the
        engine's), and its ONNX model's; the first runtime's for every other."""
        later = REGISTRY[target].later if target in REGISTRY else None
        if later is not None:
            return later.int8_runtime
        return "tensorrt" if target == TENSORRT_ONNX else str(self.int8.scheme.runtime)

    def scheme_of(self, target: str) -> str | None:
        return self.runtime_for(target) if self.int8 is not None else None

    def graph_for(self, target: str) -> Any:
        return self.by_runtime["tensorrt"].graph_module if target == TENSORRT_ONNX else self.graph_module


def reduce_precision(run: Run, gm: Any, sig: InputSignature, spec: JobSpec, example: tuple[Any, ...],
                     calibration_path: Path | None) -> Reduced:
    """fp16: the half graph. int8: calibrate (file or random), Q/DQ graph, per-layer report, fallback."""
    if spec.precision == "fp16":
        if calibration_path is not None:
            run.warn("calibration data was given but precision is fp16: it was not used")
        return _to_half(run, gm, example)
    return _to_int8(run, gm, sig, spec, calibration_path)


def _to_half(run: Run, gm: Any, example: tuple[Any, ...]) -> Reduced:
    from fxport.workers.engine.quantize.fp16 import to_half

    half = to_half(gm, example)
    run.manifest.quantization = Quantization.model_validate({
        "precision": "fp16", "method": "cast", "kept_fp32": half.kept_fp32, "casts": half.casts,
        "interface": "inputs and outputs stay float32; the graph computes in float16 inside",
        "layers": [],
    })
    return Reduced(half.graph_module)


def _to_int8(run: Run, gm: Any, sig: InputSignature, spec: JobSpec, calibration_path: Path | None) -> Reduced:
    """One Q/DQ graph per int8 runtime the artifacts are for, from one calibration."""
    from fxport.benchmark import machine_info
    from fxport.workers.engine.calibration import load_calibration
    from fxport.workers.engine.quantize.observers import exact_int8_dot_products
    from fxport.workers.engine.quantize.ptq import calibrate_int8, quantize_int8
    from fxport.workers.engine.quantize.scheme import scheme_for

    manifest = run.manifest
    run.emit("quantize", 0.0, "loading calibration data" if calibration_path else "drawing random calibration samples")
    data = load_calibration(calibration_path, sig, spec.quantization.calibration, spec.verify.seed)
    manifest.warnings.extend(data.warnings)
    exact = exact_int8_dot_products()
    # 8-bit weights by default, on every CPU: with uint8 activations (mostly small after a ReLU) too few
    # u8×s8 pairs saturate on CPUs without VNNI to be worth the precision 7-bit weights lose everywhere
    reduce_range = bool(spec.quantization.reduce_range)
    runtimes = spec.int8_runtimes(also_targets=run.request.deferred_targets)
    share = 1.0 / (len(runtimes) + 1)  # calibration, then each scheme's conversion, report and fallback
    calibrated = calibrate_int8(gm, data.calibration, spec.quantization,
                                on_progress=lambda frac, msg: run.emit("quantize", share * frac, msg))
    by_runtime: dict[str, Any] = {}
    for k, runtime in enumerate(runtimes):
        scheme = scheme_for(runtime, reduce_range=reduce_range)  # type: ignore[arg-type]

        def on_progress(frac: float, msg: str, k: int = k, rt: str = runtime) -> None:
            run.emit("quantize", share * (k + 1 + frac), f"{rt}: {msg}")

        by_runtime[runtime] = quantize_int8(
            gm, data.calibration, data.held_out, spec.quantization, scheme=scheme, calibrated=calibrated,
            on_progress=on_progress)
    result = by_runtime[runtimes[0]]
    machine = machine_info()
    manifest.quantization = Quantization.model_validate({
        **result.report, "calibration": data.info,
        # where each scheme's onnxruntime/fbgemm results were measured: int8 accuracy on a CPU depends on it
        "verified_on": {"cpu": machine["cpu"], "arch": machine["arch"], "isa": machine["isa"],
                        "exact_int8_dot_products": exact},
        "schemes": {rt: r.report for rt, r in by_runtime.items()},
    })
    _warn_int8_reports(run, spec, by_runtime, runtimes[0])
    return Reduced(result.graph_module, int8=result, calibration=data, by_runtime=by_runtime)


def _warn_int8_reports(run: Run, spec: JobSpec, by_runtime: dict[str, Any], first: str) -> None:
    """The first scheme's notes, and each scheme's fallback layers and missed target, as warnings."""
    for runtime, r in by_runtime.items():
        label = f"int8 ({runtime} scheme)" if len(by_runtime) > 1 else "int8"
        run.manifest.warnings.extend(f"{label}: {note}" for note in r.report.get("notes", []) if runtime == first)
        if r.report["fallback_layers"]:
            run.warn(
                f"{label}: {len(r.report['fallback_layers'])} layer(s) kept in fp32 to reach "
                f"quantization.target_cosine={spec.quantization.target_cosine}: "
                f"{', '.join(r.report['fallback_layers'])}")
        if r.report["end_to_end"]["target_met"] is False:
            run.warn(
                f"{label}: end-to-end cosine {r.report['end_to_end']['cosine']:.5f} misses quantization.target_cosine="
                f"{spec.quantization.target_cosine} with {len(r.report['fallback_layers'])} of "
                f"{len(r.report['layers'])} layers kept in fp32")


def int8_runners(run: Run, reduced: Reduced, runners: list[Any]) -> list[Any]:
    """Each int8 artifact is verified for the runtime its scheme is for. The CPU artifacts run on this CPU's
    int8 kernels. The ONNX made for TensorRT cannot run in TensorRT here: onnxruntime runs its Q/DQ as
    written (float kernels), which checks the numbers TensorRT is to compute, and the engine is verified
    where it is built."""
    kept = []
    for runner in runners:
        if runner.name in ("onnx", TENSORRT_ONNX) and reduced.runtime_for(runner.name) == "tensorrt":
            name, runner = runner.name, type(runner)(runner.path, runner.input_names, int8_kernels=False)
            runner.name = name
            quantization_section(run)["schemes"]["tensorrt"]["verified_in"] = (
                f"{runner.runtime} here; the engine against the original model where it is built")
        kept.append(runner)
    return kept


def check_int8_onnx(run: Run, reduced: Reduced, target: str, onnx_path: Path, example: tuple[Any, ...],
                    sig: InputSignature, spec: JobSpec) -> None:
    """Record which int8 kernels onnxruntime runs, TensorRT's Q/DQ rules, and the fallback's latency cost."""
    try:
        _inspect_int8_onnx(run, reduced, target, onnx_path, example, sig, spec)
    except Exception as exc:  # a report that could not be made never fails the conversion
        run.warn(f"int8: {onnx_path.name} could not be inspected: {type(exc).__name__}: {exc}")


def _inspect_int8_onnx(run: Run, reduced: Reduced, target: str, onnx_path: Path, example: tuple[Any, ...],
                       sig: InputSignature, spec: JobSpec) -> None:
    from fxport.workers.engine.verify import onnx_quantization as oq

    result = reduced.by_runtime[reduced.runtime_for(target)]
    primary = result is reduced.int8
    # the first scheme's report is the quantization section itself; another's sits in its "schemes" entry
    quant = quantization_section(run) if primary else quantization_section(run)["schemes"][result.scheme.runtime]
    kernels = oq.onnxruntime_kernels(onnx_path)
    quant["onnx"] = {"onnxruntime": kernels}
    if result.scheme.runtime == "tensorrt":  # the onnxruntime scheme's uint8 zero points are not for TensorRT
        quant["onnx"]["tensorrt_explicit_quantization"] = oq.explicit_quantization_issues(onnx_path)
    if primary:
        quantization_section(run)["schemes"][result.scheme.runtime]["onnx"] = quant["onnx"]
    if not kernels["int8_kernels"] and result.scheme.runtime == "onnxruntime":
        run.warn(
            "int8: onnxruntime fused no Q/DQ into int8 kernels; the ONNX model runs in float")
    fallback = quant["fallback_layers"]
    if not fallback or result.scheme.runtime != "onnxruntime":
        return
    from fxport.workers.engine.exporters.onnx import OnnxFromGraphModule

    feed_args = reduced.calibration.held_out[0]
    feed = {i.name: a.numpy() for i, a in zip(sig.inputs, feed_args)}
    with tempfile.TemporaryDirectory(prefix="fxport-int8-") as tmp:
        all_int8 = result.convert_with({layer.name for layer in result.layers})
        other = OnnxFromGraphModule(all_int8.gm, example, input_names=[i.name for i in sig.inputs],
                                    dynamic_shapes=sig.dynamic_shapes(), opset=spec.onnx.opset)(
                                        Path(tmp) / "all_int8.onnx")
        with_fallback = oq.onnxruntime_latency_ms(onnx_path, feed)
        without = oq.onnxruntime_latency_ms(other, feed)
    quant["fallback"]["latency"] = {
        "runtime": "onnxruntime (CPU)", "batch": [list(a.shape) for a in feed_args][0],
        "ms_all_int8": round(without, 3), "ms_with_fallback": round(with_fallback, 3),
        "cost_ms": round(with_fallback - without, 3), "ratio": round(with_fallback / without, 3) if without else None,
    }


def reduced_precision_failure(run: Run, spec: JobSpec, tol: Any, reduced: Reduced,
                              failed: list[dict[str, Any]], table: str) -> VerificationFailed:
    """The error for fp16/int8 artifacts that miss their target, with the per-layer report for int8."""
    detail = None
    message = f"{len(failed)} {spec.precision} artifact(s) miss their target ({tol.describe()}): {table}"
    hint = "see manifest.json 'quantization'"
    if reduced.int8 is not None:
        from fxport.workers.engine.quantize.ptq import layer_table

        # the per-layer report of the scheme the first failed artifact was made in
        runtime = reduced.runtime_for(failed[0]["format"])
        quantization = quantization_section(run)
        report = quantization["schemes"].get(runtime, quantization)
        detail = layer_table(report, limit=1000)
        message += (f"\nper-layer error of the {runtime} scheme (worst first, held-out data):\n"
                    + layer_table(report))
        hint = ("set quantization.target_cosine to keep the most damaged layers in fp32, give "
                "representative calibration data, or try another calibration observer")
        from fxport.workers.engine.quantize.observers import exact_int8_dot_products

        if not exact_int8_dot_products() and runtime == "tensorrt":
            hint += ("; note that this worker's CPU has no VNNI: its int8 kernels (fbgemm) sum u8×s8 "
                     "pairs into saturating int16, which the symmetric TensorRT scheme suffers from "
                     "— leave quantization.runtime out (or set onnxruntime) for CPU artifacts")
        elif not exact_int8_dot_products() and not reduced.int8.scheme.reduce_range:
            hint += ("; note that this worker's CPU has no VNNI: its int8 kernels sum u8×s8 pairs "
                     "into saturating int16 — quantization.reduce_range: true (7-bit weights) rules "
                     "that out")
    return VerificationFailed(message, stage="verify", hint=hint, detail=detail)


def quantization_section(run: Run) -> Quantization:
    """The manifest's quantization section, which the quantize stage wrote before anything reads it."""
    assert run.manifest.quantization is not None
    return run.manifest.quantization

