"""Compare every artifact's runner against the original eager model on the same inputs.

The rules (written up for users in docs/artifacts.md, "Verification"):
- element-wise outputs: |artifact - model| <= atol_eff + rtol * |model| on every element, with
  atol_eff = max(atol, scale_atol * max|model output|), and cosine >= min_cosine. Float32 rounding
  scales with the magnitude of what a layer sums, not with each element: an element near zero in
  an output whose others are near 500 carries the rounding of 500 (measured: 6-27 float32 ulps of
  max|output| between onnxruntime and eager, from a CNN to a ResNet-50-like; scale_atol 1e-5 is 84).
- detection outputs (boxes with scores, a data-dependent count): paired, see detections.py.
- an output the model returns as a constant (all zeros, one value, or empty) on every verification
  input cannot tell a right artifact from a wrong one: the verdict is "inconclusive", not "passed".

Each record keeps `passed` (false only for a mismatch: the readers that decide a job's fate use it)
and adds `verdict`: "passed" | "failed" | "inconclusive".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fxport.spec import VerifyOptions
from fxport.workers.engine.verify import detections as det
from fxport.workers.engine.verify.runners import Runner

ELEMENTWISE = "elementwise"
TOLERANCE_RULE = "|artifact - model| <= max(atol, scale_atol * max|model output|) + rtol * |model|"


@dataclass
class SamplePoint:
    dims: dict[str, int]
    args: tuple[Any, ...]


@dataclass
class OutputLayout:
    """What the reference's flat outputs are: a name for each, and which form detection groups."""

    names: list[str]
    groups: list[det.DetectionGroup] = field(default_factory=list)

    @classmethod
    def plain(cls, count: int) -> OutputLayout:
        return cls([f"output_{i}" for i in range(count)])

    def group_of(self, index: int) -> det.DetectionGroup | None:
        return next((g for g in self.groups if index in g.members), None)

    def describe(self) -> list[dict[str, Any]]:
        """How each output is compared, for the manifest."""
        out = []
        for i, name in enumerate(self.names):
            group = self.group_of(i)
            how = ELEMENTWISE if group is None else "detections"
            entry: dict[str, Any] = {"output": i, "name": name, "compared_as": how}
            if group is not None:
                entry.update(role=group.role(i), group=group.describe(), rule=det.HOW)
            else:
                entry["rule"] = TOLERANCE_RULE + ", and cosine >= min_cosine"
            out.append(entry)
        return out


def plan_outputs(expected: list[list[np.ndarray]], paths: list[str] | None,
                 names: Sequence[str] | None = None) -> OutputLayout:
    """The layout of the reference outputs over every sample. `names`: the spec's output names
    (spec.outputs), else `output_<i>` with the leaf's place in the model's return value."""
    count = len(expected[0]) if expected else 0
    if names is not None and len(names) == count:
        labels = list(names)
    else:
        labels = [f"output_{i}" + (f" {p}" if p else "") for i, p in
                  enumerate(paths if paths is not None and len(paths) == count else [""] * count)]
    return OutputLayout(labels, det.find_detection_groups(expected, paths))


def effective_atol(ref: np.ndarray, opts: VerifyOptions) -> float:
    """max(atol, scale_atol * max|ref|) over the finite elements of one output of one sample."""
    finite = ref[np.isfinite(ref)] if ref.dtype.kind == "f" else ref
    scale = float(np.abs(finite.astype(np.float64)).max()) if finite.size else 0.0
    return max(opts.atol, opts.scale_atol * scale)


class _Uncomparable(Exception):
    """The artifact's output cannot be compared with the model's at all (count, shape, NaN)."""


def compare_outputs(ref: list[np.ndarray], got: list[np.ndarray], opts: VerifyOptions,
                    layout: OutputLayout | None = None) -> dict[str, Any]:
    """Metrics over all output leaves of one sample; `passed` needs every output within tolerance and
    cosine >= min_cosine (detection groups: every detection paired, pairs within tolerance).
    `mismatch` says, for a failure, which output and by how much."""
    if len(ref) != len(got):
        return {"passed": False, "error": f"artifact returns {len(got)} outputs, the model {len(ref)}"}
    layout = layout if layout is not None and len(layout.names) == len(ref) else OutputLayout.plain(len(ref))
    entries: dict[int, dict[str, Any]] = {}
    reasons: list[str] = []
    try:
        for group in layout.groups:
            entries.update(_compare_group(group, ref, got, opts, layout.names, reasons))
        for i, (a, b) in enumerate(zip(ref, got)):
            if i not in entries:
                entries[i] = _compare_elementwise(i, a, b, opts, layout.names[i], reasons)
    except (_Uncomparable, det.DetectionMismatch) as exc:
        return {"passed": False, "error": str(exc)}
    per_output = [entries[i] for i in range(len(ref))]
    result: dict[str, Any] = {
        "passed": all(o["passed"] for o in per_output),
        "max_abs_diff": max((o["max_abs_diff"] for o in per_output), default=0.0),
        "max_rel_diff": max((o["max_rel_diff"] for o in per_output), default=0.0),
        "cosine": min((o["cosine"] for o in per_output), default=1.0),
        "outputs": per_output,
    }
    if reasons:
        result["mismatch"] = "; ".join(reasons)
    return result


