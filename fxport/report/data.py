"""What each section of report.html shows, read from the typed manifest.

One function per section turns a `Manifest` into the values its template prints
(templates/sections/<id>.html.j2): text, numbers already formatted, rows. Nothing here writes HTML:
the templates escape every value (autoescape), and only the SVG of a chart or a graph drawing
arrives as markup (fxport/report/charts.py, graph.py). A function returns None when its section
does not apply to the job (no profile, not int8, no error, ...).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fxport.benchmark import rate, speedups
from fxport.manifest import Manifest, TensorSignature, VerificationRecord
from fxport.manifest_sections import BenchmarkRow, BenchmarkSettings, Machine
from fxport.report.charts import Chart, bar_chart, grouped_bar_chart, series_colour
from fxport.report.graph import DotLayout, graph_view, short_target

# Page order: what a reader checks first (did it work, does it match, where does time go) comes first.
SECTIONS = (
    ("error", "Error"),
    ("overview", "Overview"),
    ("warnings", "Warnings"),
    ("parity", "Parity"),
    ("benchmark", "Benchmark"),
    ("profile", "Profile"),
    ("quantization", "Quantization"),
    ("capture", "Capture"),
    ("passes", "Passes"),
    ("graph", "Graph"),
    ("artifacts", "Artifacts"),
    ("input", "Input"),
    ("toolchain", "Toolchain"),
    ("spec", "Spec"),
    ("timings", "Timings"),
)

# The manifest field each section shows: when the manifest's was unreadable, the section says so.
SECTION_FIELDS = {"error": ("error",), "warnings": ("warnings",), "parity": ("verification",),
                  "benchmark": ("benchmark",), "profile": ("profile",), "quantization": ("quantization",),
                  "capture": ("capture",), "passes": ("passes",), "graph": ("graph_before", "graph_after"),
                  "artifacts": ("artifacts",), "input": ("input", "inputs", "outputs", "signature"),
                  "toolchain": ("toolchain",), "spec": ("spec",), "timings": ("timings_s",)}

View = dict[str, Any]


@dataclass
class Badge:
    status: str  # passed, failed, succeeded, ...: the colour
    text: str


def views(layout: DotLayout) -> dict[str, Callable[[Manifest], View | None]]:
    """The view builder of every section id."""
    return {"error": error, "overview": overview, "warnings": warnings, "parity": parity, "benchmark": benchmark,
            "profile": profile, "quantization": quantization, "capture": capture, "passes": passes,
            "graph": lambda m: graph(m, layout), "artifacts": artifacts, "input": input_, "toolchain": toolchain,
            "spec": spec, "timings": timings}


# ---------------------------------------------------------------- the job


def error(m: Manifest) -> View | None:
    if m.error is None:
        return None
    written = m.error.model_dump()
    return {"stage": m.error.stage or "an unknown stage", "message": m.error.message,
            "rows": [(k, v) for k, v in written.items() if v not in (None, "")]}


def overview(m: Manifest) -> View:
    verdicts = [verdict(v) for v in m.verification]
    passed, inconclusive = verdicts.count("passed"), verdicts.count("inconclusive")
    parity_badge = None
    if verdicts:
        parity_badge = Badge(parity_status(passed, inconclusive, len(verdicts)),
                             f"{passed}/{len(verdicts)} passed" + (f", {inconclusive} inconclusive"
                                                                    if inconclusive else ""))
    total_s = sum(float(v) for v in m.timings_s.values())
    cards: list[tuple[str, str | Badge | None]] = [
        ("status", Badge(status_of(m), status_of(m))),
        ("input format", m.input.format or "?"),
        ("input size", human_bytes(m.input.bytes)),
        ("precision", str(m.spec.get("precision") or "?")),
        ("targets", ", ".join(str(t) for t in m.spec.get("targets") or []) or "none"),
        ("capture", (m.capture.method if m.capture else None) or "not reached"),
        ("artifacts", str(len({a.format for a in m.artifacts}))),
        ("parity", parity_badge),  # None: not run
        ("total time", f"{total_s:.2f} s"),
    ]
    pick = m.benchmark.recommendation if m.benchmark else None
    return {"cards": cards, "pick": pick}


def warnings(m: Manifest) -> View | None:
    return {"warnings": m.warnings} if m.warnings else None


def timings(m: Manifest) -> View | None:
    return {"rows": [(k, num(v, "{:.3f}")) for k, v in m.timings_s.items()]} if m.timings_s else None


def toolchain(m: Manifest) -> View:
    return {"rows": [(name, _version_text(value)) for name, value in m.toolchain.items()]}


def _version_text(value: Any) -> str | None:
    """A toolchain entry as text: a version as it is; a list of records (the op libraries a
    worker loads: {"library", "sha256"} or {"module", "version"}) separated by "; ", without quotes."""
    if isinstance(value, list):
        items = [" ".join(str(v) for v in item.values()) if isinstance(item, dict) else str(item) for item in value]
        return "; ".join(items) or None
    return None if value is None or value == "" else str(value)


def spec(m: Manifest) -> View:
    return {"rows": flat(m.spec), "json": json.dumps(m.spec, indent=2, default=str)}


def flat(value: Any, prefix: str = "") -> list[tuple[str, str]]:
    """A spec as rows a person reads: nested keys dotted (`verify.atol`), a list of scalars
    comma-joined, a list of mappings (inputs, passes) one row per item, an empty value "—"."""
    if isinstance(value, dict) and value:
        return [row for k, v in value.items() for row in flat(v, f"{prefix}.{k}" if prefix else str(k))]
    if isinstance(value, list) and value and any(isinstance(v, dict) for v in value):
        return [row for i, v in enumerate(value) for row in flat(v, f"{prefix}[{i}]")]
    if isinstance(value, list):
        return [(prefix, ", ".join(str(v) for v in value) or "—")]
    return [(prefix, "—" if value is None or value == {} else str(value))]


def input_(m: Manifest) -> View:
    legacy = m.inputs or {}  # the signature as written before `signature` (schema 3)
    inputs = [TensorSignature.model_validate(i) for i in legacy.get("inputs") or []]
    outputs = [TensorSignature.model_validate(o) for o in (m.outputs or []) if isinstance(o, dict)] \
        if inputs else []
    dims = legacy.get("dynamic_dims") or {}
    return {"input": m.input, "size": human_bytes(m.input.bytes),
            "signature": [("input", t.name, shape_text(t.shape), t.dtype) for t in inputs]
            + [("output", t.name, shape_text(t.shape) if t.shape is not None else None, t.dtype) for t in outputs],
            "batch_note": m.signature.batch.note if m.signature else "",
            "dims": [(name, [num(rng.get(b)) for b in ("min", "opt", "max")]) for name, rng in dims.items()]}


# ---------------------------------------------------------------- conversion


def capture(m: Manifest) -> View:
    if m.capture is None:
        return {"captured": None}
    attempts = m.capture.attempts
    strictness = {True: " (strict)", False: " (non-strict)", None: ""}
    rows = [{"rung": i, "method": (a.method or "?") + strictness[a.strict], "ok": a.ok, "why": a.error or a.note or "",
             "source_line": a.source_line} for i, a in enumerate(attempts, 1)]
    worked = next((i for i, a in enumerate(attempts, 1) if a.ok), None)
    return {"captured": m.capture, "rows": rows, "worked": worked, "rungs": len(attempts)}


def passes(m: Manifest) -> View:
    rows = [{"name": p.name, "applied": "yes" if p.applied else "no", "changed": p.changed, "notes": p.notes,
             "seconds": num(p.seconds, "{:.4f}")} for p in m.passes]
    counts = None
    before, after = m.graph_before, m.graph_after
    if before and after:
        b_counts, a_counts = before.op_counts, after.op_counts
        targets = sorted(set(b_counts) | set(a_counts), key=lambda t: (-(b_counts.get(t, 0)), t))
        counts = {"before": before.node_count, "after": after.node_count,
                  "rows": [(t, b_counts.get(t, 0), a_counts.get(t, 0)) for t in targets]}
    return {"rows": rows, "counts": counts}


def graph(m: Manifest, layout: DotLayout) -> View:
    timed_out: set[str] = set()  # graph_after is often graph_before: a layout out of time is tried once
    graphs = [graph_view(key.replace("_", "-"), title, g, layout, timed_out)
              for key, title, g in (("graph_before", "Before passes", m.graph_before),
                                    ("graph_after", "After passes", m.graph_after)) if g]
    return {"graphs": graphs}


def artifacts(m: Manifest) -> View:
    return {"artifacts": [(a, human_bytes(a.bytes)) for a in m.artifacts],
            "total": human_bytes(sum(a.bytes for a in m.artifacts))}


# ---------------------------------------------------------------- checks and measurements


def parity(m: Manifest) -> View:
    rows = []
    for r in m.verification:
        # The comparator keeps each artifact's worst case over every shape it checked: one row per
        # artifact, its shapes listed. A per-shape breakdown ("per_shape") gets one row per shape.
        for s in r.per_shape or [{**r.model_dump(), "shapes": r.shapes_checked}]:
            v = s.get("verdict") or ("passed" if s.get("passed") else "failed")
            shapes = s["shapes"] if "shapes" in s else [s.get("shape")]
            rows.append({"format": r.format, "runtime": r.runtime, "ok": v != "failed",
                         "shapes": [shape_text(x) for x in shapes if x is not None],
                         "max_abs": num(s.get("max_abs_diff"), "{:.3g}"),
                         "max_rel": num(s.get("max_rel_diff"), "{:.3g}"), "cosine": num(s.get("cosine"), "{:.8f}"),
                         "result": {"passed": "pass", "failed": "FAIL"}.get(v, v), "error": s.get("error") or r.error})
    samples = m.verification[0].samples if m.verification else None
    return {"rows": rows, "tolerances": tolerance_lines(m.verification, m.spec.get("verify") or {}),
            "samples": samples}


def tolerance_lines(records: list[VerificationRecord], spec_tol: dict[str, Any]) -> list[str]:
    """The tolerances each verdict used (a record's own: fp16 and int8 ones differ from the
    spec's fp32 defaults), once when every artifact used the same, else per artifact."""
    groups: dict[str, tuple[dict[str, Any], list[str]]] = {}
    for r in records:
        tol = r.tolerances if isinstance(r.tolerances, dict) else spec_tol
        if not tol:
            continue
        key = json.dumps(tol, sort_keys=True, default=str)
        groups.setdefault(key, (tol, []))[1].append(f"{r.format} ({r.runtime})")
    lines = []
    for tol, names in groups.values():
        precision = f" ({tol['precision']})" if tol.get("precision") else ""
        who = "" if len(groups) == 1 else f"{', '.join(names)}: "
        lines.append(f"{who}tolerances{precision}: {_tolerances_text(tol)}")
    return lines


def _tolerances_text(tol: dict[str, Any]) -> str:
    parts = [f"{name}={tol[name]}" for name in ("atol", "rtol") if tol.get(name) is not None]
    if tol.get("scale_atol") is not None:
        parts.append(f"scale_atol={tol['scale_atol']} (× the output's largest magnitude)")
    parts.append(f"min cosine={_text(tol.get('min_cosine'))}")
    if tol.get("min_top1_agreement") is not None:
        parts.append(f"min top-1 agreement={tol['min_top1_agreement']}")
    if tol.get("atol") is None:  # int8: judged on cosine (and top-1) alone
        parts.append("abs and rel diffs shown, not judged")
    return ", ".join(parts) + (f"; rule: {tol['rule']}" if tol.get("rule") else "")


def benchmark(m: Manifest) -> View | None:
    bench = m.benchmark
    if not bench:
        return None
    up = speedups(bench.as_dict()["results"]) if bench.results else {}
    rows = sorted(bench.results, key=lambda r: (r.artifact != "eager", r.artifact, r.batch))
    worst = bench.noise.worst if bench.noise and bench.noise.noisy else None
    return {"bench": bench, "machine": bench.machine or Machine(), "settings": bench.settings or BenchmarkSettings(),
            "unclear": "; ".join(u.reason for u in bench.no_clear_winner),
            "noisy": {"row": worst, "rounds": ", ".join(f"{x:.3g}" for x in worst.round_p50_ms or [])}
            if worst else None,
            "charts": _benchmark_charts(rows, up),
            "rows": [_benchmark_row(r, up.get((r.artifact, r.batch))) for r in rows]}


def _benchmark_row(r: BenchmarkRow, speedup: float | None) -> View:
    p50, p50_range = _p50(r)
    return {"r": r, "p50": p50, "range": p50_range, "p95": num(r.p95_ms, "{:.4g}"), "mean": num(r.mean_ms, "{:.4g}"),
            "throughput": rate(r.throughput_per_s) if r.throughput_per_s is not None else "",
            "speedup": num(speedup, "{:.2f}×"), "memory": num(r.memory_mib, "{:.0f} MiB")}


def _p50(r: BenchmarkRow) -> tuple[str, tuple[str, str] | None]:
    """The p50, and the range of the rounds' medians when there were several that differ."""
    lo_hi = r.p50_range_ms
    if not lo_hi or len(lo_hi) < 2 or lo_hi[0] == lo_hi[1] or r.p50_ms is None:
        return num(r.p50_ms, "{:.4g}"), None
    return format(float(r.p50_ms), ".4g"), (format(float(lo_hi[0]), ".3g"), format(float(lo_hi[1]), ".3g"))


def _benchmark_charts(rows: list[BenchmarkRow], up: dict[tuple[str, int], float]) -> View:
    """One small latency chart per batch, each on its own scale (batch 1 and batch 64 differ too much to
    share one), and the speed-ups over eager grouped by batch on a log scale (one noisy outlier, 223×,
    otherwise flattens every other bar)."""
    batches = sorted({r.batch for r in rows})
    names = list(dict.fromkeys(r.artifact for r in rows))
    by = {(r.artifact, r.batch): r for r in rows}
    latency = []
    for b in batches:
        at = [a for a in names if (a, b) in by]
        latency.append(bar_chart(f"benchmark-latency-{b}", at,
                                 [{"value": by[(a, b)].p50_ms, "color": series_colour(names, a)} for a in at],
                                 horizontal=False, title=f"batch {b}", value_fmt="{:.3g} ms", size=(340, 320)))
    series = {a: [up.get((a, b)) if (a, b) in by else None for b in batches] for a in names}  # eager too, at 1×
    speedup: Chart | None = None
    if any(v is not None for vs in series.values() for v in vs):
        speedup = grouped_bar_chart("benchmark-speedup", [f"batch {b}" for b in batches], series,
                                    title="Speed-up over eager (× eager p50, log scale)", value_fmt="{:.2f}×",
                                    logarithmic=True)
    return {"latency": latency, "speedup": speedup}


def profile(m: Manifest) -> View | None:
    prof = m.profile
    if not prof or not prof.top_nodes:
        return None
    top = prof.top_nodes
    labels = [f"{n.node} ({short_target(n.op)})" for n in top]
    values = [float(n.ms or 0.0) for n in top]
    # pygal draws a horizontal chart's first bar at the bottom: reverse so the slowest node is on top.
    chart = bar_chart("profile-chart", labels[::-1], [{"value": v} for v in values[::-1]], horizontal=True,
                      title="Top nodes by time (ms per run)", value_fmt="{:.3f} ms")
    rows = [(n.node, n.op, num(n.ms, "{:.4f}"), num(100 * float(n.share or 0), "{:.1f}%")) for n in top]
    return {"count": len(top), "total_ms": prof.total_ms, "chart": chart, "rows": rows}


def quantization(m: Manifest) -> View | None:
    quant = m.quantization
    if not quant or not quant.layers:
        return None
    layers = quant.layers
    labels = [f"{layer.node}{' (fallback)' if layer.fallback else ''}" for layer in layers]
    values = [{"value": float(layer.sqnr_db or 0.0), "color": "#d93025" if layer.fallback else "#1a73e8"}
              for layer in layers]
    chart = bar_chart("sqnr-chart", labels, values, horizontal=False, title="Per-layer SQNR (dB, higher is better)",
                      value_fmt="{:.1f} dB")
    schemes = [{"runtime": rt, "first": rt == quant.runtime, "activations": r.scheme.activations if r.scheme else None,
                "cosine": fmt_number(r.end_to_end.cosine if r.end_to_end else None, "{:.5f}"),
                "fp32_layers": len(r.fallback_layers)} for rt, r in quant.schemes.items()]
    rows = [(layer, num(layer.sqnr_db, "{:.2f}"), num(layer.cosine, "{:.6f}")) for layer in layers]
    return {"schemes": schemes, "layers": len(layers), "fallbacks": sum(1 for layer in layers if layer.fallback),
            "chart": chart, "rows": rows}


# ---------------------------------------------------------------- small helpers


def status_of(m: Manifest) -> str:
    """The job's status as written; "unknown" where the manifest has none."""
    return m.status if "status" in m.model_fields_set else "unknown"


def verdict(record: VerificationRecord) -> str:
    """passed / failed / inconclusive; a record written before verdicts has only `passed`."""
    return record.verdict or ("passed" if record.passed else "failed")


def parity_status(passed: int, inconclusive: int, total: int) -> str:
    if passed == total:
        return "passed"
    return "inconclusive" if passed + inconclusive == total else "failed"


def badge_class(status: str) -> str:
    return {"succeeded": "ok", "passed": "ok", "failed": "fail", "cancelled": "fail"}.get(status, "neutral")


def num(value: Any, fmt: str = "{}") -> str:
    """A number cell's text: `value` formatted (as it is where `fmt` does not apply), "" for none."""
    if value is None or value == "":
        return ""
    try:
        return fmt.format(value)
    except (ValueError, TypeError):
        return str(value)


def fmt_number(value: Any, fmt: str) -> str:
    return fmt.format(value) if isinstance(value, (int, float)) else "–"


def _text(value: Any) -> str:
    return "" if value is None else str(value)


def shape_text(shape: Any) -> str:
    if isinstance(shape, list):
        return "[" + ", ".join(shape_text(s) if isinstance(s, list) else str(s) for s in shape) + "]"
    return str(shape)


def human_bytes(n: Any) -> str:
    try:
        size = float(n)
    except (TypeError, ValueError):
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"

