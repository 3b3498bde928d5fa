"""The conversion engine end to end: load → capture → passes → quantize → export → verify →
benchmark → (tensorrt) → package, and manifest.json.

`convert` is the one entry point. Workers call it inside the sandbox; `fxport convert` calls
it in-process. It always leaves manifest.json in `out_dir`, also when a stage fails.

This module is the orchestration only: which stage runs when, on what. Each stage's work has a
room of its own:

    run.py             one conversion's bookkeeping: the manifest, stage timings, progress events
    load.py, inputs.py, capture.py   the model, its input signature, its graph
    passes/            the graph passes
    precision.py       the quantize stage (fp16 / int8 graphs), and what int8 asks of the others
    exporters/         the targets (registry.py) and their exporters
    publish.py         artifacts written to a staging folder, renamed into place, and recorded
    samples.py         the inputs the artifacts are checked at
    verify/stage.py    the verify stage
    benchmark.py       the benchmark stage
    later_stage.py     targets built after the CPU stage from its ONNX model (the TensorRT engine)
    onnx_input.py      an ONNX upload's way through the stages
    package.py         the package stage (a Triton repository)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import fxport
from fxport.digest import sha256_file
from fxport.errors import CaptureFailed, ConversionFailed, FxportError, InvalidInput
from fxport.manifest import SCHEMA_VERSION, CaptureRecord, FailedTarget, InputRecord, Manifest, PassRecord
from fxport.manifest_sections import Benchmark, GraphSummary
from fxport.serving.signature import model_signature
from fxport.spec import JobSpec
from fxport.toolchain import manifest_toolchain
from fxport.workers.engine import later_stage
from fxport.workers.engine.capture import (
    Captured,
    capture_ladder,
    eager_capture_record,
    eager_fallback_blocker,
    short_capture_reason,
)
from fxport.workers.engine.exporters.registry import (
    REGISTRY,
    TENSORRT_ONNX,
    ExportJob,
    exported_targets,
    later_stage_of,
)
from fxport.workers.engine.graph_summary import graph_summary
from fxport.workers.engine.inputs import InputSignature, resolve_signature
from fxport.workers.engine.load import LoadedModel, load_model, unknown_op_hint
from fxport.workers.engine.onnx_input import check_onnx_targets, convert_onnx_upload
from fxport.workers.engine.package import package_triton
from fxport.workers.engine.passes import PassContext, run_passes
from fxport.workers.engine.precision import Reduced, check_int8_onnx, quantization_section, reduce_precision
from fxport.workers.engine.publish import export_one, output_names, provenance, records_of, withdraw
from fxport.workers.engine.request import DeferredTarget, EngineRequest, TimingCachePaths
from fxport.workers.engine.run import ProgressFn, Run
from fxport.workers.engine.samples import Checks, verification_points
from fxport.workers.engine.verify.runners import ReferenceOutputs
from fxport.workers.engine.verify.stage import verify_stage


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
    """`convert_request` for a request spelled out in keywords (scripts, tests, benchmarks), returning
    the manifest as plain JSON data (what manifest.json holds).

    `timing_cache_path`: a TensorRT timing cache file a build reads; the merged cache is written to
    `timing_cache_out` (default: the same file). See request.EngineRequest for the rest."""
    cache = (TimingCachePaths(read=timing_cache_path, write=timing_cache_out or timing_cache_path)
             if timing_cache_path is not None else None)
    request = EngineRequest(model_path=model_path, spec=spec, out_dir=out_dir, job_id=job_id,
                            calibration_path=calibration_path, deferred_targets=tuple(deferred_targets),
                            timing_cache=cache, input_sha256=input_sha256)
    return convert_request(request, on_progress=on_progress, report=report).to_dict()


def convert_request(request: EngineRequest, *, on_progress: ProgressFn | None = None,
                    report: bool = True) -> Manifest:
    """Convert per `request` into `request.out_dir`. Returns the manifest.

    `report`: also write report.html (the sandbox leaves it to its parent, which may run `dot`).
    Raises an FxportError subclass naming the stage; manifest.json is written either way. A failed
    conversion keeps no model file in out_dir (publish.withdraw): its manifest lists what was built.
    """
    out_dir = request.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest = _new_manifest(request)
    run = Run(request, manifest, on_progress)
    try:
        _convert(run)
        manifest.status = "succeeded"
    except FxportError as exc:
        exc.hint = unknown_op_hint(exc.message) or exc.hint
        manifest.status, manifest.error = "failed", exc.record()
        raise
    except Exception as exc:  # an engine bug: still a clean, named failure
        err = ConversionFailed(f"internal error: {type(exc).__name__}: {exc}", stage="export")
        err.__cause__ = exc  # as `raise err from exc` below sets it: the record keeps the chain
        manifest.status, manifest.error = "failed", err.record()
        raise err from exc
    finally:
        if manifest.status == "failed":
            _withdraw_all(manifest, out_dir)
        if manifest.signature is None:
            manifest.signature = model_signature(manifest.inputs, manifest.outputs)
        manifest.write(out_dir / "manifest.json")
        if report:
            _write_report(out_dir / "manifest.json", manifest)
    return manifest


def _new_manifest(request: EngineRequest) -> Manifest:
    """The manifest of a conversion about to start: what it converts, how, with which toolchain."""
    model_path = request.model_path
    return Manifest(
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


def _withdraw_all(manifest: Manifest, out_dir: Path) -> None:
    """The failed conversion's artifacts (and any earlier run's under the same names) out of out_dir,
    said in the manifest, whose `artifacts` still list what was built."""
    removed = withdraw(out_dir, [*output_names(), *(a.path.split("/", 1)[0] for a in manifest.artifacts)])
    if removed:
        manifest.warn(f"the job failed, so it keeps no model file: {', '.join(sorted(removed))} removed from the "
                      "output folder (artifacts lists what was built)")


def _write_report(manifest_path: Path, manifest: Manifest) -> None:
    """report.html beside the manifest. A report problem never fails the conversion."""
    from fxport.report import write_report

    try:
        write_report(manifest_path)
    except Exception as exc:
        manifest.warn(f"report.html could not be written: {type(exc).__name__}: {exc}")
        manifest.write(manifest_path)


@dataclass
class _Built:
    """What the export stage left: the artifacts written, and the reduced-precision graphs they
    came from (None for fp32 and on the eager path)."""

    written: dict[str, Path]
    reduced: Reduced | None = None


def _convert(run: Run) -> None:
    spec = run.spec
    torch.manual_seed(spec.verify.seed)
    with run.stage("load"):
        loaded, sig = _load(run)
    if sig is None:  # an ONNX upload: no torch graph exists
        convert_onnx_upload(run, loaded)
        return

    with run.stage("capture"):
        captured, capture_failure = _capture(run, loaded, sig, spec)
    example = sig.make_inputs(sig.export_point(), seed=spec.verify.seed)
    # Built once: the inputs every artifact is verified at, and the original model's outputs there,
    # which the exporters' own checks (a trace run at other shapes) share with verification.
    checks = Checks(sig, spec, ReferenceOutputs(loaded.module))
    if captured is None:
        assert capture_failure is not None
        built = _Built(_build_from_eager(run, loaded, sig, spec, run.out_dir, example, capture_failure, checks))
        if run.request.calibration_path is not None:  # the eager path is fp32 only
            run.warn("calibration data was given but precision is fp32: it was not used")
    else:
        built = _build_from_graph(run, captured, loaded, sig, example, checks)

    with run.stage("verify"):
        runners, records = verify_stage(run, sig, spec, built.written, built.reduced, checks)
    _accept_failed_targets(run)
    if spec.benchmark is not None:
        with run.stage("benchmark"):
            _benchmark_stage(run, loaded, sig, runners, records)
    if captured is not None:  # the eager path recorded the later-stage targets among its failed targets
        _build_later_targets(run, sig, built, checks)
    if "triton" in spec.package:
        with run.stage("package", "triton"):
            package_triton(run, checks)


def _accept_failed_targets(run: Run) -> None:
    """The failure policy (README, "What a conversion does"): every requested target is verified or
    listed in failed_targets with why. A job with a failed target fails, naming each and why, unless
    the spec accepts partial results (allow_partial): then it goes on with the verified artifacts of
    the others, and no file of a failed target (an earlier run's, under its name) stays in out_dir."""
    failed = run.manifest.failed_targets
    if not failed:
        return
    if run.spec.allow_partial:
        withdraw(run.out_dir, output_names(f.target for f in failed))
        return
    why_of: dict[str, list[str]] = {}  # targets that failed for the same reason, named once
    for f in failed:
        why = f.reason[len(f.target):].strip(" :") if f.reason.startswith(f.target) else f.reason
        why_of.setdefault(why, []).append(f.target)
    listed = "; ".join(f"{', '.join(targets)}: {why}" for why, targets in why_of.items())
    built = [a.format for a in run.manifest.artifacts]
    others = (f"; the other target(s) ({', '.join(dict.fromkeys(built))}) were built and verified, and are not kept"
              if built else "")
    every_capture = all(f.stage == "capture" for f in failed)
    raise (CaptureFailed if every_capture else ConversionFailed)(
        f"{len(failed)} of {len(run.spec.targets)} target(s) could not be built: {listed}{others}",
        stage="capture" if every_capture else "export", field="targets",
        hint="pass --allow-partial (spec allow_partial: true) to accept the verified artifacts of the others, or drop "
             f"{', '.join(f.target for f in failed)} from targets")


def _load(run: Run) -> tuple[LoadedModel, InputSignature | None]:
    """The model, its format recorded and the targets checked against it; and its input signature,
    recorded too (None for an ONNX upload, which the pipeline checks and copies as it is)."""
    manifest = run.manifest
    loaded = load_model(run.request.model_path)
    manifest.input.format = loaded.format
    _check_targets(loaded, run.request)
    if loaded.format == "onnx":
        return loaded, None
    sig = resolve_signature(run.spec, loaded)
    manifest.inputs = {
        "inputs": [i.model_dump() for i in sig.inputs],
        "dynamic_dims": {k: v.model_dump() for k, v in sig.dynamic_dims.items()},
    }
    manifest.warnings.extend(sig.notes)
    return loaded, sig


def _check_targets(loaded: LoadedModel, request: EngineRequest) -> None:
    if loaded.format == "onnx":
        check_onnx_targets(request.spec)
    for target in request.built_later_here:
        stage = later_stage_of(target)
        why = stage.unavailable()
        if why is not None:
            raise InvalidInput(
                f"the {target} target builds the engine on this machine, which cannot: {why}",
                stage="load", field="targets",
                hint=f"submit the job to an fxport server with a GPU worker (queue {stage.queue}), or drop {target} "
                     "from targets",
            )


def _capture(run: Run, loaded: LoadedModel, sig: InputSignature, spec: JobSpec
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


def _build_from_graph(run: Run, captured: Captured, loaded: LoadedModel, sig: InputSignature,
                      example: tuple[Any, ...], checks: Checks) -> _Built:
    """passes → quantize → export, from the captured graph."""
    spec, calibration_path = run.spec, run.request.calibration_path
    with run.stage("passes"):
        gm = _run_passes(run, captured, example)
    reduced: Reduced | None = None
    if spec.precision != "fp32":
        with run.stage("quantize", spec.precision):
            reduced = reduce_precision(run, gm, sig, spec, example, calibration_path)
    elif calibration_path is not None:
        run.warn("calibration data was given but precision is fp32: it was not used")
    with run.stage("export"):
        written = _export(run, gm, loaded, sig, example, reduced, checks)
    return _Built(written, reduced)


def _run_passes(run: Run, captured: Captured, example: tuple[Any, ...]) -> Any:
    """The spec's passes over the captured graph, recorded with the graph before and after."""
    manifest = run.manifest
    gm = captured.graph_module
    ctx = PassContext(level=captured.level, example_inputs=example)
    manifest.graph_before = GraphSummary.model_validate(graph_summary(gm))
    gm, records = run_passes(gm, run.spec.passes, ctx)
    manifest.passes = [PassRecord.model_validate(r) for r in records]
    manifest.graph_after = GraphSummary.model_validate(graph_summary(gm))
    if "profile" in ctx.report:
        manifest.profile = ctx.report["profile"]
    return gm


def _export(run: Run, gm: Any, loaded: LoadedModel, sig: InputSignature, example: tuple[Any, ...],
            reduced: Reduced | None, checks: Checks) -> dict[str, Path]:
    """Every target the export stage writes, from the graph (or its reduced-precision graphs),
    recorded; then the int8 ONNX models inspected and the later-stage targets' ONNX preflighted."""
    manifest, spec = run.manifest, run.spec
    targets = _export_targets(run, reduced)
    made_from = provenance(manifest, spec)
    programs: dict[int, Any] = {}  # each graph's torch.export program, made once for every target
    written: dict[str, Path] = {}
    for i, target in enumerate(targets):
        run.emit("export", i / max(len(targets), 1), target)
        job = ExportJob(graph=reduced.graph_for(target) if reduced else gm, module=loaded.module,
                        example=example, sig=sig, spec=spec, extremes=checks.trace_checks(),
                        precision=spec.precision, provenance=made_from, programs=programs,
                        reference=checks.reference.leaves)
        writer = REGISTRY[target].from_graph
        assert writer is not None  # _export_targets lists only targets the export stage writes
        written[target], note, interface = export_one(target, writer, job, run.out_dir)
        if interface is not None:
            manifest.outputs = interface["outputs"]
        if note and reduced is None:
            run.warn(f"{target}: {note}")
        elif note:  # how a reduced-precision artifact was built (int8 kernels or fake-quant, ...)
            quantization_section(run).setdefault("artifact_notes", {})[target] = note
    manifest.artifacts.extend(records_of(
        [(target, path, reduced.scheme_of(target) if reduced else None) for target, path in written.items()],
        run.out_dir))
    if reduced is not None and reduced.int8 is not None:
        for target in ("onnx", TENSORRT_ONNX):
            if target in written:
                run.emit("export", 0.95, f"checking the int8 ONNX model {written[target].name}")
                check_int8_onnx(run, reduced, target, written[target], example, sig, spec)
    for target in run.request.later_targets:  # fail here, in seconds, on what TensorRT's parser rejects
        onnx_path = later_stage.source_onnx(target, written)
        assert onnx_path is not None  # "onnx" joined the targets in _export_targets
        later_stage.preflight(run, [target], onnx_path, 0.97)
    return written


def _export_targets(run: Run, reduced: Reduced | None) -> list[str]:
    """The spec's targets the export stage writes, and the ONNX model the later-stage targets are built from."""
    targets = exported_targets(run.spec.targets)
    if run.request.later_targets and "onnx" not in targets:
        targets.append("onnx")  # the TensorRT engine is built from it
    if run.request.later_targets and reduced is not None and reduced.separate_tensorrt_onnx:
        targets.append(TENSORRT_ONNX)  # int8 for TensorRT is its own ONNX (symmetric), beside model.onnx
    return targets


def _build_from_eager(run: Run, loaded: LoadedModel, sig: InputSignature, spec: JobSpec, out_dir: Path,
                      example: tuple[Any, ...], failure: CaptureFailed, checks: Checks) -> dict[str, Path]:
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
        made_from = provenance(manifest, spec)
        for i, target in enumerate(spec.targets):
            run.emit("export", i / max(len(spec.targets), 1), target)
            from_eager = REGISTRY[target].from_eager if target in REGISTRY else None
            if from_eager is None:
                failed.append(FailedTarget(target=target, stage="capture",
                                           reason=f"{target} needs a graph, and none could be captured ({why}; "
                                                  "every rung is in capture.attempts)"))
                continue
            job = ExportJob(graph=None, module=loaded.module, example=example, sig=sig, spec=spec,
                            extremes=checks.trace_checks(), precision="fp32", provenance=made_from,
                            reference=checks.reference.leaves)
            try:
                written[target], note, interface = export_one(target, from_eager, job, out_dir)
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
        manifest.artifacts.extend(records_of([(built, path, None) for built, path in written.items()], out_dir))
    return written


def _benchmark_stage(run: Run, loaded: LoadedModel, sig: InputSignature, runners: list[Any],
                     records: list[dict[str, Any]]) -> None:
    """The eager original and every verified CPU artifact, timed in their own runtimes."""
    from fxport.benchmark import verified_formats
    from fxport.workers.engine.benchmark import measure
    from fxport.workers.engine.verify.runners import EagerRunner

    spec = run.spec
    assert spec.benchmark is not None  # the caller runs this stage only with spec.benchmark
    # the ONNX made for TensorRT is timed as the engine, on the GPU, not in onnxruntime here
    cpu_runners = [r for r in runners if r.name != TENSORRT_ONNX]
    run.manifest.benchmark = Benchmark.model_validate(
        measure([EagerRunner(loaded.module), *cpu_runners], sig, spec.benchmark, verified=verified_formats(records),
                seed=spec.verify.seed, emit=run.emit))


def _build_later_targets(run: Run, sig: InputSignature, built: _Built, checks: Checks) -> None:
    """The later-stage targets this run builds itself (the TensorRT engine, on this machine's GPU),
    each in its own stage, from the ONNX model the export stage wrote, verified against the original
    model at the points the other artifacts were verified at."""
    reduced = built.reduced
    for target in run.request.built_later_here:
        onnx_path = later_stage.source_onnx(target, built.written)
        assert onnx_path is not None  # the export stage wrote it for this target
        with run.stage(later_stage_of(target).name):
            later_stage.build(run, target, onnx_path=onnx_path, sig=sig, reference=checks.reference,
                              reference_label="the original model (eager)",
                              points=verification_points(sig, run.spec, reduced, checks),
                              int8_scheme=reduced.scheme_of(target) if reduced else None)
