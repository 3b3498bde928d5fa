"""One conversion's inputs as one typed value: what the engine is asked to do, and nothing else.

A worker (or `fxport convert`) builds an `EngineRequest` once. It travels to the sandbox as JSON
inside the sandbox's own request (sandbox/run.py `SandboxRequest`) and the child reads it back as
the same type, so the spec is validated once on each side of the process boundary and every
question about the run ("is the TensorRT engine built here?") is answered by one property here.

How the caller follows the run (progress callback, cancel event) and where the sandbox keeps its
files are not part of it: they belong to the call, not to the conversion.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, cast

from pydantic import BaseModel, ConfigDict, field_serializer

from fxport.spec import JobSpec
from fxport.workers.engine.exporters.registry import later_stage_of, later_targets

# Targets a run can leave to a later stage, built from this run's ONNX model (the GPU queue): the
# registry's targets with a `later` stage (tests/workers/engine/test_registry.py keeps them in step).
DeferredTarget = Literal["tensorrt"]


class TimingCachePaths(BaseModel):
    """A TensorRT timing cache: the file a build reads, and where the merged cache is written."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    read: Path
    write: Path


DEFAULT_MAX_OUTPUT_BYTES = 64 << 30  # fxport/config.py max_job_output_bytes


class EngineRequest(BaseModel):
    """What to convert, how, and into where (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_path: Path
    spec: JobSpec
    out_dir: Path
    job_id: str | None = None
    calibration_path: Path | None = None
    # built later, elsewhere, from this run's ONNX model: this run makes and preflights that ONNX instead
    deferred_targets: tuple[DeferredTarget, ...] = ()
    timing_cache: TimingCachePaths | None = None
    # the model file's sha256 when the caller already checked it (a worker verifies the download)
    input_sha256: str | None = None
    # the wall-clock limit the caller grants (a worker's soft time limit may be below the spec's)
    timeout_s: float | None = None
    # the bytes the sandbox may write in all (FXPORT_MAX_JOB_OUTPUT_BYTES on a worker)
    max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES

    @field_serializer("spec")
    def _spec_as_normalized(self, spec: JobSpec) -> dict[str, Any]:
        return spec.normalized()  # the form every other copy of a spec is written in (manifest, cache key)

    # -- what the run does, decided here once ----------------------------------------------------

    @property
    def built_later_here(self) -> list[str]:
        """The later-stage targets (the TensorRT engine) this run builds itself, on this machine."""
        return [t for t in later_targets(self.spec.targets) if t not in self.deferred_targets]

    @property
    def later_targets(self) -> list[str]:
        """The later-stage targets this run makes (and preflights) the ONNX model for, built here or later."""
        return list(dict.fromkeys([*later_targets(self.spec.targets), *self.deferred_targets]))

    @property
    def builds_tensorrt(self) -> bool:
        """The TensorRT engine (a later-stage target) is built in this run (on this machine's GPU)."""
        return bool(self.built_later_here)

    @property
    def needs_tensorrt_onnx(self) -> bool:
        """This run makes (and preflights) the ONNX model an engine is built from, here or later."""
        return bool(self.later_targets)

    @property
    def timeout(self) -> float:
        return float(self.timeout_s or self.spec.limits.timeout_s)

    @property
    def memory_bytes(self) -> int:
        return self.spec.limits.memory_mb << 20

    def resolved(self) -> EngineRequest:
        """The same request with absolute paths (the sandbox child runs in another directory)."""
        cache = self.timing_cache
        return self.model_copy(update={
            "model_path": self.model_path.resolve(), "out_dir": self.out_dir.resolve(),
            "calibration_path": self.calibration_path.resolve() if self.calibration_path else None,
            "timing_cache": (TimingCachePaths(read=cache.read.resolve(), write=cache.write.resolve())
                             if cache is not None else None),
        })


def cpu_stage(spec: JobSpec) -> tuple[JobSpec, tuple[DeferredTarget, ...]]:
    """A worker's CPU stage of `spec`: the spec it runs and the targets it leaves to a later stage.

    A job with the tensorrt target (a registry target with a `later` stage) makes every other
    artifact and the ONNX model the engine is built from here, and the engine on the GPU queue.
    The spec is derived from the validated one (no second validation): the later targets out, onnx
    in; with a later target the only target, int8 stays in its scheme (the onnx target here is only
    the engine's input)."""
    later = later_targets(spec.targets)
    if not later:
        return spec, ()
    targets = [t for t in spec.targets if t not in later]
    if "onnx" not in targets:
        targets.append("onnx")
    update: dict[str, Any] = {"targets": targets}
    runtimes = [later_stage_of(t).int8_runtime for t in later]
    if spec.int8_runtimes() == runtimes:
        update["quantization"] = spec.quantization.model_copy(update={"runtime": runtimes[0]})
    return spec.model_copy(update=update), cast("tuple[DeferredTarget, ...]", tuple(later))
