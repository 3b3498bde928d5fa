"""The tensorrt stage as the pipeline runs it: preflight (CPU), then build + metadata + verification (GPU).

`preflight_stage` runs wherever the ONNX model is made (the CPU stage), and again before a
build. `build_stage` builds model.engine from the ONNX model, records the engine's metadata
in the manifest, and verifies the engine with the same comparator as every other artifact,
against `reference` (the original eager model when it is at hand, else onnxruntime on the
ONNX model the engine was built from — itself verified against the eager model in the CPU
stage), at every optimization profile's min and max shape, with tolerances per precision.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from fxport.errors import ConversionFailed, VerificationFailed
from fxport.manifest import Manifest, VerificationRecord
from fxport.manifest_sections import TensorRT
from fxport.spec import JobSpec, VerifyOptions
from fxport.workers.engine.request import TimingCachePaths
from fxport.workers.engine.tensorrt.preflight import PreflightReport, check_preflight, preflight_onnx

Emit = Callable[[str, float, str], None]

# TensorRT vs its reference when the spec leaves spec.verify at its defaults. fp32: GPU kernels
# sum in another order than the CPU reference, so 1e-4 (the CPU default) is too tight.
TRT_FP32 = {"atol": 1e-3, "rtol": 1e-3, "min_cosine": 0.9999}
TRT_FP16 = {"atol": 5e-2, "rtol": 5e-2, "min_cosine": 0.999}
TRT_INT8_MIN_COSINE, TRT_INT8_MIN_TOP1 = 0.98, 0.8


def trt_tolerances(spec: JobSpec) -> Any:
    """The tolerances a TensorRT engine of spec.precision is judged by. A spec.verify value that
    differs from its default is the user's and wins (a normalized spec no longer says which
    fields the user wrote, so "differs from the default" is the test)."""
    from fxport.workers.engine.verify.precision import Tolerances

    defaults = VerifyOptions()
    user = {k for k in ("atol", "rtol", "min_cosine") if getattr(spec.verify, k) != getattr(defaults, k)}
    if spec.precision == "int8":
        target = spec.quantization.target_cosine
        update = {} if "min_cosine" in user else {"min_cosine": target if target is not None else TRT_INT8_MIN_COSINE}
        return Tolerances("int8", spec.verify.model_copy(update=update), min_top1=TRT_INT8_MIN_TOP1,
                          judge_abs_diff=False)
    table = TRT_FP16 if spec.precision == "fp16" else TRT_FP32
    return Tolerances(spec.precision, spec.verify.model_copy(update={k: v for k, v in table.items() if k not in user}))


def preflight_stage(manifest: Manifest, onnx_path: Path, precision: str) -> PreflightReport:
    """Check the ONNX model against TensorRT's parser; findings into manifest.tensorrt["preflight"].
    Raises ConversionFailed naming the nodes when TensorRT would reject the model."""
    report = preflight_onnx(onnx_path, precision=precision)
    manifest.tensorrt = TensorRT.model_validate({**(manifest.tensorrt or {}), "preflight": report.as_dict()})
    manifest.warnings.extend(f"tensorrt preflight: {f.describe()}" for f in report.warnings)
    check_preflight(report)
    return report


def build_stage(manifest: Manifest, emit: Emit, *, onnx_path: Path, sig: Any, spec: JobSpec, path: Path,
                reference: Any, reference_label: str, points: list[Any],
                timing_cache: TimingCachePaths | None = None) -> Path:
    """Preflight, build the engine at `path` (the registry's model.engine), record its metadata, verify it.

    `timing_cache`: the file to read and the file to write the merged cache to, used when
    spec.tensorrt.timing_cache is "shared"."""
    import onnx

    from fxport.workers.engine.tensorrt.builder import (
        EngineBytesFromNetwork,
        EngineFromBytes,
        NetworkFromOnnxPath,
        SaveEngine,
        engine_metadata,
        import_tensorrt,
        onnx_precision_traits,
        plan_precision,
        tensorrt_unavailable,
    )
    from fxport.workers.engine.tensorrt.profiles import build_profiles
    from fxport.workers.engine.tensorrt.runner import TrtRunner
    from fxport.workers.engine.verify.comparator import verify_artifacts
    from fxport.workers.engine.verify.precision import PrecisionComparison

    emit("tensorrt", 0.0, "preflight")
    preflight_stage(manifest, onnx_path, spec.precision)
    why = tensorrt_unavailable()
    if why is not None:
        raise ConversionFailed(f"cannot build a TensorRT engine here: {why}", stage="tensorrt",
                               hint="the tensorrt target needs CUDA and TensorRT: "
                                    "submit the job to a server with a GPU worker (queue gpu)")
    trt = import_tensorrt()
    model = onnx.load(str(onnx_path), load_external_data=False)
    has_fp16, has_qdq = onnx_precision_traits(model)
    plan = plan_precision(spec.precision, onnx_has_fp16=has_fp16, onnx_has_qdq=has_qdq,
                          builder_flags={n for n in dir(trt.BuilderFlag) if n.isupper()},
                          tensorrt_version=str(trt.__version__))
    profiles = build_profiles(sig.inputs, sig.dynamic_dims)
    cache = timing_cache if spec.tensorrt.timing_cache == "shared" else None
    emit("tensorrt", 0.1, f"building the {spec.precision} engine")
    engine_bytes = EngineBytesFromNetwork(
        NetworkFromOnnxPath(onnx_path, strongly_typed=plan.strongly_typed), plan=plan,
        workspace_mb=spec.tensorrt.workspace_mb, profiles=profiles,
        timing_cache=cache.read if cache else None, timing_cache_out=cache.write if cache else None,
    )
    engine_path = SaveEngine(engine_bytes, path)()
    report = engine_bytes.report
    manifest.warnings.extend(f"tensorrt: {w}" for w in report.warnings)
    loader = EngineFromBytes(engine_path.read_bytes())  # holds the runtime, which must outlive the engine
    engine = loader()
    manifest.tensorrt = TensorRT.model_validate({
        **(manifest.tensorrt or {}),
        "engine": engine_metadata(trt, engine, report=report, profiles=profiles, precision=spec.precision),
        "build": {"build_s": report.build_s,
                  "timing_cache": {**report.timing_cache, "mode": spec.tensorrt.timing_cache}},
    })
    del engine, loader

    emit("tensorrt", 0.7, "verifying the engine")
    tol = trt_tolerances(spec)
    comparison = PrecisionComparison(tol)
    runner = TrtRunner(engine_path, [i.name for i in sig.inputs], [o.name for o in model.graph.output])
    record = verify_artifacts(reference, [runner], points, tol.options, compare=comparison,
                              finish=comparison.finish)[0]
    record.update(precision=spec.precision, reference=reference_label,
                  profile_extremes=[{n: list(s) for n, s in p.point(w).items()}
                                    for p in profiles for w in ("min", "max")])
    manifest.verification.append(VerificationRecord.model_validate(record))
    emit("tensorrt", 1.0, "done")
    if not record["passed"]:
        what = record.get("error") or f"max_abs_diff={record['max_abs_diff']:.3g} cosine={record['cosine']:.6f}"
        if spec.verify.fail_on_mismatch:
            raise VerificationFailed(
                f"the {spec.precision} TensorRT engine does not match {reference_label} ({tol.describe()}): {what}",
                stage="tensorrt", hint="inspect manifest.json 'verification' and 'tensorrt'; "
                                       "loosen spec.verify only if the difference is expected")
        manifest.warnings.append(f"tensorrt verification mismatch allowed by spec.verify.fail_on_mismatch=false: "
                                    f"{what}")
    return engine_path
