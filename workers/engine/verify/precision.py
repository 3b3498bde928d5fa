"""Verification tolerances per precision, and the comparison an fp16 or int8 artifact is judged by.

fp32 artifacts: spec.verify as written (the scale-aware allclose of comparator.py, and cosine).
Reduced precision changes the numbers by design, so the defaults differ — a value the user set in
spec.verify always wins:
- fp16: allclose with atol 2e-2 / rtol 1e-2 / scale_atol 1e-2 (fp16 keeps ~3 significant digits; its
  rounding, like float32's, scales with the largest values a layer sums), cosine >= 0.999.
- int8: no absolute diff at all (it is reported, not judged): cosine >= 0.98, or the
  spec's quantization.target_cosine when set; and, when the held-out samples are real data
  from a calibration file, top-1 agreement >= 0.9 on outputs shaped [batch, classes] (the
  argmax a classifier's user sees). On random inputs a classifier's logits are near ties,
  so top-1 agreement there says little about real predictions: it is reported, not judged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from fxport.spec import JobSpec, VerifyOptions
from fxport.workers.engine.verify.comparator import ELEMENTWISE, TOLERANCE_RULE, OutputLayout, compare_outputs

FP16_ATOL, FP16_RTOL, FP16_SCALE_ATOL, FP16_MIN_COSINE = 2e-2, 1e-2, 1e-2, 0.999
INT8_MIN_COSINE, INT8_MIN_TOP1 = 0.98, 0.9


@dataclass
class Tolerances:
    precision: str
    options: VerifyOptions  # atol / rtol / min_cosine in effect
    min_top1: float | None = None  # int8 only
    judge_abs_diff: bool = True

    def describe(self) -> str:
        if self.precision == "int8":
            top = f", top-1 agreement >= {self.min_top1}" if self.min_top1 is not None else ""
            return f"int8: cosine >= {self.options.min_cosine}{top}"
        return (f"{self.precision}: atol={self.options.atol}, rtol={self.options.rtol}, "
                f"scale_atol={self.options.scale_atol}, min_cosine={self.options.min_cosine}")

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"precision": self.precision, "min_cosine": self.options.min_cosine,
                               "max_unmatched_detections": self.options.max_unmatched_detections}
        if self.judge_abs_diff:
            out.update(atol=self.options.atol, rtol=self.options.rtol, scale_atol=self.options.scale_atol,
                       rule=TOLERANCE_RULE)
        if self.min_top1 is not None:
            out["min_top1_agreement"] = self.min_top1
        return out


def tolerances_for(spec: JobSpec, *, real_data: bool = False) -> Tolerances:
    """The tolerances in effect; `real_data`: int8 is judged on held-out samples from a calibration file."""
    # What the user chose: a value that differs from the fp32 default. (model_fields_set would
    # not do: a spec re-parsed from its normalized form — as the worker and the sandbox get
    # it — marks every field as set, and the precision defaults would never apply.)
    defaults = VerifyOptions()
    given = {name for name in VerifyOptions.model_fields if getattr(spec.verify, name) != getattr(defaults, name)}
    # spec.verify is frozen: the precision's defaults go into a copy
    if spec.precision == "fp16":
        fp16 = {"atol": FP16_ATOL, "rtol": FP16_RTOL, "scale_atol": FP16_SCALE_ATOL, "min_cosine": FP16_MIN_COSINE}
        return Tolerances("fp16", spec.verify.model_copy(update={k: v for k, v in fp16.items() if k not in given}))
    if spec.precision == "int8":
        target = spec.quantization.target_cosine
        update: dict[str, float] = {}
        if target is not None:
            update["min_cosine"] = target
        elif "min_cosine" not in given:
            update["min_cosine"] = INT8_MIN_COSINE
        return Tolerances("int8", spec.verify.model_copy(update=update), min_top1=INT8_MIN_TOP1 if real_data else None,
                          judge_abs_diff=False)
    return Tolerances("fp32", spec.verify.model_copy())


class PrecisionComparison:
    """Per-sample metrics for `verify_artifacts(compare=..., finish=...)` under a precision's tolerances."""

    def __init__(self, tol: Tolerances) -> None:
        self.tol = tol

    def __call__(self, ref: list[np.ndarray], got: list[np.ndarray], opts: VerifyOptions,
                 layout: OutputLayout | None = None) -> dict[str, Any]:
        m = compare_outputs(ref, got, self.tol.options, layout)
        if "error" in m:
            return m
        if not self.tol.judge_abs_diff:  # cosine only; detection groups keep their pairing verdict
            for entry in m["outputs"]:
                if entry["compared_as"] == ELEMENTWISE:
                    entry["passed"] = entry["cosine"] >= self.tol.options.min_cosine
            m["passed"] = all(entry["passed"] for entry in m["outputs"])
            self._cosine_only_mismatch(m)
        same = rows = 0
        for entry, a, b in zip(m["outputs"], ref, got):
            if entry["compared_as"] != ELEMENTWISE:
                continue
            if a.ndim == 2 and a.shape[-1] >= 2 and np.issubdtype(a.dtype, np.floating):
                same += int((a.argmax(-1) == b.argmax(-1)).sum())
                rows += int(a.shape[0])
        m["top1_same"], m["top1_rows"] = same, rows
        return m

    def _cosine_only_mismatch(self, m: dict[str, Any]) -> None:
        """The failure text when the absolute difference is reported, not judged."""
        detections_failed = any(not e["passed"] and e["compared_as"] != ELEMENTWISE for e in m["outputs"])
        reasons = [f"{e['name']}: cosine={e['cosine']:.6f} < {self.tol.options.min_cosine}"
                   for e in m["outputs"] if not e["passed"] and e["compared_as"] == ELEMENTWISE]
        if detections_failed and m.get("mismatch"):
            reasons.append(m["mismatch"])
        if reasons:
            m["mismatch"] = "; ".join(reasons)
        else:
            m.pop("mismatch", None)

    def finish(self, record: dict[str, Any]) -> None:
        """Aggregate top-1 agreement over all samples, then judge it (a per-sample top-1 of a batch of 1 is 0 or 1)."""
        rows = record.pop("top1_rows", 0)
        same = record.pop("top1_same", 0)
        record["tolerances"] = self.tol.as_dict()
        if rows:
            record["top1_agreement"] = same / rows
            if self.tol.min_top1 is not None and record["top1_agreement"] < self.tol.min_top1:
                record["passed"] = False
                record.setdefault("error", f"top-1 agreement {record['top1_agreement']:.3f} < {self.tol.min_top1}")
