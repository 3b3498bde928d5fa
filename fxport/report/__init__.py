"""Render a job's manifest.json as one self-contained report.html (no torch, no onnx: the thin client uses it).

The report is built from the manifest alone, so `fxport report manifest.json` regenerates it
anywhere. Everything is inline (CSS, SVG charts, the SVG graph drawing); a Content-Security-Policy
forbids every fetch and every script, so the page cannot reach the network even if a string in
the manifest were hostile, and the templates escape every string they print.

The rooms:
- render.py: the page, from Jinja2 templates (templates/, one per section), autoescaped;
- data.py: what each section shows, read from the typed manifest (fxport/manifest.py);
- graph.py: the FX graph drawings (Graphviz `dot`), within a budget, with a time limit;
- charts.py: the bar charts (pygal);
- bounds.py: what one report draws at most, whatever the manifest holds.

pygal and the `graphviz` package are optional at run time: a missing one leaves a note in its
section and the tables still render.
"""

from fxport.report.bounds import MAX_REPORT_BYTES, MAX_REPORT_CHARS, MAX_REPORT_ITEMS, bounded
from fxport.report.graph import (
    COLLAPSE_ABOVE_NODES,
    DOT_TIMEOUT_S,
    MAX_DRAWN_NODES,
    MAX_LAYOUT_COST,
    DotLayout,
    clear_layout_cache,
    find_dot,
    run_dot,
    shape_checks,
)
from fxport.report.render import render_report, write_report

__all__ = [
    "COLLAPSE_ABOVE_NODES", "DOT_TIMEOUT_S", "MAX_DRAWN_NODES", "MAX_LAYOUT_COST", "MAX_REPORT_BYTES",
    "MAX_REPORT_CHARS", "MAX_REPORT_ITEMS", "DotLayout", "bounded", "clear_layout_cache", "find_dot",
    "render_report", "run_dot", "shape_checks", "write_report",
]
