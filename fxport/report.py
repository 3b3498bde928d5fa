"""Render a job's manifest.json as one self-contained report.html (no torch, no onnx: the thin client uses it).

The report is built from the manifest alone, so `fxport report manifest.json` regenerates it
anywhere. Everything is inline (CSS, SVG charts, the SVG graph drawing); a Content-Security-Policy
forbids every fetch and every script, so the page cannot reach the network even if a string in
the manifest were hostile. Every manifest string goes through `html.escape`; chart and graph
SVG come from libraries that escape their own text (pygal via etree, Graphviz's SVG writer).

Libraries, both optional at run time so the report never crashes for lack of them:
- pygal (pure Python) draws the bar charts as SVG;
- the `graphviz` package writes DOT and Graphviz's `dot` binary lays out the FX graph.
A missing one leaves a note in its section and the tables still render.

Who runs `dot` is the caller's choice (`layout`): by default a plain subprocess; a worker passes
one confined like its sandbox (fxport/workers/sandbox/confine.py `confined_dot`), since the
sandboxed engine itself may not start processes. Layouts are remembered by the sha256 of the
DOT source: the same architecture (new weights, a rerun, graph_after == graph_before when no
pass changed anything) is laid out once per process.
"""

from __future__ import annotations

import hashlib
import html
import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import Any

# DOT source → SVG bytes; raises FileNotFoundError when there is no `dot` to run.
DotLayout = Callable[[bytes], bytes]

# Graph diagrams with more boxes (non-get_attr nodes) than this start collapsed;
# past MAX_DRAWN_NODES boxes only the first ones are drawn.
COLLAPSE_ABOVE_NODES = 60
MAX_DRAWN_NODES = 300
# dot is deterministic and fast for MAX_DRAWN_NODES nodes; the limit guards against a wedged binary.
DOT_TIMEOUT_S = 60
LAYOUT_CACHE_ENTRIES = 64
# What one report draws at most, whatever the manifest holds (a worker draws the report from a
# manifest its sandboxed model could shape: a forged 1.8 MiB one once cost 96 s of a worker's CPU and
# a 181 MiB report.html): items of any list (table rows, chart bars, benchmark rows) and of any
# mapping, and characters of any string. A real conversion stays far below (a few dozen rows per
# table; the graph's nodes are drawn MAX_DRAWN_NODES at most anyway); what is cut is said at the top.
MAX_REPORT_ITEMS = 500
MAX_REPORT_CHARS = 2000
MAX_REPORT_BYTES = 32 << 20  # past this the page says only that, and manifest.json holds everything

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

CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"

CSS = """
:root { --ok:#1b7f3b; --ok-bg:#e3f4e8; --fail:#b3261e; --fail-bg:#fbe4e2; --muted:#5f6368; --line:#dadce0; }
* { box-sizing: border-box; }
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "Liberation Sans", sans-serif;
       margin: 0; color: #202124; background: #f6f7f9; }
header { background: #1f2937; color: #fff; padding: 16px 28px; }
header h1 { margin: 0 0 4px; font-size: 20px; }
header .sub { color: #cbd5e1; font-size: 13px; }
nav { background: #fff; border-bottom: 1px solid var(--line); padding: 8px 28px; position: sticky; top: 0; z-index: 2; }
nav a { margin-right: 14px; color: #1a56db; text-decoration: none; font-size: 13px; }
main { padding: 8px 28px 40px; max-width: 1400px; }
section { background: #fff; border: 1px solid var(--line); border-radius: 8px; padding: 14px 18px; margin: 14px 0; }
section h2 { margin: 0 0 10px; font-size: 17px; }
section h3 { margin: 14px 0 6px; font-size: 15px; }
table { border-collapse: collapse; margin: 6px 0; font-size: 13px; }
th, td { border: 1px solid var(--line); padding: 4px 8px; text-align: left; vertical-align: top; }
th { background: #f1f3f4; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
code, pre, .mono { font-family: ui-monospace, "DejaVu Sans Mono", "Liberation Mono", monospace; font-size: 12px; }
pre { background: #f8f9fa; border: 1px solid var(--line); padding: 8px; overflow: auto; max-height: 480px; }
.digest { word-break: break-all; }
.badge { display: inline-block; padding: 1px 8px; border-radius: 10px; font-weight: 600; font-size: 12px; }
.ok { color: var(--ok); background: var(--ok-bg); }
.fail { color: var(--fail); background: var(--fail-bg); }
.neutral { color: var(--muted); background: #eceff1; }
tr.ok td, tr.fail td { background: transparent; }
tr.ok td.status { color: var(--ok); background: var(--ok-bg); font-weight: 600; }
tr.fail td.status { color: var(--fail); background: var(--fail-bg); font-weight: 600; }
tr.fallback td { background: #fff4e5; }
.note { color: var(--muted); }
.missing { color: #8a5300; background: #fff4e5; border: 1px solid #f5c37a; padding: 6px 10px; border-radius: 6px; }
.error-box { border-color: var(--fail); background: var(--fail-bg); }
.error-box h2 { color: var(--fail); }
.cards { display: flex; flex-wrap: wrap; gap: 10px; }
.card { border: 1px solid var(--line); border-radius: 6px; padding: 8px 12px; min-width: 150px; }
.card .k { color: var(--muted); font-size: 12px; }
.card .v { font-size: 15px; font-weight: 600; }
.chart svg { max-width: 100%; height: auto; }
.charts { display: flex; flex-wrap: wrap; gap: 8px; }
.charts .chart { flex: 0 1 340px; }
.graph-svg { overflow: auto; max-height: 1600px; border: 1px solid var(--line); background: #fff; }
.graph-svg svg { max-width: 100%; height: auto; }
.graphs { display: flex; gap: 16px; flex-wrap: wrap; align-items: flex-start; }
.graphs > div { flex: 1 1 560px; min-width: 0; }
details > summary { cursor: pointer; color: #1a56db; margin: 6px 0; }
"""


