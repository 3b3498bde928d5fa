"""Targets built after the CPU stage, from its ONNX model (the TensorRT engine), as the pipeline
meets them: the ONNX model they are built from is preflighted where it is made (a worker's CPU
stage, which defers them to their own stage); a run that builds one itself (the GPU stage, or
`fxport convert` on a machine that can) builds, records, verifies and benchmarks it here.

What each such target is — its stage, queue, ONNX sources, preflight and build — is its registry
entry's `later` (exporters/registry.py); nothing here names one.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from fxport.workers.engine.exporters.registry import REGISTRY, later_stage_of
from fxport.workers.engine.inputs import InputSignature
from fxport.workers.engine.publish import records_of
from fxport.workers.engine.run import Run


def preflight(run: Run, targets: Sequence[str], onnx_path: Path, progress: float) -> None:
    """Check `onnx_path` for each later-stage target in `targets` (export stage progress events):
    fail here, in seconds, on what the build would reject, rather than on the GPU queue."""
    for target in targets:
        stage = later_stage_of(target)
        run.emit("export", progress, f"{stage.label} preflight")
        stage.preflight(run.manifest, onnx_path, run.spec.precision)


def source_onnx(target: str, written: dict[str, Path]) -> Path | None:
    """The ONNX model among the artifacts `written` that `target` is built from (None: none was written)."""
    return next((written[s] for s in later_stage_of(target).sources if s in written), None)


def build(run: Run, target: str, *, onnx_path: Path, sig: InputSignature, reference: Any, reference_label: str,
          points: list[Any], int8_scheme: str | None) -> Path:
    """Build `target` from `onnx_path` into the output folder, verified against `reference` at `points`;
    record it among the artifacts and benchmark it (with spec.benchmark). Returns its path."""
    stage = later_stage_of(target)
    path = stage.build(run.manifest, run.emit, onnx_path=onnx_path, sig=sig, spec=run.spec,
                       path=run.out_dir / REGISTRY[target].path, reference=reference, reference_label=reference_label,
                       points=points, timing_cache=run.request.timing_cache)
    run.manifest.artifacts.extend(records_of([(target, path, int8_scheme)], run.out_dir))
    _benchmark(run, target, path, sig)
    return path


def _benchmark(run: Run, target: str, path: Path, sig: InputSignature) -> None:
    """The target's rows of the benchmark, measured on the GPU that built it (host buffers in and
    out, as a server feeds it), merged with the CPU stage's rows if any."""
    spec = run.spec
    if spec.benchmark is None:
        return
    from fxport.benchmark import merge, verified_formats
    from fxport.manifest_sections import Benchmark
    from fxport.workers.engine.benchmark import measure

    run.emit(later_stage_of(target).name, 0.9, "benchmarking the engine")
    bench = measure([REGISTRY[target].runner(path, sig)], sig, spec.benchmark,
                    verified=verified_formats(v.model_dump() for v in run.manifest.verification), seed=spec.verify.seed)
    bench["machine"]["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    merged = merge(run.manifest.benchmark.as_dict() if run.manifest.benchmark else None, bench)
    run.manifest.benchmark = Benchmark.model_validate(merged) if merged is not None else None
