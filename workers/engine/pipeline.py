"""The conversion engine end to end: load → capture → passes → quantize → export → verify → manifest.

`convert` is the one entry point. Workers call it inside the sandbox; `fxport convert` calls
it in-process. It always leaves manifest.json in `out_dir`, also when a stage fails.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import fxport
from fxport.digest import sha256_file
from fxport.errors import (
    CaptureFailed,
    ConversionFailed,
    FxportError,
    InvalidInput,
    ResourceLimitExceeded,
    VerificationFailed,
)
from fxport.manifest import (
    SCHEMA_VERSION,
    ArtifactRecord,
    CaptureRecord,
    ErrorRecord,
    FailedTarget,
    InputRecord,
    Manifest,
    PassRecord,
    VerificationRecord,
)
from fxport.serving.signature import model_signature
from fxport.spec import JobSpec
from fxport.toolchain import manifest_toolchain
from fxport.workers.engine.capture import (
    Captured,
    capture_ladder,
    eager_capture_record,
    eager_fallback_blocker,
    short_capture_reason,
)
from fxport.workers.engine.exporters.registry import REGISTRY, TENSORRT_ONNX, ExportJob, Writer
from fxport.workers.engine.inputs import InputSignature, resolve_signature
from fxport.workers.engine.load import LoadedModel, load_model
from fxport.workers.engine.passes import PassContext, run_passes
from fxport.workers.engine.request import DeferredTarget, EngineRequest, TimingCachePaths
from fxport.workers.engine.verify.comparator import SamplePoint, inconclusive_warnings, verify_artifacts
from fxport.workers.engine.verify.runners import ReferenceOutputs

ProgressFn = Callable[[dict[str, Any]], None]

WRITING_DIR = ".writing"  # where an exporter writes; never an artifact name (those never start with '.')


class _Run:
    """Per-conversion bookkeeping: the request, the manifest being built, stage timings, progress events."""

    def __init__(self, request: EngineRequest, manifest: Manifest, on_progress: ProgressFn | None) -> None:
        self.request, self.manifest, self.on_progress = request, manifest, on_progress

    @property
    def spec(self) -> JobSpec:
        return self.request.spec

    @property
    def out_dir(self) -> Path:
        return self.request.out_dir

    def warn(self, message: str) -> None:
        self.manifest.warnings.append(message)

    def emit(self, stage: str, progress: float, message: str = "") -> None:
        if self.on_progress:
            self.on_progress({"stage": stage, "progress": round(progress, 3), "message": message})

    @contextmanager
    def stage(self, name: str, message: str = "") -> Iterator[None]:
        self.emit(name, 0.0, message)
        start = time.perf_counter()
        try:
            yield
        except FxportError as exc:
            exc.stage = exc.stage or name
            raise
        except MemoryError as exc:
            raise ResourceLimitExceeded(f"the model ran out of its memory limit during {name}", stage=name) from exc
        except Exception as exc:
            raise ConversionFailed(f"{name} failed: {type(exc).__name__}: {exc}", stage=name) from exc
        finally:
            self.manifest.timings_s[name] = round(time.perf_counter() - start, 4)
        self.emit(name, 1.0, "done")


def convert(
    model_path: Path,
    spec: JobSpec,
    out_dir: Path,
    *,
    job_id: str | None = None,
    calibration_path: Path | None = None,
    on_progress: ProgressFn | None = None,
    deferred_targets: Sequence[DeferredTarget] = (),
    timing_cache_path: Path | None = None,
    timing_cache_out: Path | None = None,
    input_sha256: str | None = None,
    report: bool = True,
) -> dict[str, Any]:
    """`convert_request` for a request spelled out in keywords (scripts, tests, benchmarks).

    `timing_cache_path`: a TensorRT timing cache file a build reads; the merged cache is written to
    `timing_cache_out` (default: the same file). See request.EngineRequest for the rest."""
    cache = (TimingCachePaths(read=timing_cache_path, write=timing_cache_out or timing_cache_path)
             if timing_cache_path is not None else None)
    request = EngineRequest(model_path=model_path, spec=spec, out_dir=out_dir, job_id=job_id,
                            calibration_path=calibration_path, deferred_targets=tuple(deferred_targets),
                            timing_cache=cache, input_sha256=input_sha256)
    return convert_request(request, on_progress=on_progress, report=report)


def convert_request(request: EngineRequest, *, on_progress: ProgressFn | None = None,
                    report: bool = True) -> dict[str, Any]:
    """Convert per `request` into `request.out_dir`. Returns the manifest (as JSON data).

    `report`: also write report.html (the sandbox leaves it to its parent, which may run `dot`).
    Raises an FxportError subclass naming the stage; manifest.json is written either way.
    """
    out_dir, model_path = request.out_dir, request.model_path
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest = Manifest(
        schema_version=SCHEMA_VERSION,
        fxport_version=fxport.__version__,
        job_id=request.job_id,
        toolchain=manifest_toolchain(),
        input=InputRecord(format=None, sha256=request.input_sha256 or sha256_file(model_path)[0],
                          bytes=model_path.stat().st_size),
        spec=request.spec.normalized(),
        capture=None, passes=[], artifacts=[], verification=[], profile=None, warnings=[], timings_s={},
        status="running", error=None,
    )
    run = _Run(request, manifest, on_progress)
    try:
        _convert(run)
        manifest.status = "succeeded"
    except FxportError as exc:
        manifest.status, manifest.error = "failed", ErrorRecord.model_validate(exc.to_dict())
        raise
    except Exception as exc:  # an engine bug: still a clean, named failure
        err = ConversionFailed(f"internal error: {type(exc).__name__}: {exc}", stage="export")
        err.__cause__ = exc  # as `raise err from exc` below sets it: the record keeps the chain
        manifest.status, manifest.error = "failed", ErrorRecord.model_validate(err.to_dict())
        raise err from exc
    finally:
        if manifest.signature is None:
            manifest.signature = model_signature(manifest.inputs, manifest.outputs)
        manifest.write(out_dir / "manifest.json")
        if report:
            _write_report(out_dir / "manifest.json", manifest)
    return manifest.to_dict()


def _write_report(manifest_path: Path, manifest: Manifest) -> None:
    """report.html beside the manifest. A report problem never fails the conversion."""
    from fxport.report import write_report

    try:
        write_report(manifest_path)
    except Exception as exc:
        manifest.warn(f"report.html could not be written: {type(exc).__name__}: {exc}")
        manifest.write(manifest_path)


def _convert(run: _Run) -> None:
    manifest, request, spec, out_dir = run.manifest, run.request, run.spec, run.out_dir
    calibration_path = request.calibration_path
    torch.manual_seed(spec.verify.seed)
    with run.stage("load"):
        loaded = load_model(request.model_path)
        manifest.input.format = loaded.format
        _check_targets(loaded, request)
        sig = resolve_signature(spec, loaded) if loaded.format != "onnx" else None
        if sig is not None:
            manifest.inputs = {
                "inputs": [i.model_dump() for i in sig.inputs],
                "dynamic_dims": {k: v.model_dump() for k, v in sig.dynamic_dims.items()},
            }
            manifest.warnings.extend(sig.notes)
    if loaded.format == "onnx":
        if spec.package:
            raise InvalidInput(f"package {spec.package[0]} needs the PyTorch model: a package serves artifacts "
                               "verified against it and samples of its outputs, and an ONNX upload is copied as it "
                               "is", stage="load", field="package",
                               hint="upload the .pt2 (or torch.package) to package it, or drop `package`")
        if spec.precision != "fp32" and request.needs_tensorrt_onnx:
            if "onnx" in spec.targets:
                run.warn(f"precision {spec.precision} applies to the TensorRT engine; model.onnx is "
                                            "the uploaded model as it is")
        elif spec.precision != "fp32":
            raise InvalidInput(
                f"precision {spec.precision} needs the PyTorch model: an ONNX upload is copied as it is",
                stage="load", field="precision", hint="upload the .pt2 (or torch.package) to quantize it",
            )
        _convert_onnx_input(run, loaded, spec, out_dir)
        if spec.benchmark is not None and "onnx" in spec.targets:
            with run.stage("benchmark"):
                _benchmark_onnx_input(run, loaded, spec, out_dir)
        if request.builds_tensorrt:
            with run.stage("tensorrt"):
                _build_tensorrt_from_onnx_input(run, loaded, spec, out_dir)
        return
    assert sig is not None

    with run.stage("capture"):
        captured, capture_failure = _capture(run, loaded, sig, spec)
    example = sig.make_inputs(sig.export_point(), seed=spec.verify.seed)
    # Built once: the inputs every artifact is verified at, and the original model's outputs there,
    # which the exporters' own checks (a trace run at other shapes) share with verification.
    checks = _Checks(sig, spec, ReferenceOutputs(loaded.module))
    reduced: _Reduced | None = None
    trt_onnx: Path | None = None
    if captured is None:
        assert capture_failure is not None
        written = _build_from_eager(run, loaded, sig, spec, out_dir, example, capture_failure, checks)
        if calibration_path is not None:  # the eager path is fp32 only
            run.warn("calibration data was given but precision is fp32: it was not used")
    else:
        written, reduced, trt_onnx = _build_from_graph(run, captured, loaded, sig, spec, out_dir, example,
                                                       calibration_path, checks)

    with run.stage("verify"):
        runners, records = _verify_stage(run, sig, spec, written, reduced, checks)

    if spec.benchmark is not None:
        with run.stage("benchmark"):
            from fxport.benchmark import verified_formats
            from fxport.workers.engine.benchmark import measure
            from fxport.workers.engine.verify.runners import EagerRunner

            # the ONNX made for TensorRT is timed as the engine, on the GPU, not in onnxruntime here
            cpu_runners = [r for r in runners if r.name != TENSORRT_ONNX]
            manifest.benchmark = measure([EagerRunner(loaded.module), *cpu_runners], sig, spec.benchmark,
                                            verified=verified_formats(records), seed=spec.verify.seed,
                                            emit=run.emit)

    if request.builds_tensorrt and trt_onnx is not None:
        with run.stage("tensorrt"):
            from fxport.workers.engine.tensorrt.stage import build_stage

            trt_points = (_held_out_points(sig, spec, reduced) if reduced is not None and reduced.int8
                          else checks.points)
            engine = build_stage(manifest, run.emit, onnx_path=trt_onnx, sig=sig, spec=spec, out_dir=out_dir,
                                 reference=checks.reference, reference_label="the original model (eager)",
                                 points=trt_points, timing_cache=request.timing_cache)
            trt_scheme = reduced.scheme_of("tensorrt") if reduced else None
            manifest.artifacts.extend(_artifact_records("tensorrt", engine, out_dir, int8_scheme=trt_scheme))
            _benchmark_engine(run, engine, sig, spec)

    if "triton" in spec.package:
        with run.stage("package", "triton"):
            _package_triton(run, checks)


def _package_triton(run: _Run, checks: _Checks) -> None:
    """samples.npz (the first input verification checked every artifact with, and the original
    model's outputs for it), then the Triton repository under triton/ from the verified artifacts
    (fxport/serving/triton.py), every file of it an artifact of the job."""
    import numpy as np

    from fxport.serving.triton import MODEL_NAME_RE, SAMPLES, write_samples, write_triton_repository

    manifest, out_dir = run.manifest, run.out_dir
    manifest.signature = model_signature(manifest.inputs, manifest.outputs)
    assert manifest.signature is not None  # a model with no input signature never gets here
    point = checks.points[0]
    arrays = {f"inputs/{t.name}": np.asarray(a) for t, a in zip(manifest.signature.inputs, point.args)}
    arrays.update({f"outputs/{t.name}": np.asarray(a)
                   for t, a in zip(manifest.signature.outputs, checks.reference.infer(point.args))})
    write_samples(out_dir / SAMPLES, arrays)
    manifest.artifacts.extend(_records_of([("samples", out_dir / SAMPLES, None)], out_dir))
    # The repository's model names: the job's label `model` where it makes a Triton name, else "model".
    name = manifest.spec.get("labels", {}).get("model") or "model"
    shutil.rmtree(out_dir / "triton", ignore_errors=True)  # an earlier convert's, in the same --out
    package = write_triton_repository(out_dir, name if MODEL_NAME_RE.match(name) else "model", out_dir / "triton",
                                      manifest=manifest)
    files = sorted(p for p in (out_dir / "triton").rglob("*") if p.is_file())
    manifest.artifacts.extend(_records_of([("triton", f, None) for f in files], out_dir))
    manifest.package = {"triton": package.to_dict()}
    for note in package.notes:
        run.warn(f"triton package: {note}")


def _capture(run: _Run, loaded: LoadedModel, sig: InputSignature, spec: JobSpec
             ) -> tuple[Captured | None, CaptureFailed | None]:
    """The capture ladder. When it fails on an eager model that can be built without a graph, returns
    (None, the failure): the artifacts then come from the eager model (`_build_from_eager`)."""
    try:
        captured = capture_ladder(loaded, sig, spec.capture)
    except CaptureFailed as exc:
        blocker = eager_fallback_blocker(loaded, spec.capture, spec.precision, spec.targets)
        if blocker is None:
            run.manifest.capture = CaptureRecord.model_validate(eager_capture_record(exc))
            return None, exc
        if loaded.format != "torch_export" and isinstance(loaded.module, torch.nn.Module):
            exc.hint = f"{exc.hint}; {blocker}" if exc.hint else blocker
        raise
    run.manifest.capture = CaptureRecord(method=captured.method, level=captured.level, attempts=captured.attempts)
    return captured, None


def _build_from_graph(run: _Run, captured: Captured, loaded: LoadedModel, sig: InputSignature, spec: JobSpec,
                      out_dir: Path, example: tuple[Any, ...], calibration_path: Path | None, checks: _Checks
                      ) -> tuple[dict[str, Path], _Reduced | None, Path | None]:
    """passes → quantize → export, from the captured graph. Returns the artifacts written, the reduced-
    precision graphs (None for fp32) and the ONNX model a TensorRT engine would be built from."""
    manifest = run.manifest
    gm = captured.graph_module
    with run.stage("passes"):
        ctx = PassContext(level=captured.level, example_inputs=example)
        manifest.graph_before = _graph_summary(gm)
        gm, records = run_passes(gm, spec.passes, ctx)
        manifest.passes = [PassRecord.model_validate(r) for r in records]
        manifest.graph_after = _graph_summary(gm)
        if "profile" in ctx.report:
            manifest.profile = ctx.report["profile"]

    reduced: _Reduced | None = None
    if spec.precision != "fp32":
        with run.stage("quantize", spec.precision):
            reduced = _reduce_precision(run, gm, sig, spec, example, calibration_path)
    elif calibration_path is not None:
        run.warn("calibration data was given but precision is fp32: it was not used")

    written: dict[str, Path] = {}
    with run.stage("export"):
        targets: list[str] = [t for t in spec.targets if t in REGISTRY]
        if run.request.needs_tensorrt_onnx and "onnx" not in targets:
            targets.append("onnx")  # the TensorRT engine is built from it
        if run.request.needs_tensorrt_onnx and reduced is not None and reduced.separate_tensorrt_onnx:
            targets.append(TENSORRT_ONNX)  # int8 for TensorRT is its own ONNX (symmetric), beside model.onnx
        provenance = _provenance(manifest, spec)
        programs: dict[int, Any] = {}  # each graph's torch.export program, made once for every target
        for i, target in enumerate(targets):
            run.emit("export", i / max(len(targets), 1), target)
            job = ExportJob(graph=reduced.graph_for(target) if reduced else gm, module=loaded.module,
                            example=example, sig=sig, spec=spec, extremes=checks.trace_checks(),
                            precision=spec.precision, provenance=provenance, programs=programs,
                            reference=checks.reference.leaves)
            written[target], note, interface = _export_one(target, REGISTRY[target].from_graph, job, out_dir)
            if interface is not None:
                manifest.outputs = interface["outputs"]
            if note and reduced is None:
                run.warn(f"{target}: {note}")
            elif note:  # how a reduced-precision artifact was built (int8 kernels or fake-quant, ...)
                _quantization(run).setdefault("artifact_notes", {})[target] = note
        manifest.artifacts.extend(_records_of(
            [(target, path, reduced.scheme_of(target) if reduced else None) for target, path in written.items()],
            out_dir))
        if reduced is not None and reduced.int8 is not None:
            for target in ("onnx", TENSORRT_ONNX):
                if target in written:
                    run.emit("export", 0.95, f"checking the int8 ONNX model {written[target].name}")
                    _check_int8_onnx(run, reduced, target, written[target], example, sig, spec)
        trt_onnx = written.get(TENSORRT_ONNX, written.get("onnx"))
        if run.request.needs_tensorrt_onnx:  # fail here, in seconds, on what TensorRT's parser rejects
            from fxport.workers.engine.tensorrt.stage import preflight_stage

            run.emit("export", 0.97, "TensorRT preflight")
            assert trt_onnx is not None  # "onnx" joined the targets above
            preflight_stage(manifest, trt_onnx, spec.precision)
    return written, reduced, trt_onnx


def _build_from_eager(run: _Run, loaded: LoadedModel, sig: InputSignature, spec: JobSpec, out_dir: Path,
                      example: tuple[Any, ...], failure: CaptureFailed, checks: _Checks) -> dict[str, Path]:
    """No graph: TorchScript and ONNX from the eager model, every other target recorded as not built
    (manifest "failed_targets", with why). Raises CaptureFailed when not one artifact could be made."""
    manifest = run.manifest
    why = short_capture_reason(failure)
    run.warn(f"no graph could be captured ({why}): the artifacts are built from the eager "
                                "model, without the graph passes")
    with run.stage("passes"):
        manifest.passes = [
            PassRecord(name=p.name, applied=False, changed=False,
                       notes="not applied: no graph was captured (see capture.reason); the artifacts come from the "
                             "eager model")
            for p in spec.passes]
    written: dict[str, Path] = {}
    failed: list[FailedTarget] = []
    with run.stage("export", "from the eager model"):
        provenance = _provenance(manifest, spec)
        for i, target in enumerate(spec.targets):
            run.emit("export", i / max(len(spec.targets), 1), target)
            from_eager = REGISTRY[target].from_eager if target in REGISTRY else None
            if from_eager is None:
                failed.append(FailedTarget(target=target, stage="capture",
                                           reason=f"{target} needs a graph, and none could be captured ({why}; "
                                                  "every rung is in capture.attempts)"))
                continue
            job = ExportJob(graph=None, module=loaded.module, example=example, sig=sig, spec=spec,
                            extremes=checks.trace_checks(), precision="fp32", provenance=provenance,
                            reference=checks.reference.leaves)
            try:
                written[target], note, interface = _export_one(target, from_eager, job, out_dir)
            except FxportError as exc:
                failed.append(FailedTarget(target=target, stage="export", reason=str(exc)))
                continue
            if interface is not None:
                manifest.outputs = interface["outputs"]
            run.warn(f"{target}: {note}")
        manifest.failed_targets = failed
        if not written:
            err = CaptureFailed(
                f"{failure.message}; nothing could be built from the eager model either: "
                + "; ".join(f"{f.target}: {f.reason}" for f in failed if f.stage != "capture"),
                stage="capture", hint=failure.hint)
            err.attempts = getattr(failure, "attempts", [])  # type: ignore[attr-defined]
            raise err
        manifest.warnings.extend(f"{f.target} was not built: {f.reason}" for f in failed)
        manifest.artifacts.extend(_records_of([(built, path, None) for built, path in written.items()], out_dir))
    return written


def _verify_stage(run: _Run, sig: InputSignature, spec: JobSpec, written: dict[str, Path],
                  reduced: _Reduced | None, checks: _Checks) -> tuple[list[Any], list[dict[str, Any]]]:
    """Every artifact against the eager model. Raises VerificationFailed on a mismatch (unless the spec
    allows it); an inconclusive verdict is a warning. Returns the runners and the records."""
    from fxport.workers.engine.verify.precision import PrecisionComparison, tolerances_for

    manifest = run.manifest
    real_data = bool(reduced and reduced.calibration and reduced.calibration.info.get("source") == "file")
    tol = tolerances_for(spec, real_data=real_data)
    comparison = PrecisionComparison(tol) if reduced is not None else None
    points = _held_out_points(sig, spec, reduced) if reduced is not None and reduced.int8 else checks.points
    runners = _runners(written, sig)
    if reduced is not None and reduced.int8 is not None:
        runners = _int8_runners(run, reduced, runners)
    records = verify_artifacts(
        checks.reference, runners, points, tol.options,
        on_runner=lambda name: run.emit("verify", 0.5, name),
        compare=comparison, finish=comparison.finish if comparison else None, output_names=spec.outputs,
    )
    for record in records:
        if sig.dynamic_dims and record["format"] in written:
            record["outside_range"] = REGISTRY[record["format"]].past_range(written[record["format"]])
    manifest.verification = [VerificationRecord.model_validate(r) for r in records]
    manifest.warnings.extend(inconclusive_warnings(records))
    failed = [r for r in records if not r["passed"]]
    if not failed:
        return runners, records
    table = "; ".join(
        f"{r['format']}: " + (r.get("error") or
                              f"max_abs_diff={r['max_abs_diff']:.3g} cosine={r['cosine']:.6f}"
                              + (f" top1={r['top1_agreement']:.3f}" if "top1_agreement" in r else ""))
        for r in failed
    )
    if not spec.verify.fail_on_mismatch:
        run.warn(f"verification mismatches allowed by spec.verify.fail_on_mismatch=false: {table}")
        return runners, records
    if reduced is not None:
        raise _reduced_precision_failure(run, spec, tol, reduced, failed, table)
    hint = "inspect manifest.json 'verification'; loosen spec.verify only if the difference is expected"
    if manifest.capture is not None and manifest.capture.method == "eager":
        hint += ("; these artifacts were built from the eager model: a traced one keeps only the example's path "
                 "through Python control flow (see the warnings for how each was made)")
    raise VerificationFailed(
        f"{len(failed)} artifact(s) do not match the original model ({tol.describe()}): {table}",
        stage="verify", hint=hint)


def _reduced_precision_failure(run: _Run, spec: JobSpec, tol: Any, reduced: _Reduced,
                               failed: list[dict[str, Any]], table: str) -> VerificationFailed:
    """The error for fp16/int8 artifacts that miss their target, with the per-layer report for int8."""
    detail = None
    message = f"{len(failed)} {spec.precision} artifact(s) miss their target ({tol.describe()}): {table}"
    hint = "see manifest.json 'quantization'"
    if reduced.int8 is not None:
        from fxport.workers.engine.quantize.ptq import layer_table

        # the per-layer report of the scheme the first failed artifact was made in
        runtime = reduced.runtime_for(failed[0]["format"])
        quantization = _quantization(run)
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


@dataclass
class _Reduced:
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
        """The int8 scheme (its runtime) of an int8 job's artifact."""
        return "tensorrt" if target in (TENSORRT_ONNX, "tensorrt") else str(self.int8.scheme.runtime)

    def scheme_of(self, target: str) -> str | None:
        return self.runtime_for(target) if self.int8 is not None else None

    def graph_for(self, target: str) -> Any:
        return self.by_runtime["tensorrt"].graph_module if target == TENSORRT_ONNX else self.graph_module


def _reduce_precision(run: _Run, gm: Any, sig: InputSignature, spec: JobSpec, example: tuple[Any, ...],
                      calibration_path: Path | None) -> _Reduced:
    """fp16: the half graph. int8: calibrate (file or random), Q/DQ graph, per-layer report, fallback."""
    manifest = run.manifest
    if spec.precision == "fp16":
        from fxport.workers.engine.quantize.fp16 import to_half

        if calibration_path is not None:
            run.warn("calibration data was given but precision is fp16: it was not used")
        half = to_half(gm, example)
        manifest.quantization = {
            "precision": "fp16", "method": "cast", "kept_fp32": half.kept_fp32, "casts": half.casts,
            "interface": "inputs and outputs stay float32; the graph computes in float16 inside",
            "layers": [],
        }
        return _Reduced(half.graph_module)

    from fxport.benchmark import machine_info
    from fxport.workers.engine.calibration import load_calibration
    from fxport.workers.engine.quantize.observers import exact_int8_dot_products
    from fxport.workers.engine.quantize.ptq import calibrate_int8, quantize_int8
    from fxport.workers.engine.quantize.scheme import scheme_for

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
    manifest.quantization = {
        **result.report, "calibration": data.info,
        # where each scheme's onnxruntime/fbgemm results were measured: int8 accuracy on a CPU depends on it
        "verified_on": {"cpu": machine["cpu"], "arch": machine["arch"], "isa": machine["isa"],
                        "exact_int8_dot_products": exact},
        "schemes": {rt: r.report for rt, r in by_runtime.items()},
    }
    for runtime, r in by_runtime.items():
        label = f"int8 ({runtime} scheme)" if len(by_runtime) > 1 else "int8"
        manifest.warnings.extend(f"{label}: {note}" for note in r.report.get("notes", []) if runtime == runtimes[0])
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
    return _Reduced(result.graph_module, int8=result, calibration=data, by_runtime=by_runtime)


def _int8_runners(run: _Run, reduced: _Reduced, runners: list[Any]) -> list[Any]:
    """Each int8 artifact is verified for the runtime its scheme is for. The CPU artifacts run on this CPU's
    int8 kernels. The ONNX made for TensorRT cannot run in TensorRT here: onnxruntime runs its Q/DQ as
    written (float kernels), which checks the numbers TensorRT is to compute, and the engine is verified
    where it is built."""
    kept = []
    for runner in runners:
        if runner.name in ("onnx", TENSORRT_ONNX) and reduced.runtime_for(runner.name) == "tensorrt":
            name, runner = runner.name, type(runner)(runner.path, runner.input_names, int8_kernels=False)
            runner.name = name
            _quantization(run)["schemes"]["tensorrt"]["verified_in"] = (
                f"{runner.runtime} here; the engine against the original model where it is built")
        kept.append(runner)
    return kept


def _check_int8_onnx(run: _Run, reduced: _Reduced, target: str, onnx_path: Path, example: tuple[Any, ...],
                     sig: InputSignature, spec: JobSpec) -> None:
    """Record which int8 kernels onnxruntime runs, TensorRT's Q/DQ rules, and the fallback's latency cost."""
    try:
        _inspect_int8_onnx(run, reduced, target, onnx_path, example, sig, spec)
    except Exception as exc:  # a report that could not be made never fails the conversion
        run.warn(f"int8: {onnx_path.name} could not be inspected: {type(exc).__name__}: {exc}")


def _inspect_int8_onnx(run: _Run, reduced: _Reduced, target: str, onnx_path: Path, example: tuple[Any, ...],
                       sig: InputSignature, spec: JobSpec) -> None:
    from fxport.workers.engine.verify import onnx_quantization as oq

    result = reduced.by_runtime[reduced.runtime_for(target)]
    primary = result is reduced.int8
    # the first scheme's report is the quantization section itself; another's sits in its "schemes" entry
    quant = _quantization(run) if primary else _quantization(run)["schemes"][result.scheme.runtime]
    kernels = oq.onnxruntime_kernels(onnx_path)
    quant["onnx"] = {"onnxruntime": kernels}
    if result.scheme.runtime == "tensorrt":  # the onnxruntime scheme's uint8 zero points are not for TensorRT
        quant["onnx"]["tensorrt_explicit_quantization"] = oq.explicit_quantization_issues(onnx_path)
    if primary:
        _quantization(run)["schemes"][result.scheme.runtime]["onnx"] = quant["onnx"]
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


def _held_out_points(sig: InputSignature, spec: JobSpec, reduced: _Reduced) -> list[SamplePoint]:
    """int8 is judged on the held-out calibration samples (never on what it was calibrated with),
    plus the spec's dynamic-shape extremes, cut from the held-out samples where only the batch varies."""
    from fxport.workers.engine.calibration import batch_dim_name

    held = reduced.calibration.held_out
    points = [SamplePoint(_dims_of(sig, args), args) for args in held]
    batch_dim = batch_dim_name(sig)
    covered = [p.dims for p in points]
    only_batch = batch_dim is not None and set(sig.dynamic_dims) == {batch_dim}
    for i, dims in enumerate(sig.shape_points()):
        if dims in covered:
            continue
        if only_batch and reduced.calibration.info.get("layout", "batch") == "batch":
            assert batch_dim is not None  # only_batch
            pool = [torch.cat([args[k] for args in held], 0) for k in range(len(sig.inputs))]
            n = dims[batch_dim]
            reps = -(-n // pool[0].shape[0])
            args = tuple(torch.cat([t] * reps, 0)[:n] for t in pool)
        else:
            args = sig.make_inputs(dims, seed=spec.verify.seed + 1000 + i)
        points.append(SamplePoint(dims, args))
    return points


def _dims_of(sig: InputSignature, args: tuple[Any, ...]) -> dict[str, int]:
    dims: dict[str, int] = {}
    for inp, a in zip(sig.inputs, args):
        for i, d in enumerate(inp.shape):
            if isinstance(d, str) and i < a.dim():
                dims.setdefault(d, int(a.shape[i]))
    return dims


def _quantization(run: _Run) -> dict[str, Any]:
    """The manifest's quantization section, which the quantize stage wrote before anything reads it."""
    assert run.manifest.quantization is not None
    return run.manifest.quantization


def _check_targets(loaded: LoadedModel, request: EngineRequest) -> None:
    spec = request.spec
    if loaded.format == "onnx":
        bad = [t for t in spec.targets if t not in ("onnx", "tensorrt")]
        if bad:
            raise InvalidInput(
                f"an ONNX model converts only to onnx and tensorrt; it cannot give {', '.join(bad)}",
                stage="load", field="targets", hint="upload the PyTorch model (.pt2) for torch targets",
            )
    if request.builds_tensorrt:
        from fxport.workers.engine.tensorrt.builder import tensorrt_unavailable

        why = tensorrt_unavailable()
        if why is not None:
            raise InvalidInput(
                f"the tensorrt target builds the engine on this machine, which cannot: {why}",
                stage="load", field="targets",
                hint="submit the job to an fxport server with a GPU worker (queue gpu), or drop tensorrt from targets",
            )


def _export_one(target: str, writer: Writer, job: ExportJob, out_dir: Path
                ) -> tuple[Path, str, dict[str, Any] | None]:
    """Write one artifact with its registry writer. Returns its path, a note for the manifest ('' when
    none) and, for ONNX, its interface (names, dtypes and shapes of inputs and outputs).

    The exporter writes into out_dir/WRITING_DIR; the finished files are then renamed into
    out_dir. So a file under its artifact name is always whole: the worker uploads files
    while the engine still exports (workers/artifact_upload.py) and never catches one half-written."""
    from fxport.workers.engine.exporters.interface import finish_onnx

    staging = out_dir / WRITING_DIR
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        written, note = _write_artifact(target, writer, job, staging / REGISTRY[target].path)
        interface = None
        if REGISTRY[target].onnx:  # names and provenance, before anyone can upload it
            interface = finish_onnx(written, input_shapes=[(i.name, i.shape) for i in job.sig.inputs],
                                    output_names=job.spec.outputs, provenance=job.provenance)
        return _publish(staging, written, out_dir), note, interface
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _provenance(manifest: Manifest, spec: JobSpec) -> dict[str, str]:
    """Where an artifact came from, written into it (ONNX metadata_props, archives' extra files).

    Only what the artifact is a function of: the same model, spec and toolchain give the same
    bytes in every job (the result cache hands them to later jobs; a redelivered job must
    reproduce them). The job that made them is in its manifest, beside each artifact's sha256."""
    return {"version": str(manifest.fxport_version), "source_sha256": str(manifest.input.sha256),
            "spec_digest": spec.artifact_digest()}


def _publish(staging: Path, written: Path, out_dir: Path) -> Path:
    """Rename everything the exporter wrote from staging into out_dir, the artifact itself last
    (after e.g. the model.onnx.data it refers to). Returns the artifact's path in out_dir."""
    for entry in sorted(staging.iterdir(), key=lambda p: p == written):
        dest = out_dir / entry.name
        if dest.is_dir() and not dest.is_symlink():
            shutil.rmtree(dest)
        entry.replace(dest)
    return out_dir / written.relative_to(staging)


def _write_artifact(target: str, writer: Writer, job: ExportJob, path: Path) -> tuple[Path, str]:
    """`writer(job, path)`, with an exporter's own failure turned into a ConversionFailed naming the target."""
    try:
        return writer(job, path)
    except FxportError:
        raise
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ConversionFailed(
            f"{target} export failed: {type(exc).__name__}: {first}", stage="export",
            hint=f"drop {target!r} from targets to get the other artifacts",
        ) from exc


def _artifact_records(target: str, path: Path, out_dir: Path, *, int8_scheme: str | None = None
                      ) -> list[ArtifactRecord]:
    return _records_of([(target, path, int8_scheme)], out_dir)


def _records_of(artifacts: Sequence[tuple[str, Path, str | None]], out_dir: Path) -> list[ArtifactRecord]:
    """The manifest's records of every file of `artifacts` ((target, path, int8 scheme or None)).
    The files are hashed side by side, up to the job's thread budget: hashlib lets go of the GIL,
    and nothing else of the job runs meanwhile. Where no thread can start, one after another."""
    files: list[tuple[str, Path, str | None]] = []
    for target, path, scheme in artifacts:
        if target in REGISTRY:
            found = REGISTRY[target].files(path)
        else:  # the TensorRT engine, written by its own stage
            found = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        files.extend((target, f, scheme) for f in found)
    digests = None
    workers = min(len(files), torch.get_num_threads())
    if workers > 1:
        try:
            with ThreadPoolExecutor(max_workers=workers) as pool:
                digests = list(pool.map(lambda item: sha256_file(item[1]), files))
        except RuntimeError:  # no thread could start (near the sandbox's address-space limit)
            pass
    if digests is None:
        digests = [sha256_file(f) for _, f, _ in files]
    return [
        ArtifactRecord(format=target, path=str(f.relative_to(out_dir)), bytes=size, sha256=digest,
                       **({"int8_scheme": scheme} if scheme else {}))  # left out, not null, when there is none
        for (target, f, scheme), (digest, size) in zip(files, digests)
    ]


class _Checks:
    """The sample inputs of one conversion, made once, and the original model's outputs there
    (`reference`, computed on first use). The verify and TensorRT stages verify at `points`;
    the exporters check a trace at `trace_checks()`, drawn from the same points."""

    def __init__(self, sig: InputSignature, spec: JobSpec, reference: ReferenceOutputs) -> None:
        self.sig, self.reference = sig, reference
        self.points = _sample_points(sig, spec)

    def trace_checks(self) -> list[tuple[Any, ...]]:
        """One input at every distinct shape among the points but the export example's: a trace
        is taken at the example's shape and is exact there; elsewhere it may have fixed a size."""
        example, seen, out = self.sig.export_point(), [], []
        for point in self.points:
            if point.dims != example and point.dims not in seen:
                seen.append(point.dims)
                out.append(point.args)
        return out


def _sample_points(sig: InputSignature, spec: JobSpec) -> list[SamplePoint]:
    """spec.verify.samples inputs at the opt shape, one at every other dynamic-shape extreme."""
    points = []
    shape_points = sig.shape_points()
    opt = {n: r.opt for n, r in sig.dynamic_dims.items()}
    for s in range(spec.verify.samples):
        points.append(SamplePoint(opt, sig.make_inputs(opt, seed=spec.verify.seed + 1 + s)))
    for i, dims in enumerate(shape_points):
        if dims != opt:
            points.append(SamplePoint(dims, sig.make_inputs(dims, seed=spec.verify.seed + 1000 + i)))
    return points


def _runners(written: dict[str, Path], sig: InputSignature) -> list[Any]:
    return [REGISTRY[target].runner(path, sig) for target, path in written.items()]


def _graph_summary(gm: Any) -> dict[str, Any]:
    """Node list of the graph (op, target, inputs) — enough to draw it later from the manifest alone."""
    nodes = []
    for n in gm.graph.nodes:
        nodes.append({
            "name": n.name, "op": n.op, "target": _target_name(n.target),
            "inputs": [a.name for a in n.all_input_nodes],
        })
    counts: dict[str, int] = {}
    for n in nodes:
        if n["op"] in ("call_module", "call_function", "call_method"):
            counts[n["target"]] = counts.get(n["target"], 0) + 1
    return {"node_count": len(nodes), "op_counts": counts, "nodes": nodes if len(nodes) <= 2000 else nodes[:2000]}


def _target_name(target: Any) -> str:
    if isinstance(target, str):
        return target
    name = getattr(target, "__name__", None) or str(target)
    module = getattr(target, "__module__", "") or ""
    if "aten" in str(target) or module.startswith("torch._ops"):
        return str(target)
    return f"{module}.{name}" if module and module != "builtins" else name


def _convert_onnx_input(run: _Run, loaded: LoadedModel, spec: JobSpec, out_dir: Path) -> None:
    """An ONNX upload: check it, copy it as the onnx artifact, and record it. No torch graph exists."""
    import onnx

    with run.stage("export", "checking the ONNX model"):
        assert loaded.onnx_path is not None
        try:
            onnx.checker.check_model(str(loaded.onnx_path), full_check=True)
        except Exception as exc:
            raise InvalidInput(f"the ONNX model fails onnx.checker: {exc}", stage="load") from exc
        if "onnx" in spec.targets:
            dest = out_dir / "model.onnx"
            shutil.copyfile(loaded.onnx_path, dest)
            if spec.outputs is not None:
                run.warn("spec.outputs names the outputs of ONNX models fxport exports; an "
                                                "uploaded ONNX model is copied as it is, with its own names")
            run.manifest.artifacts.extend(_artifact_records("onnx", dest, out_dir))
        run.manifest.capture = CaptureRecord(method="none", level="onnx", attempts=[])
        if "tensorrt" in run.request.deferred_targets:
            from fxport.workers.engine.tensorrt.stage import preflight_stage

            run.emit("export", 0.9, "TensorRT preflight")
            preflight_stage(run.manifest, loaded.onnx_path, spec.precision)


def _benchmark_onnx_input(run: _Run, loaded: LoadedModel, spec: JobSpec, out_dir: Path) -> None:
    """An ONNX upload's benchmark: onnxruntime on the model itself (there is no eager original to
    compare with; the artifact is the upload, byte for byte, so it stands as verified)."""
    import onnx

    from fxport.workers.engine.benchmark import measure
    from fxport.workers.engine.tensorrt.profiles import signature_from_onnx
    from fxport.workers.engine.verify.runners import OnnxRuntimeRunner

    assert loaded.onnx_path is not None
    sig = signature_from_onnx(onnx.load(str(loaded.onnx_path), load_external_data=False), spec.inputs,
                              spec.dynamic_dims)
    assert spec.benchmark is not None  # the caller runs this stage only with spec.benchmark
    run.manifest.benchmark = measure([OnnxRuntimeRunner(out_dir / "model.onnx", [i.name for i in sig.inputs])],
                                        sig, spec.benchmark, verified={"onnx"}, seed=spec.verify.seed, emit=run.emit)


def _build_tensorrt_from_onnx_input(run: _Run, loaded: LoadedModel, spec: JobSpec, out_dir: Path) -> None:
    """The GPU stage: engine from the ONNX model, verified against onnxruntime on that model (the
    original PyTorch model is not here; the CPU stage verified the ONNX model against it)."""
    import onnx

    from fxport.workers.engine.tensorrt.profiles import signature_from_onnx
    from fxport.workers.engine.tensorrt.stage import build_stage
    from fxport.workers.engine.verify.runners import OnnxRuntimeRunner

    assert loaded.onnx_path is not None
    sig = signature_from_onnx(onnx.load(str(loaded.onnx_path), load_external_data=False), spec.inputs,
                              spec.dynamic_dims)
    run.manifest.inputs = {"inputs": [i.model_dump() for i in sig.inputs],
                              "dynamic_dims": {k: v.model_dump() for k, v in sig.dynamic_dims.items()}}
    engine = build_stage(run.manifest, run.emit, onnx_path=loaded.onnx_path, sig=sig, spec=spec, out_dir=out_dir,
                         # an int8 (Q/DQ) model's reference runs as written: this host CPU's int8 kernels
                         # may saturate what TensorRT computes exactly (x86 without VNNI)
                         reference=OnnxRuntimeRunner(loaded.onnx_path, [i.name for i in sig.inputs],
                                                     int8_kernels=spec.precision != "int8"),
                         reference_label="onnxruntime on the ONNX model the engine was built from",
                         points=_sample_points(sig, spec), timing_cache=run.request.timing_cache)
    run.manifest.artifacts.extend(_artifact_records("tensorrt", engine, out_dir,
                                                       int8_scheme="tensorrt" if spec.precision == "int8" else None))
    _benchmark_engine(run, engine, sig, spec)


def _benchmark_engine(run: _Run, engine: Path, sig: InputSignature, spec: JobSpec) -> None:
    """The TensorRT engine's rows of the benchmark, measured on the GPU that built it (host
    buffers in and out, as a server feeds it), merged with the CPU stage's rows if any."""
    if spec.benchmark is None:
        return
    from fxport.benchmark import merge, verified_formats
    from fxport.workers.engine.benchmark import measure
    from fxport.workers.engine.tensorrt.runner import TrtRunner

    run.emit("tensorrt", 0.9, "benchmarking the engine")
    bench = measure([TrtRunner(engine, [i.name for i in sig.inputs])], sig, spec.benchmark,
                    verified=verified_formats(v.model_dump() for v in run.manifest.verification), seed=spec.verify.seed)
    bench["machine"]["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    run.manifest.benchmark = merge(run.manifest.benchmark, bench)