def render_report(manifest: dict[str, Any], *, layout: DotLayout | None = None) -> str:
    """The whole report.html for `manifest` (a parsed manifest.json) as one string, drawn from at
    most MAX_REPORT_ITEMS items of each list and MAX_REPORT_CHARS characters of each string
    (`bounded`), and at most MAX_REPORT_BYTES long. `layout` runs `dot` (default: `run_dot`, a
    plain subprocess)."""
    cut: list[str] = []
    manifest = bounded(manifest, cut)
    page = _render(manifest, cut, layout)
    if len(page) > MAX_REPORT_BYTES:
        cut = [f"the report came to {len(page) >> 20} MiB, past the {MAX_REPORT_BYTES >> 20} MiB a report may take"]
        page = _render({k: manifest.get(k) for k in ("job_id", "status", "fxport_version", "error")}, cut, layout)
    return page


def bounded(value: Any, cut: list[str], where: str = "manifest", depth: int = 0) -> Any:
    """`value` with every list and mapping cut to MAX_REPORT_ITEMS items and every string to
    MAX_REPORT_CHARS characters; `cut` collects where (at most a few dozen notes)."""
    if isinstance(value, str):
        if len(value) <= MAX_REPORT_CHARS:
            return value
        _note(cut, f"{where}: {len(value)} characters, cut to {MAX_REPORT_CHARS}")
        return value[:MAX_REPORT_CHARS] + "…"
    if depth > 32:
        _note(cut, f"{where}: nested more than 32 levels, left out")
        return None
    if isinstance(value, list):
        if len(value) > MAX_REPORT_ITEMS:
            _note(cut, f"{where}: {len(value)} items, the first {MAX_REPORT_ITEMS} shown")
        return [bounded(v, cut, f"{where}[{i}]", depth + 1) for i, v in enumerate(value[:MAX_REPORT_ITEMS])]
    if isinstance(value, dict):
        if len(value) > MAX_REPORT_ITEMS:
            _note(cut, f"{where}: {len(value)} keys, the first {MAX_REPORT_ITEMS} shown")
        items = list(value.items())[:MAX_REPORT_ITEMS]
        return {str(k)[:MAX_REPORT_CHARS]: bounded(v, cut, f"{where}.{str(k)[:40]}", depth + 1) for k, v in items}
    return value


def _note(cut: list[str], note: str) -> None:
    if len(cut) < 20:
        cut.append(note)
    elif len(cut) == 20:
        cut.append("… and more")


def _render(manifest: dict[str, Any], cut: list[str], layout: DotLayout | None) -> str:
    job = manifest.get("job_id") or "local conversion"
    status = str(manifest.get("status") or "unknown")
    renderers: dict[str, Callable[[dict[str, Any]], str | None]] = {
        "error": _error_section,
        "overview": _overview_section,
        "input": _input_section,
        "toolchain": _toolchain_section,
        "spec": _spec_section,
        "capture": _capture_section,
        "passes": _passes_section,
        "artifacts": _artifacts_section,
        "parity": _parity_section,
        "benchmark": _benchmark_section,
        "profile": _profile_section,
        "quantization": _quantization_section,
        "graph": partial(_graph_section, layout=layout or run_dot),
        "warnings": _warnings_section,
        "timings": _timings_section,
    }
    parts, nav = [], []
    for sid, title in SECTIONS:
        body = _safe_section(renderers[sid], manifest, title)
        if body is None:  # the section does not apply to this job (no profile, not int8, no error, ...)
            continue
        cls = ' class="error-box"' if sid == "error" else ""
        parts.append(f'<section id="{sid}"{cls}>\n<h2>{_e(title)}</h2>\n{body}\n</section>')
        nav.append(f'<a href="#{sid}">{_e(title)}</a>')
    return (
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>fxport report — {_e(job)} ({_e(status)})</title>\n<style>{CSS}</style>\n</head>\n<body>\n"
        f"<header><h1>fxport conversion report {_status_badge(status)}</h1>"
        f'<div class="sub">job <span class="mono">{_e(job)}</span> · fxport {_e(manifest.get("fxport_version"))}'
        " · generated from manifest.json</div></header>\n"
        f"<nav>{''.join(nav)}</nav>\n<main>\n" + _cut_note(cut) + "\n".join(parts) + "\n</main>\n</body>\n</html>\n"
    )


def _cut_note(cut: list[str]) -> str:
    if not cut:
        return ""
    items = "".join(f"<li>{_e(note)}</li>" for note in cut)
    return (f'<p class="note">This report draws at most {MAX_REPORT_ITEMS} items of a list and {MAX_REPORT_CHARS} '
            f"characters of a text; manifest.json holds everything. Cut here:</p><ul class=\"note\">{items}</ul>\n")


