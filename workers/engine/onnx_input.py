"""An ONNX upload: no torch graph exists, so the pipeline's capture, passes, quantize and verify
stages do not apply. The model is checked, copied as the onnx artifact, benchmarked in
onnxruntime, and the later-stage targets (the TensorRT engine) are preflighted or built from it.
"""

from __future__ import annotations

import shutil
from typing import TYPE_CHECKING

from fxport.errors import InvalidInput
from fxport.manifest import CaptureRecord
from fxport.manifest_sections import Benchmark
from fxport.spec import JobSpec
from fxport.workers.engine import later_stage
from fxport.workers.engine.exporters.registry import REGISTRY, later_stage_of, later_targets
from fxport.workers.engine.load import LoadedModel
from fxport.workers.engine.publish import records_of
from fxport.workers.engine.run import Run
from fxport.workers.engine.samples import sample_points

if TYPE_CHECKING:
    from fxport.workers.engine.inputs import InputSignature


def check_onnx_targets(spec: JobSpec) -> None:
    """An ONNX model gives only the onnx target (itself) and the targets built from an ONNX model."""
    from_onnx = ["onnx", *later_targets(REGISTRY)]
    bad = [t for t in spec.targets if t not in from_onnx]
    if bad:
        raise InvalidInput(
            f"an ONNX model converts only to {' and '.join(from_onnx)}; it cannot give {', '.join(bad)}",
            stage="load", field="targets", hint="upload the PyTorch model (.pt2) for torch targets",
        )


def convert_onnx_upload(run: Run, loaded: LoadedModel) -> None:
    """Every stage an ONNX upload goes through, after the load stage."""
    spec, request = run.spec, run.request
    _refuse_what_needs_the_pytorch_model(run)
    _check_and_copy(run, loaded)
    if spec.benchmark is not None and "onnx" in spec.targets:
        with run.stage("benchmark"):
            _benchmark(run, loaded)
    for target in request.built_later_here:
        with run.stage(later_stage_of(target).name):
            _build_later_target(run, loaded, target)


def _refuse_what_needs_the_pytorch_model(run: Run) -> None:
    """A package serves artifacts verified against the PyTorch model, and quantizing needs it; an ONNX
    upload is copied as it is. Only a later-stage target (the engine) may take another precision."""
    spec = run.spec
    if spec.package:
        raise InvalidInput(f"package {spec.package[0]} needs the PyTorch model: a package serves artifacts "
                           "verified against it and samples of its outputs, and an ONNX upload is copied as it "
                           "is", stage="load", field="package",
                           hint="upload the .pt2 (or torch.package) to package it, or drop `package`")
    if spec.precision != "fp32" and run.request.later_targets:
        if "onnx" in spec.targets:
            label = later_stage_of(run.request.later_targets[0]).label
            run.warn(f"precision {spec.precision} applies to the {label} engine; model.onnx is "
                     "the uploaded model as it is")
    elif spec.precision != "fp32":
        raise InvalidInput(
            f"precision {spec.precision} needs the PyTorch model: an ONNX upload is copied as it is",
            stage="load", field="precision", hint="upload the .pt2 (or torch.package) to quantize it",
        )


def _check_and_copy(run: Run, loaded: LoadedModel) -> None:
    """Check the upload, copy it as the onnx artifact, and record it; preflight it for the deferred
    later-stage targets (a worker's CPU stage)."""
    import onnx

    spec, out_dir = run.spec, run.out_dir
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
            run.manifest.artifacts.extend(records_of([("onnx", dest, None)], out_dir))
        run.manifest.capture = CaptureRecord(method="none", level="onnx", attempts=[])
        later_stage.preflight(run, run.request.deferred_targets, loaded.onnx_path, 0.9)


def _signature(run: Run, loaded: LoadedModel) -> InputSignature:
    """The inputs as the ONNX model declares them, with the spec's names and dynamic-dim ranges."""
    import onnx

    from fxport.workers.engine.tensorrt.profiles import signature_from_onnx

    assert loaded.onnx_path is not None
    return signature_from_onnx(onnx.load(str(loaded.onnx_path), load_external_data=False), run.spec.inputs,
                               run.spec.dynamic_dims)


def _benchmark(run: Run, loaded: LoadedModel) -> None:
    """An ONNX upload's benchmark: onnxruntime on the model itself (there is no eager original to
    compare with; the artifact is the upload, byte for byte, so it stands as verified)."""
    from fxport.workers.engine.benchmark import measure
    from fxport.workers.engine.verify.runners import OnnxRuntimeRunner

    spec = run.spec
    sig = _signature(run, loaded)
    assert spec.benchmark is not None  # the caller runs this stage only with spec.benchmark
    run.manifest.benchmark = Benchmark.model_validate(
        measure([OnnxRuntimeRunner(run.out_dir / "model.onnx", [i.name for i in sig.inputs])], sig, spec.benchmark,
                verified={"onnx"}, seed=spec.verify.seed, emit=run.emit))


def _build_later_target(run: Run, loaded: LoadedModel, target: str) -> None:
    """The GPU stage: the engine from the ONNX model, verified against onnxruntime on that model (the
    original PyTorch model is not here; the CPU stage verified the ONNX model against it)."""
    from fxport.workers.engine.verify.runners import OnnxRuntimeRunner

    spec = run.spec
    assert loaded.onnx_path is not None
    sig = _signature(run, loaded)
    run.manifest.inputs = {"inputs": [i.model_dump() for i in sig.inputs],
                           "dynamic_dims": {k: v.model_dump() for k, v in sig.dynamic_dims.items()}}
    later_stage.build(
        run, target, onnx_path=loaded.onnx_path, sig=sig,
        # an int8 (Q/DQ) model's reference runs as written: this host CPU's int8 kernels
        # may saturate what TensorRT computes exactly (x86 without VNNI)
        reference=OnnxRuntimeRunner(loaded.onnx_path, [i.name for i in sig.inputs],
                                    int8_kernels=spec.precision != "int8"),
        reference_label="onnxruntime on the ONNX model the engine was built from",
        points=sample_points(sig, spec),
        int8_scheme=later_stage_of(target).int8_runtime if spec.precision == "int8" else None)