def _finite_pair(name: str, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    a64, b64 = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    if a64.size and not np.isfinite(a64).any():
        # An all-NaN/Inf reference "matches" anything that is equally broken: nothing to verify.
        raise _Uncomparable(f"the original model's {name} is entirely NaN/Inf on the verification inputs (are its "
                            "weights NaN or Inf?); there is nothing to compare the artifact against")
    if np.isfinite(a64).all() and np.isfinite(b64).all():
        return a64, b64
    same_nonfinite = np.array_equal(np.isnan(a64), np.isnan(b64)) and np.array_equal(
        np.where(np.isinf(a64), a64, 0), np.where(np.isinf(b64), b64, 0))
    if not same_nonfinite:
        raise _Uncomparable(f"{name} has NaN/Inf where the model's does not")
    mask = np.isfinite(a64)
    return a64[mask], b64[mask]


def _metrics(a64: np.ndarray, b64: np.ndarray, atol: float, opts: VerifyOptions) -> dict[str, Any]:
    diff = np.abs(a64 - b64)
    max_abs = float(diff.max()) if diff.size else 0.0
    max_rel = float((diff / np.maximum(np.abs(a64), 1e-12)).max()) if diff.size else 0.0
    na, nb = np.linalg.norm(a64), np.linalg.norm(b64)
    cos = float(np.dot(a64, b64) / (na * nb)) if na > 0 and nb > 0 else (1.0 if na == nb else 0.0)
    outside = int((diff > atol + opts.rtol * np.abs(a64)).sum())
    return {"max_abs_diff": max_abs, "max_rel_diff": max_rel, "cosine": cos, "outside": outside,
            "elements": int(diff.size)}


def _compare_elementwise(i: int, a: np.ndarray, b: np.ndarray, opts: VerifyOptions, name: str,
                         reasons: list[str]) -> dict[str, Any]:
    if a.shape != b.shape:
        hint = ""
        if a.ndim and b.ndim and a.shape[1:] == b.shape[1:]:
            hint = (" (its leading dim depends on the data? fxport pairs such outputs as detections when the "
                    "model returns them as a dict with 'boxes' and 'scores', or a tuple of boxes [N, 4] and "
                    "scores [N])")
        raise _Uncomparable(f"{name} has shape {list(b.shape)}, the model's {list(a.shape)}{hint}")
    a64, b64 = _finite_pair(name, a, b)
    atol = effective_atol(a, opts)
    m = _metrics(a64, b64, atol, opts)
    ok = m["outside"] == 0 and m["cosine"] >= opts.min_cosine
    if not ok:
        reasons.append(_elementwise_reason(name, m, atol, opts))
    return {"output": i, "name": name, "compared_as": ELEMENTWISE, "max_abs_diff": m["max_abs_diff"],
            "max_rel_diff": m["max_rel_diff"], "cosine": m["cosine"], "passed": ok,
            "atol_effective": atol, "ref_max_abs": _max_abs(a64)}


def _elementwise_reason(name: str, m: dict[str, Any], atol: float, opts: VerifyOptions) -> str:
    parts = []
    if m["outside"]:
        parts.append(f"{m['outside']} of {m['elements']} elements beyond {atol:.3g} + {opts.rtol:g}*|model| "
                     f"(max_abs_diff={m['max_abs_diff']:.3g})")
    if m["cosine"] < opts.min_cosine:
        parts.append(f"cosine={m['cosine']:.6f} < {opts.min_cosine}")
    return f"{name}: " + ", ".join(parts)


def _max_abs(values: np.ndarray) -> float:
    return float(np.abs(values).max()) if values.size else 0.0


def _compare_group(group: det.DetectionGroup, ref: list[np.ndarray], got: list[np.ndarray], opts: VerifyOptions,
                   names: list[str], reasons: list[str]) -> dict[int, dict[str, Any]]:
    """One entry per member leaf of a detection group: its paired rows' metrics and the counts."""
    det.check_shapes(group, ref, got, names)
    labels = (ref[group.labels], got[group.labels]) if group.labels is not None else (None, None)
    pairs = det.pair_detections(ref[group.boxes], ref[group.scores], got[group.boxes], got[group.scores], *labels)
    rows_ref, rows_got = len(ref[group.scores]), len(got[group.scores])
    unmatched = (rows_ref - len(pairs)) + (rows_got - len(pairs))
    counts_ok = unmatched <= opts.max_unmatched_detections
    if unmatched:
        reasons.append(det.unmatched_text(group, ref[group.scores], got[group.scores], pairs)
                       + ("" if counts_ok else f" (verify.max_unmatched_detections={opts.max_unmatched_detections})"))
    ri = np.array([i for i, _ in pairs], dtype=np.int64)
    gi = np.array([j for _, j in pairs], dtype=np.int64)
    entries = {}
    for index in group.members:
        a, b = ref[index][ri], got[index][gi]
        a64, b64 = _finite_pair(names[index], a, b)
        atol = effective_atol(ref[index], opts)
        m = _metrics(a64, b64, atol, opts)
        # labels pair by equality, so their cosine says nothing; boxes and scores are judged by it
        ok = m["outside"] == 0 and (m["cosine"] >= opts.min_cosine or index == group.labels)
        if not ok:
            reasons.append(_elementwise_reason(f"{names[index]} ({len(pairs)} paired detections)", m, atol, opts))
        entries[index] = {
            "output": index, "name": names[index], "compared_as": "detections", "role": group.role(index),
            "max_abs_diff": m["max_abs_diff"], "max_rel_diff": m["max_rel_diff"], "cosine": m["cosine"],
            "passed": ok and counts_ok, "atol_effective": atol, "ref_max_abs": _max_abs(ref[index].astype(np.float64)),
            "count_model": rows_ref, "count_artifact": rows_got, "paired": len(pairs), "unmatched": unmatched,
        }
    return entries


def constant_outputs(expected: list[list[np.ndarray]], layout: OutputLayout) -> dict[int, str]:
    """Outputs that are one and the same value on every verification input (or empty on every
    one), keyed by index, each with what it is. Any artifact returning that value matches them, so
    their comparison proves nothing. A detection group counts as one: it is constant when no input
    gave a single detection (its labels all being one class is fine: they are paired, not trusted)."""
    if not expected:
        return {}
    found: dict[int, str] = {}
    for group in layout.groups:
        if all(sample[group.boxes].shape[0] == 0 for sample in expected):
            found.update({i: "empty (not one detection)" for i in group.members})
    for i in range(len(expected[0])):
        if layout.group_of(i) is not None:
            continue
        values = np.concatenate([np.asarray(sample[i], dtype=np.float64).ravel() for sample in expected])
        if values.size == 0:
            found[i] = "empty"
        elif np.all(values == values[0]) or np.all(np.isnan(values)):
            found[i] = "all zeros" if values[0] == 0 else f"the constant {values[0]:g}"
    return found


def _merge_outputs(worst: list[dict[str, Any]], sample: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per output, the worst of each metric over the samples seen so far (detection counts: summed)."""
    by_name = {w["name"]: w for w in worst}
    for o in sample:
        w = by_name.get(o["name"])
        if w is None:  # an output only some samples have (one dict per image: a bigger batch has more)
            worst.append(dict(o))
            continue
        for key in ("max_abs_diff", "max_rel_diff", "atol_effective", "ref_max_abs"):
            if key in o:
                w[key] = max(w.get(key, 0.0), o[key])
        for key in ("count_model", "count_artifact", "paired", "unmatched"):
            if key in o:
                w[key] = w.get(key, 0) + o[key]
        w["cosine"] = min(w["cosine"], o["cosine"])
        w["passed"] = w["passed"] and o["passed"]
    return worst


def tolerance_record(opts: VerifyOptions) -> dict[str, Any]:
    """The tolerances in effect, for the manifest (reduced precision: precision.Tolerances.as_dict)."""
    return {"precision": "fp32", "atol": opts.atol, "rtol": opts.rtol, "scale_atol": opts.scale_atol,
            "min_cosine": opts.min_cosine, "max_unmatched_detections": opts.max_unmatched_detections,
            "rule": TOLERANCE_RULE}


def verify_artifacts(
    reference: Runner,
    runners: list[Runner],
    points: list[SamplePoint],
    opts: VerifyOptions,
    on_runner: Callable[[str], None] | None = None,
    *,
    compare: Callable[..., dict[str, Any]] | None = None,
    finish: Callable[[dict[str, Any]], None] | None = None,
    output_names: Sequence[str] | None = None,
) -> list[dict[str, Any]]:
    """One record per runner: worst metrics across all sample points, every shape checked, how
    each output was compared, and the verdict.

    `compare(ref, got, opts, layout)` replaces `compare_outputs` (reduced-precision artifacts are
    judged differently); counters it returns (`top1_same`, `top1_rows`) are summed over samples,
    and `finish` sees each record last, to judge what only the totals show. `output_names`: the
    spec's names for the flattened outputs, used in the manifest and in messages.
    """
    compare = compare or compare_outputs
    expected, paths = [], []
    with reference:
        for point in points:
            expected.append(reference.infer(point.args))
            paths.append(getattr(reference, "output_paths", None))
    layouts, constant = _plan_by_structure(expected, paths, output_names)
    records = []
    for runner in runners:
        if on_runner:
            on_runner(runner.name)
        record = _verify_one(runner, points, expected, opts, compare, layouts)
        if finish:
            finish(record)
        _give_verdict(record, constant)
        records.append(record)
    return records


def _plan_by_structure(expected: list[list[np.ndarray]], paths: list[list[str] | None],
                       output_names: Sequence[str] | None) -> tuple[list[OutputLayout], dict[str, str]]:
    """A layout per sample, and the constant outputs by name. Samples are planned together when the
    model returned the same number of leaves for them; a model that returns one dict per image
    returns more leaves for a bigger batch, and those samples are planned on their own."""
    by_count: dict[int, list[int]] = {}
    for n, outputs in enumerate(expected):
        by_count.setdefault(len(outputs), []).append(n)
    layouts: list[OutputLayout] = [OutputLayout([])] * len(expected)
    constant: dict[str, str] = {}
    for members in by_count.values():
        samples = [expected[n] for n in members]
        layout = plan_outputs(samples, paths[members[0]], output_names)
        for n in members:
            layouts[n] = layout
        constant.update({layout.names[i]: why for i, why in constant_outputs(samples, layout).items()})
    return layouts, constant


def _verify_one(runner: Runner, points: list[SamplePoint], expected: list[list[np.ndarray]], opts: VerifyOptions,
                compare: Callable[..., dict[str, Any]], layouts: list[OutputLayout]) -> dict[str, Any]:
    record: dict[str, Any] = {
        "format": runner.name, "runtime": runner.runtime, "max_abs_diff": 0.0, "max_rel_diff": 0.0,
        "cosine": 1.0, "passed": True, "shapes_checked": [], "samples": len(points),
        "tolerances": tolerance_record(opts), "comparison": layouts[0].describe() if layouts else [],
    }
    try:
        with runner:
            for n, (point, ref, layout) in enumerate(zip(points, expected, layouts)):
                got = runner.infer(point.args)
                m = compare(ref, got, opts, layout)
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
                if not m["passed"] and m.get("mismatch") and "error" not in record:
                    record["error"] = f"{m['mismatch']} (sample {n + 1} of {len(points)}, input shape {shape})"
                if "outputs" in m:  # per output: the worst over every sample and shape
                    record["outputs"] = _merge_outputs(record.get("outputs", []), m["outputs"])
                for key in ("top1_same", "top1_rows"):
                    if key in m:
                        record[key] = record.get(key, 0) + m[key]
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        record.update(passed=False, error=f"{type(exc).__name__}: {first}")
    return record


def _give_verdict(record: dict[str, Any], constant: dict[str, str]) -> None:
    """passed / failed / inconclusive. Inconclusive: nothing mismatched, but some output is a constant
    of the model on every input (`constant`: output name → what it is), so it would have matched a
    wrong artifact as well."""
    for entry in record.get("outputs", []):
        entry["verdict"] = ("failed" if not entry["passed"] else
                            "inconclusive" if entry["name"] in constant else "passed")
    if not record["passed"]:
        record["verdict"] = "failed"
    elif constant:
        record["verdict"] = "inconclusive"
        record["inconclusive"] = [{"output": name, "reference": why} for name, why in constant.items()]
    else:
        record["verdict"] = "passed"


def inconclusive_warnings(records: list[dict[str, Any]]) -> list[str]:
    """One warning per constant output, naming it and the artifacts whose verdict it made inconclusive."""
    by_output: dict[tuple[str, str], list[str]] = {}
    for record in records:
        for item in record.get("inconclusive", []):
            by_output.setdefault((item["output"], item["reference"]), []).append(record["format"])
    return [
        f"verification of {', '.join(formats)} is inconclusive: the original model's output {output!r} is {reference} "
        "on every verification input, so an artifact that computes something else could match it just as well. "
        "Convert the model with its trained weights (zero or untrained weights give constants), and check that "
        "random normal inputs reach that output (a model that needs real images, token ids in range or a mask may "
        "not); if the output is meant to be constant, this warning can be ignored"
        for (output, reference), formats in by_output.items()
    ]
