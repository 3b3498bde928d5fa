"""The inputs one conversion checks its artifacts at, made once: verification's sample points (the
opt shape and every dynamic-shape extreme), the exporters' trace checks drawn from them, and, for
int8, the held-out calibration samples it is judged on instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from fxport.spec import JobSpec
from fxport.workers.engine.inputs import InputSignature
from fxport.workers.engine.verify.comparator import SamplePoint
from fxport.workers.engine.verify.runners import ReferenceOutputs

if TYPE_CHECKING:
    from fxport.workers.engine.precision import Reduced


class Checks:
    """The sample inputs of one conversion, made once, and the original model's outputs there
    (`reference`, computed on first use). The verify and TensorRT stages verify at `points`;
    the exporters check a trace at `trace_checks()`, drawn from the same points."""

    def __init__(self, sig: InputSignature, spec: JobSpec, reference: ReferenceOutputs) -> None:
        self.sig, self.reference = sig, reference
        self.points = sample_points(sig, spec)

    def trace_checks(self) -> list[tuple[Any, ...]]:
        """One input at every distinct shape among the points but the export example's: a trace
        is taken at the example's shape and is exact there; elsewhere it may have fixed a size."""
        example, seen, out = self.sig.export_point(), [], []
        for point in self.points:
            if point.dims != example and point.dims not in seen:
                seen.append(point.dims)
                out.append(point.args)
        return out


def sample_points(sig: InputSignature, spec: JobSpec) -> list[SamplePoint]:
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


def held_out_points(sig: InputSignature, spec: JobSpec, reduced: Reduced) -> list[SamplePoint]:
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


def verification_points(sig: InputSignature, spec: JobSpec, reduced: Reduced | None, checks: Checks
                        ) -> list[SamplePoint]:
    """Where the artifacts are verified: the held-out samples for int8, else the conversion's sample points."""
    return held_out_points(sig, spec, reduced) if reduced is not None and reduced.int8 else checks.points


def _dims_of(sig: InputSignature, args: tuple[Any, ...]) -> dict[str, int]:
    dims: dict[str, int] = {}
    for inp, a in zip(sig.inputs, args):
        for i, d in enumerate(inp.shape):
            if isinstance(d, str) and i < a.dim():
                dims.setdefault(d, int(a.shape[i]))
    return dims
