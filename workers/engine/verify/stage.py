"""The verify stage: every artifact the export stage wrote, run on the same inputs as the original
model, judged by the precision's tolerances (verify/precision.py) with the comparator
(verify/comparator.py). A mismatch fails the job unless the spec allows it; an inconclusive
verdict is a warning. (A later-stage target, the TensorRT engine, is verified where it is built:
tensorrt/stage.py.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fxport.errors import VerificationFailed
from fxport.manifest import VerificationRecord
from fxport.spec import JobSpec
from fxport.workers.engine.exporters.registry import REGISTRY
from fxport.workers.engine.inputs import InputSignature
from fxport.workers.engine.precision import Reduced, int8_runners, reduced_precision_failure
from fxport.workers.engine.run import Run
from fxport.workers.engine.samples import Checks, verification_points
from fxport.workers.engine.verify.comparator import inconclusive_warnings, verify_artifacts


def verify_stage(run: Run, sig: InputSignature, spec: JobSpec, written: dict[str, Path],
                 reduced: Reduced | None, checks: Checks) -> tuple[list[Any], list[dict[str, Any]]]:
    """Every artifact against the eager model. Raises VerificationFailed on a mismatch (unless the spec
    allows it); an inconclusive verdict is a warning. Returns the runners and the records."""
    from fxport.workers.engine.verify.precision import PrecisionComparison, tolerances_for

    manifest = run.manifest
    real_data = bool(reduced and reduced.calibration and reduced.calibration.info.get("source") == "file")
    tol = tolerances_for(spec, real_data=real_data)
    comparison = PrecisionComparison(tol) if reduced is not None else None
    points = verification_points(sig, spec, reduced, checks)
    runners = _runners(written, sig)
    if reduced is not None and reduced.int8 is not None:
        runners = int8_runners(run, reduced, runners)
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
        raise reduced_precision_failure(run, spec, tol, reduced, failed, table)
    hint = "inspect manifest.json 'verification'; loosen spec.verify only if the difference is expected"
    if manifest.capture is not None and manifest.capture.method == "eager":
        hint += ("; these artifacts were built from the eager model: a traced one keeps only the example's path "
                 "through Python control flow (see the warnings for how each was made)")
    raise VerificationFailed(
        f"{len(failed)} artifact(s) do not match the original model ({tol.describe()}): {table}",
        stage="verify", hint=hint)


def _runners(written: dict[str, Path], sig: InputSignature) -> list[Any]:
    return [REGISTRY[target].runner(path, sig) for target, path in written.items()]

