"""Compare every artifact's runner against the original eager model on the same inputs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from fxport.spec import VerifyOptions
from fxport.workers.engine.verify.runners import Runner


@dataclass
class SamplePoint:
    dims: dict[str, int]
    args: tuple[Any, ...]


def compare_outputs(ref: list[np.ndarray], got: list[np.ndarray], opts: VerifyOptions) -> dict[str, Any]:
    """Metrics over all output leaves of one sample. `passed` needs allclose AND cosine >= min_cosine."""
    if len(ref) != len(got):
        return {"passed": False, "error": f"artifact returns {len(got)} outputs, the model {len(ref)}"}
    worst_abs = worst_rel = 0.0
    worst_cos = 1.0
    ok = True
    per_output: list[dict[str, Any]] = []
    for i, (a, b) in enumerate(zip(ref, got)):
        if a.shape != b.shape:
            return {"passed": False, "error": f"output {i} has shape {list(b.shape)}, the model's {list(a.shape)}"}
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        if a64.size and not np.isfinite(a64).any():
            # An all-NaN/Inf reference "matches" anything that is equally broken: nothing to verify.
            return {"passed": False, "error": f"the original model's output {i} is entirely NaN/Inf on the "
                                              "verification inputs (are its weights NaN or Inf?); there is "
                                              "nothing to compare the artifact against"}
        if not (np.isfinite(a64).all() and np.isfinite(b64).all()):
            same_nonfinite = np.array_equal(np.isnan(a64), np.isnan(b64)) and np.array_equal(
                np.where(np.isinf(a64), a64, 0), np.where(np.isinf(b64), b64, 0))
            if not same_nonfinite:
                return {"passed": False, "error": f"output {i} has NaN/Inf where the model's does not"}
            mask = np.isfinite(a64)
            a64, b64 = a64[mask], b64[mask]
        diff = np.abs(a64 - b64)
        max_abs = float(diff.max()) if diff.size else 0.0
        max_rel = float((diff / np.maximum(np.abs(a64), 1e-12)).max()) if diff.size else 0.0
        na, nb = np.linalg.norm(a64), np.linalg.norm(b64)
        cos = float(np.dot(a64.ravel(), b64.ravel()) / (na * nb)) if na > 0 and nb > 0 else (1.0 if na == nb else 0.0)
        worst_abs, worst_rel, worst_cos = max(worst_abs, max_abs), max(worst_rel, max_rel), min(worst_cos, cos)
        out_ok = bool(np.allclose(b64, a64, atol=opts.atol, rtol=opts.rtol)) and cos >= opts.min_cosine
        ok = ok and out_ok
        per_output.append({"output": i, "max_abs_diff": max_abs, "max_rel_diff": max_rel, "cosine": cos,
                           "passed": out_ok})
    return {"passed": ok, "max_abs_diff": worst_abs, "max_rel_diff": worst_rel, "cosine": worst_cos,
            "outputs": per_output}


def _merge_outputs(worst: list[dict[str, Any]], sample: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per output, the worst of each metric over the samples seen so far."""
    if not worst:
        return [dict(o) for o in sample]
    for w, o in zip(worst, sample):
        w["max_abs_diff"] = max(w["max_abs_diff"], o["max_abs_diff"])
        w["max_rel_diff"] = max(w["max_rel_diff"], o["max_rel_diff"])
        w["cosine"] = min(w["cosine"], o["cosine"])
        w["passed"] = w["passed"] and o["passed"]
    return worst


def verify_artifacts(
    reference: Runner,
    runners: list[Runner],
    points: list[SamplePoint],
    opts: VerifyOptions,
    on_runner: Callable[[str], None] | None = None,
    *,
    compare: Callable[[list[np.ndarray], list[np.ndarray], VerifyOptions], dict[str, Any]] | None = None,
    finish: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """One record per runner: worst metrics across all sample points, and every shape checked.

    `compare` replaces `compare_outputs` (reduced-precision artifacts are judged differently);
    counters it returns (`top1_same`, `top1_rows`) are summed over samples, and `finish`
    sees each record last, to judge what only the totals show.
    """
    compare = compare or compare_outputs
    with reference:
        expected = [reference.infer(p.args) for p in points]
    records = []
    for runner in runners:
        if on_runner:
            on_runner(runner.name)
        record: dict[str, Any] = {
            "format": runner.name, "runtime": runner.runtime, "max_abs_diff": 0.0, "max_rel_diff": 0.0,
            "cosine": 1.0, "passed": True, "shapes_checked": [], "samples": len(points),
        }
        try:
            with runner:
                for point, ref in zip(points, expected):
                    got = runner.infer(point.args)
                    m = compare(ref, got, opts)
                    shapes = [list(a.shape) for a in point.args]
                    shape = shapes[0] if len(shapes) == 1 else shapes
                    if shape not in record["shapes_checked"]:
                        record["shapes_checked"].append(shape)
                    if "error" in m:
                        record.update(passed=False, error=m["error"])
                        break
                    record["max_abs_diff"] = max(record["max_abs_diff"], m["max_abs_diff"])
                    record["max_rel_diff"] = max(record["max_rel_diff"], m["max_rel_diff"])
                    record["cosine"] = min(record["cosine"], m["cosine"])
                    record["passed"] = record["passed"] and m["passed"]
                    if "outputs" in m:  # per output: the worst over every sample and shape
                        record["outputs"] = _merge_outputs(record.get("outputs", []), m["outputs"])
                    for key in ("top1_same", "top1_rows"):
                        if key in m:
                            record[key] = record.get(key, 0) + m[key]
        except Exception as exc:
            record.update(passed=False, error=f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}")
        if finish:
            finish(record)
        records.append(record)
    return records
