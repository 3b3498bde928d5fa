"""What one report draws at most, whatever the manifest holds.

A worker draws the report from a manifest its sandboxed model could shape: a forged 1.8 MiB one
once cost 96 s of a worker's CPU and a 181 MiB report.html. So every list (table rows, chart bars,
benchmark rows) and every mapping is cut to MAX_REPORT_ITEMS items and every string to
MAX_REPORT_CHARS characters before anything is drawn, and a page past MAX_REPORT_BYTES says only
that. A real conversion stays far below (a few dozen rows per table; the graph drawing has its own
budget, fxport/report/graph.py); what is cut is said at the top of the page.
"""

from __future__ import annotations

from typing import Any

MAX_REPORT_ITEMS = 500
MAX_REPORT_CHARS = 2000
MAX_REPORT_BYTES = 32 << 20  # past this the page says only that, and manifest.json holds everything
MAX_DEPTH = 32
MAX_CUT_NOTES = 20


def bounded(value: Any, cut: list[str], where: str = "manifest", depth: int = 0) -> Any:
    """`value` with every list and mapping cut to MAX_REPORT_ITEMS items and every string to
    MAX_REPORT_CHARS characters; `cut` collects where (at most a few dozen notes)."""
    if isinstance(value, str):
        if len(value) <= MAX_REPORT_CHARS:
            return value
        _note(cut, f"{where}: {len(value)} characters, cut to {MAX_REPORT_CHARS}")
        return value[:MAX_REPORT_CHARS] + "…"
    if depth > MAX_DEPTH:
        _note(cut, f"{where}: nested more than {MAX_DEPTH} levels, left out")
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
    if len(cut) < MAX_CUT_NOTES:
        cut.append(note)
    elif len(cut) == MAX_CUT_NOTES:
        cut.append("… and more")