def write_report(manifest_path: Path, out_path: Path | None = None, *, layout: DotLayout | None = None) -> Path:
    """Read manifest.json, write report.html (beside it unless `out_path`), return the path written."""
    manifest = json.loads(Path(manifest_path).read_text(encoding="utf-8"))
    if not isinstance(manifest, dict):
        kind = type(manifest).__name__
        raise ValueError(f"{manifest_path} is not a manifest: its top level is {kind}, not an object")
    out = Path(out_path) if out_path else Path(manifest_path).with_name("report.html")
    out.parent.mkdir(parents=True, exist_ok=True)
    text = render_report(manifest, layout=layout)
    # A fresh file renamed into place: whatever stood at `out` (a symlink a sandboxed model left
    # in its output folder, say) is replaced, never written through.
    fd, tmp = tempfile.mkstemp(prefix=".report-", suffix=".html", dir=out.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out


# ---------------------------------------------------------------- sections


def _safe_section(fn: Callable[[dict[str, Any]], str | None], manifest: dict[str, Any], title: str) -> str | None:
    # A malformed or older manifest must not cost the reader the whole report: one section says why it is missing.
    try:
        return fn(manifest)
    except Exception as exc:
        return (f'<p class="missing">The {_e(title.lower())} section could not be rendered: '
                f"{_e(type(exc).__name__)}: {_e(exc)}</p>")


def _error_section(m: dict[str, Any]) -> str | None:
    err = m.get("error")
    if not err:
        return None
    rows = [[_e(k), _e(v)] for k, v in err.items() if v not in (None, "")]
    stage = err.get("stage") or "an unknown stage"
    return (f'<p>The job <strong>failed during {_e(stage)}</strong>: '
            f'<span class="mono">{_e(err.get("message"))}</span></p>'
            + _table(["field", "value"], rows, table_id="error-table"))


def _overview_section(m: dict[str, Any]) -> str:
    inp = m.get("input") or {}
    spec = m.get("spec") or {}
    verification = m.get("verification") or []
    passed = sum(1 for v in verification if _verdict(v) == "passed")
    inconclusive = sum(1 for v in verification if _verdict(v) == "inconclusive")
    total_s = sum(float(v) for v in (m.get("timings_s") or {}).values() if isinstance(v, (int, float)))
    cards = [
        ("status", _status_badge(str(m.get("status")))),
        ("input format", _e(inp.get("format") or "?")),
        ("input size", _e(_human_bytes(inp.get("bytes")))),
        ("precision", _e(spec.get("precision") or "?")),
        ("targets", _e(", ".join(spec.get("targets") or []) or "none")),
        ("capture", _e((m.get("capture") or {}).get("method") or "not reached")),
        ("artifacts", _e(len({a.get("format") for a in m.get("artifacts") or []}))),
        ("parity", _status_badge(_parity_status(passed, inconclusive, len(verification)),
                                 f"{passed}/{len(verification)} passed"
                                 + (f", {inconclusive} inconclusive" if inconclusive else ""))
         if verification else '<span class="note">not run</span>'),
        ("total time", _e(f"{total_s:.2f} s")),
    ]
    pick = (m.get("benchmark") or {}).get("recommendation")
    head = ""
    if pick:  # what to deploy comes first
        head = (f'<p id="recommendation"><strong>Recommended: {_e(pick.get("artifact"))} at batch '
                f'{_e(pick.get("batch"))}</strong> — {_e(pick.get("reason"))} '
                '(<a href="#benchmark">benchmark</a>)</p>')
    return head + '<div class="cards">' + "".join(
        f'<div class="card"><div class="k">{_e(k)}</div><div class="v">{v}</div></div>' for k, v in cards) + "</div>"


def _input_section(m: dict[str, Any]) -> str:
    inp = m.get("input") or {}
    out = _table(["field", "value"], [
        ["format", _e(inp.get("format") or "?")],
        ["sha256", f'<code class="digest" id="input-sha256">{_e(inp.get("sha256"))}</code>'],
        ["size", f'{_e(_human_bytes(inp.get("bytes")))} ({_e(inp.get("bytes"))} bytes)'],
    ], table_id="input-table")
    sig = m.get("inputs") or {}
    if sig.get("inputs"):
        rows = [["input", _e(i.get("name")), _code(_shape(i.get("shape"))), _e(i.get("dtype"))] for i in sig["inputs"]]
        rows += [["output", _e(o.get("name")), _code(_shape(o.get("shape"))) if o.get("shape") is not None
                  else '<span class="note">not recorded</span>', _e(o.get("dtype"))]
                 for o in (m.get("outputs") or []) if isinstance(o, dict)]
        out += "<h3>Signature</h3>" + _table(["", "name", "shape", "dtype"], rows, table_id="signature-table")
        batch = (m.get("signature") or {}).get("batch") or {}
        if batch.get("note"):
            out += f'<p class="note" id="batch-axis">Batch axis: {_e(batch["note"])}.</p>'
    dyn = sig.get("dynamic_dims") or {}
    if dyn:
        out += "<h3>Dynamic dimensions</h3>" + _table(
            ["dim", "min", "opt", "max"],
            [[_e(k)] + [_num_cell(v.get(b)) for b in ("min", "opt", "max")] for k, v in dyn.items()])
    return out


def _toolchain_section(m: dict[str, Any]) -> str:
    tc = m.get("toolchain") or {}
    rows = [[_e(k), _code(v) if v else '<span class="note">not installed</span>'] for k, v in tc.items()]
    return _table(["component", "version"], rows, table_id="toolchain-table")


def _spec_section(m: dict[str, Any]) -> str:
    spec = m.get("spec") or {}
    rows = [[_code(k), _e(v)] for k, v in _flat(spec)]
    return (_table(["field", "value"], rows, table_id="spec-table")
            + "<details><summary>Normalized job spec as JSON</summary>"
            f'<pre id="spec-json">{_e(json.dumps(spec, indent=2, default=str))}</pre></details>')


def _flat(value: Any, prefix: str = "") -> list[tuple[str, str]]:
    """A spec as rows a person reads: nested keys dotted (`verify.atol`), a list of scalars
    comma-joined, a list of mappings (inputs, passes) one row per item, an empty value "—"."""
    if isinstance(value, dict) and value:
        return [row for k, v in value.items() for row in _flat(v, f"{prefix}.{k}" if prefix else str(k))]
    if isinstance(value, list) and value and any(isinstance(v, dict) for v in value):
        return [row for i, v in enumerate(value) for row in _flat(v, f"{prefix}[{i}]")]
    if isinstance(value, list):
        return [(prefix, ", ".join(str(v) for v in value) or "—")]
    return [(prefix, "—" if value is None or value == {} else str(value))]


def _capture_section(m: dict[str, Any]) -> str:
    cap = m.get("capture")
    if not cap:
        return '<p class="note">The job stopped before the graph was captured.</p>'
    attempts = cap.get("attempts") or []
    rows, classes = [], []
    for i, a in enumerate(attempts, 1):
        ok = bool(a.get("ok"))
        method = a.get("method", "?") + ({True: " (strict)", False: " (non-strict)"}.get(a.get("strict"), ""))
        why = a.get("error") or a.get("note") or ""
        rows.append([_num_cell(i), _e(method), _status_cell(ok, "worked" if ok else "failed"),
                     _e(why), _code(a.get("source_line")) if a.get("source_line") else ""])
        classes.append("ok" if ok else "fail")
    worked = next((i for i, a in enumerate(attempts, 1) if a.get("ok")), None)
    head = (f'<p>Captured with <strong>{_e(cap.get("method"))}</strong> '
            f'at <strong>{_e(cap.get("level"))}</strong> level'
            + (f" on rung {worked} of {len(attempts)}" if worked else "") + ".</p>")
    if not attempts:
        return head
    return head + _table(["rung", "method", "result", "why / note", "source line"], rows,
                         table_id="capture-table", row_classes=classes)


def _passes_section(m: dict[str, Any]) -> str:
    passes = m.get("passes") or []
    if not passes:
        out = '<p class="note">No graph passes ran.</p>'
    else:
        rows, classes = [], []
        for p in passes:
            changed = p.get("changed")
            badge = ('<span class="badge ok">changed</span>' if changed
                     else '<span class="badge neutral">unchanged</span>')
            rows.append([_e(p.get("name")), _e("yes" if p.get("applied") else "no"), badge,
                         _e(p.get("notes")), _num_cell(p.get("seconds"), "{:.4f}")])
            classes.append("changed" if changed else "unchanged")
        out = _table(["pass", "applied", "graph", "what it did", "seconds"], rows, table_id="passes-table",
                     row_classes=classes)
    before, after = m.get("graph_before"), m.get("graph_after")
    if before and after:
        b_counts, a_counts = before.get("op_counts") or {}, after.get("op_counts") or {}
        rows = []
        for target in sorted(set(b_counts) | set(a_counts), key=lambda t: (-(b_counts.get(t, 0)), t)):
            b, a = b_counts.get(target, 0), a_counts.get(target, 0)
            delta = f'<span class="badge {"fail" if a > b else "ok"}">{a - b:+d}</span>' if a != b else ""
            rows.append([_code(target), _num_cell(b), _num_cell(a), delta])
        out += (f"<h3>Operator counts: {_e(before.get('node_count'))} nodes before, "
                f"{_e(after.get('node_count'))} after</h3>"
                + _table(["operator", "before", "after", "change"], rows, table_id="opcount-table"))
    return out


def _artifacts_section(m: dict[str, Any]) -> str:
    arts = m.get("artifacts") or []
    if not arts:
        return '<p class="note">No artifacts were written.</p>'
    rows = [[_e(a.get("format")), _code(a.get("path")), _num_cell(_human_bytes(a.get("bytes"))),
             _num_cell(a.get("bytes")), f'<code class="digest">{_e(a.get("sha256"))}</code>'] for a in arts]
    total = sum(int(a.get("bytes") or 0) for a in arts)
    return (_table(["format", "file", "size", "bytes", "sha256"], rows, table_id="artifacts-table")
            + f'<p class="note">{len(arts)} files, {_e(_human_bytes(total))} in all.</p>')


def _parity_section(m: dict[str, Any]) -> str:
    records = m.get("verification") or []
    if not records:
        return '<p class="note">No artifact was verified.</p>'
    tol = (m.get("spec") or {}).get("verify") or {}
    rows, classes = [], []
    for r in records:
        # The comparator keeps each artifact's worst case over every shape it checked: one row per
        # artifact, its shapes listed. A per-shape breakdown ("per_shape") gets one row per shape.
        per_shape = r.get("per_shape") or [{**r, "shapes": r.get("shapes_checked") or []}]
        for s in per_shape:
            verdict = _verdict(s)
            ok = verdict != "failed"
            shapes = s["shapes"] if "shapes" in s else [s.get("shape")]
            shape_html = ("<br>".join(_code(_shape(x)) for x in shapes if x is not None)
                          or '<span class="note">none</span>')
            rows.append([_e(r.get("format")), _e(r.get("runtime")), shape_html,
                         _num_cell(s.get("max_abs_diff"), "{:.3g}"), _num_cell(s.get("max_rel_diff"), "{:.3g}"),
                         _num_cell(s.get("cosine"), "{:.8f}"),
                         _status_cell(ok, {"passed": "pass", "failed": "FAIL"}.get(verdict, verdict)),
                         _e(s.get("error") or r.get("error") or "")])
            classes.append("ok" if ok else "fail")
    head = _tolerances_note(records, tol)
    headers = ["artifact", "runtime", "shapes checked", "max abs diff", "max rel diff", "cosine", "result", "error"]
    return head + _table(headers, rows, table_id="parity-table", row_classes=classes)


def _p50_cell(r: dict[str, Any]) -> str:
    """The p50, with the range of the rounds' medians when there were several."""
    lo_hi = r.get("p50_range_ms")
    if not lo_hi or lo_hi[0] == lo_hi[1]:
        return _num_cell(r.get("p50_ms"), "{:.4g}")
    p50, lo, hi = (format(float(v), spec) for v, spec in ((r["p50_ms"], ".4g"), (lo_hi[0], ".3g"), (lo_hi[1], ".3g")))
    return f'<td class="num">{_e(p50)} <span class="note">({_e(lo)}–{_e(hi)})</span></td>'


def _tolerances_text(tol: dict[str, Any]) -> str:
    parts = [f"{name}={_e(tol[key])}" for key, name in (("atol", "atol"), ("rtol", "rtol")) if tol.get(key) is not None]
    if tol.get("scale_atol") is not None:
        parts.append(f"scale_atol={_e(tol.get('scale_atol'))} (× the output's largest magnitude)")
    parts.append(f"min cosine={_e(tol.get('min_cosine'))}")
    if tol.get("min_top1_agreement") is not None:
        parts.append(f"min top-1 agreement={_e(tol.get('min_top1_agreement'))}")
    if tol.get("atol") is None:  # int8: judged on cosine (and top-1) alone
        parts.append("abs and rel diffs shown, not judged")
    text = ", ".join(parts)
    return text + (f"; rule: {_e(tol['rule'])}" if tol.get("rule") else "")


def _tolerances_note(records: list[dict[str, Any]], spec_tol: dict[str, Any]) -> str:
    """The tolerances each verdict used (a record's own: fp16 and int8 ones differ from the
    spec's fp32 defaults), once when every artifact used the same, else per artifact."""
    groups: dict[str, tuple[dict[str, Any], list[str]]] = {}
    for r in records:
        tol = r.get("tolerances") if isinstance(r.get("tolerances"), dict) else spec_tol
        if not tol:
            continue
        key = json.dumps(tol, sort_keys=True, default=str)
        groups.setdefault(key, (tol, []))[1].append(f"{r.get('format')} ({r.get('runtime')})")
    if not groups:
        return ""
    lines = []
    for tol, names in groups.values():
        precision = f" ({_e(tol['precision'])})" if tol.get("precision") else ""
        who = "" if len(groups) == 1 else f"{_e(', '.join(names))}: "
        lines.append(f"{who}tolerances{precision}: {_tolerances_text(tol)}")
    return (f'<p class="note">{"<br>".join(lines)}. {_e(records[0].get("samples"))} samples per artifact; diffs '
            "and cosine are the worst over the shapes checked.</p>")


def _benchmark_section(m: dict[str, Any]) -> str | None:
    from fxport.benchmark import rate, table

    bench = m.get("benchmark")
    if not bench:
        return None
    rows = table(bench)
    machine = bench.get("machine") or {}
    settings = bench.get("settings") or {}
    pick = bench.get("recommendation")
    unclear = bench.get("no_clear_winner") or []
    parts = [f'<p><strong>Recommended: {_e(pick["artifact"])} at batch {_e(pick["batch"])}</strong> — '
             f'{_e(pick["reason"])}</p>' if pick else
             f'<p><strong>No clear winner</strong>: {_e("; ".join(u["reason"] for u in unclear))}.</p>' if unclear else
             '<p class="note">No recommendation: no verified artifact was measured.</p>']
    noise = bench.get("noise") or {}
    if noise.get("noisy") and noise.get("worst"):
        w = noise["worst"]
        parts.append(f'<p class="missing" id="benchmark-noisy"><strong>Noisy machine</strong>: {_e(w["artifact"])} at '
                     f'batch {_e(w["batch"])} varied {_e(w["spread"])}× between rounds '
                     f'({_e(", ".join(f"{x:.3g}" for x in w.get("round_p50_ms") or []))} ms). The figures are '
                     "rough: benchmark on a quiet machine before deciding.</p>")
    isa = ", ".join(machine.get("isa") or []) or "none listed"
    parts.append(f'<p class="note">Measured on the worker that built the artifacts: {_e(machine.get("cpu"))} '
                 f'({_e(machine.get("usable_cpus"))} of {_e(machine.get("cores"))} CPUs usable; ISA: {_e(isa)})'
                 + (f", GPU {_e(machine['gpu'])}" if machine.get("gpu") else "")
                 + f'; {_e(settings.get("threads"))} threads, {_e(settings.get("warmup"))} warm-up and up to '
                 f'{_e(settings.get("runs"))} timed runs per artifact and batch, one runtime at a time; the stage '
                 f'took {_e(bench.get("seconds"))} s (max {_e(settings.get("max_seconds"))} s). Memory is what the '
                 "runtime added to the sandbox process: its peak while it ran that batch, over the resident memory "
                 "before the artifact was loaded (the process's own peak, mostly torch, is in manifest.json).</p>")
    batches = sorted({r["batch"] for r in rows})
    artifacts = list(dict.fromkeys(r["artifact"] for r in rows))
    by = {(r["artifact"], r["batch"]): r for r in rows}
    if rows:
        # one small chart per batch, each on its own scale: batch 1 and batch 64 differ too much to share one
        parts.append('<p><strong>Latency by artifact and batch</strong> (p50, ms)</p><div class="charts">' + "".join(
            _bar_chart(f"benchmark-latency-{b}", [a for a in artifacts if (a, b) in by],
                       [{"value": by[(a, b)]["p50_ms"], "color": _series_colour(artifacts, a)}
                        for a in artifacts if (a, b) in by],
                       horizontal=False, title=f"batch {b}", value_fmt="{:.3g} ms", size=(340, 320))
            for b in batches) + "</div>")
        speedup = {a: [by[(a, b)].get("speedup_vs_eager") if (a, b) in by else None for b in batches]
                   for a in artifacts}  # eager too, at 1×: each artifact keeps its colour in both charts
        if any(v is not None for vs in speedup.values() for v in vs):
            # on a log scale: one noisy outlier (223×) otherwise flattens every other bar to nothing
            parts.append(_grouped_bar_chart("benchmark-speedup", [f"batch {b}" for b in batches], speedup,
                                            title="Speed-up over eager (× eager p50, log scale)",
                                            value_fmt="{:.2f}×", logarithmic=True))
    table_rows = [[_e(r["artifact"]), _e(r.get("runtime")), _e(r["batch"]), _p50_cell(r),
                   _num_cell(r.get("p95_ms"), "{:.4g}"), _num_cell(r.get("mean_ms"), "{:.4g}"),
                   _e(rate(r["throughput_per_s"])), _num_cell(r.get("speedup_vs_eager"), "{:.2f}×"),
                   _num_cell(r.get("memory_mib"), "{:.0f} MiB"), _e(r.get("threads")), _e(r.get("runs")),
                   _status_cell(bool(r.get("verified")), "yes" if r.get("verified") else "no")] for r in rows]
    parts.append(_table(["artifact", "runtime", "batch", "p50 ms", "p95 ms", "mean ms", "throughput", "× eager",
                         "memory", "threads", "runs", "verified"], table_rows, table_id="benchmark-table"))
    skipped = bench.get("skipped") or []
    if skipped:
        parts.append("<p>Skipped:</p><ul>" + "".join(
            f"<li>{_e(s.get('artifact'))} at batch {_e(s.get('batch'))}: {_e(s.get('reason'))}</li>" for s in skipped)
            + "</ul>")
    return "\n".join(parts)


def _profile_section(m: dict[str, Any]) -> str | None:
    prof = m.get("profile")
    if not prof or not prof.get("top_nodes"):
        return None
    top = prof["top_nodes"]
    labels = [f"{n.get('node')} ({_short_target(n.get('op'))})" for n in top]
    values = [float(n.get("ms") or 0.0) for n in top]
    # pygal draws a horizontal chart's first bar at the bottom: reverse so the slowest node is on top.
    chart = _bar_chart("profile-chart", labels[::-1], [{"value": v} for v in values[::-1]], horizontal=True,
                       title="Top nodes by time (ms per run)", value_fmt="{:.3f} ms")
    rows = [[_e(n.get("node")), _code(n.get("op")), _num_cell(n.get("ms"), "{:.4f}"),
             _num_cell(100 * float(n.get("share") or 0), "{:.1f}%")] for n in top]
    return (f'<p>{len(top)} slowest nodes; the whole graph takes <strong>{_e(prof.get("total_ms"))} ms</strong> '
            "per run (eager, measured by the profile_nodes pass).</p>" + chart
            + "<details><summary>Node timings table</summary>"
            + _table(["node", "op", "ms", "share"], rows, table_id="profile-table") + "</details>")


def _quantization_section(m: dict[str, Any]) -> str | None:
    quant = m.get("quantization")
    if not quant or not quant.get("layers"):
        return None
    layers = quant["layers"]
    labels = [f"{layer.get('node')}{' (fallback)' if layer.get('fallback') else ''}" for layer in layers]
    values = [{"value": float(layer.get("sqnr_db") or 0.0),
               "color": "#d93025" if layer.get("fallback") else "#1a73e8"} for layer in layers]
    chart = _bar_chart("sqnr-chart", labels, values, horizontal=False, title="Per-layer SQNR (dB, higher is better)",
                       value_fmt="{:.1f} dB")
    fallbacks = [layer for layer in layers if layer.get("fallback")]
    rows, classes = [], []
    for layer in layers:
        fb = bool(layer.get("fallback"))
        rows.append([_e(layer.get("node")), _num_cell(layer.get("sqnr_db"), "{:.2f}"),
                     _num_cell(layer.get("cosine"), "{:.6f}"),
                     '<span class="badge fail">fallback (fp32)</span>' if fb else '<span class="badge ok">int8</span>'])
        classes.append("fallback" if fb else "int8")
    schemes = "".join(
        f"<li><strong>{_e(rt)}</strong>{' (the table below)' if rt == quant.get('runtime') else ''}: "
        f"{_e((r.get('scheme') or {}).get('activations'))}; end-to-end cosine "
        f"{_e(_fmt_number((r.get('end_to_end') or {}).get('cosine'), '{:.5f}'))}, "
        f"{len(r.get('fallback_layers') or [])} layer(s) in fp32</li>"
        for rt, r in (quant.get("schemes") or {}).items())
    return ((f"<p>int8 schemes, one per runtime the artifacts are for:</p><ul>{schemes}</ul>" if schemes else "")
            + f"<p>{len(layers)} quantized layers; <strong>{len(fallbacks)}</strong> fell back to fp32 "
            '(red bars).</p>' + chart
            + _table(["layer", "SQNR (dB)", "cosine", "kept as"], rows, table_id="quantization-table",
                     row_classes=classes))


def _graph_section(m: dict[str, Any], layout: DotLayout) -> str | None:
    before, after = m.get("graph_before"), m.get("graph_after")
    if not before and not after:
        return '<p class="note">No FX graph: the job stopped before capture, or the input was ONNX.</p>'
    cols = []
    for key, title in (("graph_before", "Before passes"), ("graph_after", "After passes")):
        g = m.get(key)
        if g:
            gid = key.replace("_", "-")
            cols.append(f'<div id="{gid}"><h3>{title}</h3>{_graph_block(gid, g, layout)}</div>')
    return ('<p class="note">Parameters and buffers (get_attr nodes) are folded into the node that uses them. '
            "Hover a node for its full target.</p>" + f'<div class="graphs">{"".join(cols)}</div>')


def _warnings_section(m: dict[str, Any]) -> str | None:
    warnings = m.get("warnings") or []
    if not warnings:
        return None
    return '<ul id="warnings-list">' + "".join(f"<li>{_e(w)}</li>" for w in warnings) + "</ul>"


def _timings_section(m: dict[str, Any]) -> str | None:
    timings = m.get("timings_s") or {}
    if not timings:
        return None
    return _table(["stage", "seconds"], [[_e(k), _num_cell(v, "{:.3f}")] for k, v in timings.items()],
                  table_id="timings-table")


# ---------------------------------------------------------------- charts (pygal)


_NO_PYGAL = ('<p class="missing">Chart not drawn: the chart library pygal is not installed '
             "(pip install pygal). The table below has the numbers.</p>")


def _style(**colors: Any) -> Any:
    from pygal.style import Style

    return Style(background="white", plot_background="white", font_family="sans-serif", label_font_size=11,
                 major_label_font_size=11, value_font_size=10, title_font_size=14, legend_font_size=12, **colors)


def _chart_html(chart: Any, chart_id: str) -> str:
    svg = chart.render(is_unicode=True)
    # pygal emits a config <script> for its optional JS tooltips and comments with its home page:
    # neither belongs in a page that runs no scripts and fetches nothing. Its ids are random; make them stable.
    svg = _strip_scripts_and_comments(svg).replace(f"chart-{chart.uuid}", chart_id).replace(chart.uuid, chart_id)
    return f'<div class="chart" id="{chart_id}-box">{svg}</div>'


def _bar_chart(chart_id: str, labels: list[str], values: list[dict[str, Any]], *, horizontal: bool, title: str,
               value_fmt: str, size: tuple[int, int] | None = None) -> str:
    """One series of bars (a value may carry its own "color"). `size`: (width, height) of a small
    vertical chart, without values printed on its bars (the y axis and the table give them)."""
    try:
        import pygal
    except ImportError:
        return _NO_PYGAL
    n = max(len(labels), 1)
    # values printed on a small chart's bars overlapped them (a 0.03 ms bar beside a 0.3 ms one): the
    # y axis gives the scale there, and the table below each chart the exact numbers
    common = dict(style=_style(colors=("#1a73e8",)), js=[], disable_xml_declaration=True, show_legend=False,
                  title=title, print_values=horizontal,
                  value_formatter=lambda v: value_fmt.format(v), truncate_label=-1)
    if horizontal:
        chart = pygal.HorizontalBar(width=1100, height=90 + 28 * n, margin_left=10, **common)
    elif size is not None:
        chart = pygal.Bar(width=size[0], height=size[1], x_label_rotation=30, **common)
    else:
        chart = pygal.Bar(width=1100, height=460, x_label_rotation=35, **common)
    chart.x_labels = labels
    chart.add("value", values)
    return _chart_html(chart, chart_id)


SERIES_COLOURS = ("#5f6368", "#1a73e8", "#e8710a", "#1e8e3e", "#9334e6", "#d93025", "#12b5cb")


def _series_colour(names: list[str], name: str) -> str:
    return SERIES_COLOURS[names.index(name) % len(SERIES_COLOURS)]


def _grouped_bar_chart(chart_id: str, labels: list[str], series: dict[str, list[float | None]], *, title: str,
                       value_fmt: str, logarithmic: bool = False) -> str:
    """Bars grouped by `labels` (batch sizes), one coloured series per artifact, with a legend."""
    try:
        import pygal
    except ImportError:
        return _NO_PYGAL
    chart = pygal.Bar(width=1100, height=420, js=[], disable_xml_declaration=True, title=title, show_legend=True,
                      legend_at_bottom=True, truncate_label=-1, value_formatter=lambda v: value_fmt.format(v),
                      style=_style(colors=SERIES_COLOURS), logarithmic=logarithmic)
    chart.x_labels = labels
    for name, values in series.items():
        chart.add(name, values)
    return _chart_html(chart, chart_id)


# ---------------------------------------------------------------- FX graph (graphviz dot)


def _graph_block(prefix: str, g: dict[str, Any], layout: DotLayout) -> str:
    nodes = g.get("nodes") or []
    total = int(g.get("node_count") or len(nodes))
    notes = []
    if len(nodes) < total:
        notes.append(f"the manifest lists only the first {len(nodes)} of {total} nodes")
    drawn_svg = _graph_svg(prefix, nodes, notes, layout)
    note_html = "".join(f'<p class="note">{_e(n)}</p>' for n in notes)
    # What makes a diagram big on the page is its boxes; get_attr nodes are folded, so they don't count.
    checks = shape_checks(nodes)
    boxes = sum(1 for n in nodes if n.get("op") != "get_attr" and n.get("name") not in checks)
    open_attr = "" if boxes > COLLAPSE_ABOVE_NODES else " open"
    diagram = (f'<details class="graph-details"{open_attr}><summary>Graph diagram ({total} nodes, {boxes} drawn '
               "as boxes)</summary>"
               f"{note_html}{drawn_svg}</details>")
    rows = [[_num_cell(i), _code(n.get("name")), _e(n.get("op")), _code(n.get("target")),
             _e(", ".join(n.get("inputs") or []))] for i, n in enumerate(nodes)]
    table = (f"<details><summary>All {len(nodes)} nodes as a table</summary>"
             + _table(["#", "name", "op", "target", "inputs"], rows, table_id=f"{prefix}-nodes") + "</details>")
    return diagram + table


def find_dot(path: str | None = None) -> str:
    """Graphviz's `dot` on `path` (default: PATH), or FileNotFoundError. Looked up before a
    layout is started: without Graphviz a report then costs a few stat calls instead of a fork
    of this process per graph (a worker forks its whole address space for a confined `dot`)."""
    found = shutil.which("dot", path=path)
    if found is None:
        raise FileNotFoundError("Graphviz dot is not on PATH")
    return found


def run_dot(source: bytes) -> bytes:
    """`dot -Tsvg` as a plain subprocess (a local `fxport convert` or `fxport report`)."""
    return subprocess.run([find_dot(), "-Tsvg"], input=source, capture_output=True, check=True,
                          timeout=DOT_TIMEOUT_S).stdout


# keyed on the DOT source's sha256 (all a layout depends on, with `dot` fixed for a process's life)
_layouts: OrderedDict[str, bytes] = OrderedDict()
_layouts_lock = threading.Lock()


def _cached_layout(source: bytes, layout: DotLayout) -> bytes:
    """`layout(source)`, remembered by the source's sha256 (the LAYOUT_CACHE_ENTRIES most recent)."""
    key = hashlib.sha256(source).hexdigest()
    with _layouts_lock:
        if key in _layouts:
            _layouts.move_to_end(key)
            return _layouts[key]
    svg = layout(source)
    with _layouts_lock:
        _layouts[key] = svg
        while len(_layouts) > LAYOUT_CACHE_ENTRIES:
            _layouts.popitem(last=False)
    return svg


SHAPE_CHECK_TARGETS = ("_assert", "sym_constrain_range", "sym_size", "sym_numel", "sym_stride", "sym_storage_offset")
SIZE_ARITHMETIC = {"le", "ge", "lt", "gt", "eq", "ne", "and_", "or_", "not_", "add", "sub", "mul", "floordiv", "mod",
                   "truediv", "sym_not", "sym_max", "sym_min"}


def shape_checks(nodes: list[dict[str, Any]]) -> set[str]:
    """The nodes of a graph that only check or compute sizes: the asserts and range constraints,
    the size reads (sym_size, x.size()), and Python operators (getitem, comparisons, arithmetic)
    whose every input is one of them. In a dynamic-shape program they were 16 of 27 boxes; the
    computation is the rest."""
    out: set[str] = set()
    for n in nodes:
        op, target, inputs = n.get("op"), str(n.get("target") or ""), n.get("inputs") or []
        if op == "call_method" and target in ("size", "dim", "numel", "stride"):  # a traced graph's x.size()
            out.add(str(n.get("name")))
            continue
        if op != "call_function":
            continue
        if any(t in target for t in SHAPE_CHECK_TARGETS):
            out.add(str(n.get("name")))
            continue
        module, _, fn = target.rpartition(".")
        if module in ("operator", "_operator", "torch") and (fn in SIZE_ARITHMETIC or fn == "getitem") and inputs \
                and all(i in out for i in inputs):
            out.add(str(n.get("name")))
    return out


def _graph_svg(prefix: str, nodes: list[dict[str, Any]], notes: list[str], layout: DotLayout) -> str:
    try:
        import graphviz
    except ImportError:
        return ('<p class="missing graph-missing">Graph not drawn: the Python package graphviz is not installed '
                "(pip install graphviz). The node table below lists the graph.</p>")
    params = {n.get("name") for n in nodes if n.get("op") == "get_attr"}
    checks = shape_checks(nodes)
    if checks:
        notes.append(f"{len(checks)} shape-check nodes (sym_size, _assert_scalar, comparisons of sizes, ...) are "
                     "left out of the drawing; the table lists them")
    drawable = [n for n in nodes if n.get("op") != "get_attr" and n.get("name") not in checks]
    if len(drawable) > MAX_DRAWN_NODES:
        notes.append(f"drawing only the first {MAX_DRAWN_NODES} of {len(drawable)} nodes (get_attr nodes aside); "
                     "the table has them all")
        drawable = drawable[:MAX_DRAWN_NODES]
    # Node ids in DOT are opaque (n0, n1, ...): user-controlled names only ever appear in labels and
    # tooltips, which dot XML-escapes, never in the SVG comments or ids it writes.
    ids = {n.get("name"): f"n{i}" for i, n in enumerate(drawable)}
    dot = graphviz.Digraph("fx", graph_attr={"rankdir": "TB", "nodesep": "0.25", "ranksep": "0.3"},
                           node_attr={"shape": "box", "style": "rounded,filled", "fontname": "Helvetica",
                                      "fontsize": "10", "height": "0.3", "margin": "0.08,0.03"},
                           edge_attr={"arrowsize": "0.6", "color": "#5f6368"})
    colors = {"placeholder": "#c8e6c9", "output": "#ffe0b2", "call_module": "#bbdefb",
              "call_function": "#e3f2fd", "call_method": "#e1bee7"}
    for n in drawable:
        name, op = str(n.get("name")), str(n.get("op"))
        folded = [i for i in n.get("inputs") or [] if i in params]
        short = _short_target(n.get("target"))
        lines = [name] if op in ("placeholder", "output") or short == name else [name, short]
        if folded:
            lines.append(f"+{len(folded)} param{'s' if len(folded) > 1 else ''}")
        label = graphviz.nohtml("\\n".join(_dot_text(s) for s in lines))
        tooltip = graphviz.nohtml(_dot_text(f"{name}: {op} {n.get('target')}"
                                            + (f" | params: {', '.join(folded)}" if folded else "")))
        dot.node(ids[name], label=label, tooltip=tooltip, fillcolor=colors.get(op, "#eeeeee"),
                 shape="ellipse" if op in ("placeholder", "output") else "box")
    for n in drawable:
        for src in n.get("inputs") or []:
            if src in ids:
                dot.edge(ids[src], ids[str(n.get("name"))])
    try:
        svg = _cached_layout(dot.source.encode("utf-8"), layout).decode("utf-8")
    except FileNotFoundError:
        return ('<p class="missing graph-missing">Graph not drawn: the layout tool Graphviz <code>dot</code> is not '
                "installed (apt-get install graphviz). The node table below lists the graph.</p>")
    except subprocess.CalledProcessError as exc:  # a dot crash on an odd graph must not cost the rest of the report
        why = (exc.stderr or b"").decode("utf-8", "replace").strip()[-300:] or f"exit status {exc.returncode}"
        return f'<p class="missing graph-missing">Graph not drawn: dot failed: {_e(why)}</p>'
    except Exception as exc:
        return f'<p class="missing graph-missing">Graph not drawn: dot failed: {_e(type(exc).__name__)}: {_e(exc)}</p>'
    svg = svg[svg.find("<svg"):]  # drop the XML prolog and DOCTYPE: invalid inside HTML
    svg = _strip_scripts_and_comments(svg)
    # Two graphs share one page: make dot's ids (graph0, node1, ...) unique per graph.
    svg = re.sub(r'\bid="([^"]*)"', lambda mt: f'id="{prefix}-{mt.group(1)}"', svg)
    return f'<div class="graph-svg">{svg}</div>'


def _dot_text(s: str) -> str:
    # In a DOT label a backslash starts an escape (\n, \l, \N); a node name must print as written.
    return str(s).replace("\\", "\\\\")


# ---------------------------------------------------------------- small HTML helpers


def _e(value: Any) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def _code(value: Any) -> str:
    return f"<code>{_e(value)}</code>"


def _table(headers: list[str], rows: Iterable[list[str]], *, table_id: str | None = None,
           row_classes: list[str] | None = None) -> str:
    """Rows hold cells that are already HTML (escaped by the caller)."""
    tid = f' id="{table_id}"' if table_id else ""
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = []
    for i, row in enumerate(rows):
        cls = f' class="{row_classes[i]}"' if row_classes else ""
        body.append(f"<tr{cls}>" + "".join(c if c.startswith("<td") else f"<td>{c}</td>" for c in row) + "</tr>")
    return f"<table{tid}><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _fmt_number(value: Any, fmt: str) -> str:
    return fmt.format(value) if isinstance(value, (int, float)) else "–"


def _num_cell(value: Any, fmt: str = "{}") -> str:
    if value is None or value == "":
        return '<td class="num"></td>'
    try:
        text = fmt.format(value)
    except (ValueError, TypeError):
        text = str(value)
    return f'<td class="num">{_e(text)}</td>'


def _verdict(record: dict[str, Any]) -> str:
    """passed / failed / inconclusive; a record written before verdicts has only `passed`."""
    return str(record.get("verdict") or ("passed" if record.get("passed") else "failed"))


def _parity_status(passed: int, inconclusive: int, total: int) -> str:
    if passed == total:
        return "passed"
    return "inconclusive" if passed + inconclusive == total else "failed"


def _status_cell(ok: bool, text: str) -> str:
    return f'<td class="status {"ok" if ok else "fail"}">{_e(text)}</td>'


def _status_badge(status: str, text: str | None = None) -> str:
    cls = {"succeeded": "ok", "passed": "ok", "failed": "fail", "cancelled": "fail"}.get(status, "neutral")
    return f'<span class="badge {cls}" id="status-badge-{_e(status)}">{_e(text or status)}</span>'


def _shape(shape: Any) -> str:
    if isinstance(shape, list):
        return "[" + ", ".join(_shape(s) if isinstance(s, list) else str(s) for s in shape) + "]"
    return str(shape)


def _short_target(target: Any) -> str:
    """'aten.conv2d.default' → 'conv2d'; '_operator.getitem' → 'getitem'; module paths stay."""
    t = str(target or "")
    if t.startswith("aten."):
        return t.split(".")[1]
    if t.startswith(("_operator.", "torch.", "builtins.")):
        return t.rsplit(".", 1)[-1]
    return t


def _human_bytes(n: Any) -> str:
    try:
        size = float(n)
    except (TypeError, ValueError):
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


_SCRIPT_RE = re.compile(r"<script\b[^>]*>.*?</script\s*>", re.S | re.I)
_COMMENT_RE = re.compile(r"<!--.*?-->", re.S)


def _strip_scripts_and_comments(svg: str) -> str:
    return _COMMENT_RE.sub("", _SCRIPT_RE.sub("", svg))
