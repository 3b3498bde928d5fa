"""Render a manifest (the result of a conversion) as tables a person reads at a glance."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def render_manifest(manifest: dict[str, Any], console: Console) -> None:
    capture = manifest.get("capture") or {}
    if capture:
        tried = ", ".join(
            f"{a['method']}{'(strict)' if a.get('strict') else ''}={'ok' if a.get('ok') else 'failed'}"
            for a in capture.get("attempts", [])
        )
        console.print(f"[bold]capture[/]: {capture.get('method')} ({capture.get('level')} level) — tried {tried}")
    for p in manifest.get("passes", []):
        mark = "✓" if p.get("changed") else ("–" if p.get("applied") else "✗")
        console.print(f"  pass {mark} {p['name']}: {p.get('notes', '')}")

    by_format: dict[str, dict[str, Any]] = {}
    for art in manifest.get("artifacts", []):
        entry = by_format.setdefault(art["format"], {"path": art["path"], "bytes": 0, "sha256": art["sha256"], "files": 0})
        entry["bytes"] += art["bytes"]
        entry["files"] += 1
        if entry["files"] > 1:
            entry["path"] = art["path"].split("/")[0] + "/"
    checks = {v["format"]: v for v in manifest.get("verification", [])}

    table = Table(title="artifacts", show_lines=False)
    for col in ("format", "path", "size", "sha256", "max |Δ|", "cosine", "shapes", "parity"):
        table.add_column(col)
    for fmt, art in by_format.items():
        v = checks.get(fmt)
        if v is None:
            parity = "[yellow]not checked[/]"
            cols = ["", "", ""]
        else:
            parity = "[green]pass[/]" if v.get("passed") else f"[red]FAIL[/] {v.get('error', '')}"
            cols = [f"{v.get('max_abs_diff', 0):.2e}", f"{v.get('cosine', 0):.6f}", str(len(v.get("shapes_checked", [])))]
        table.add_row(fmt, art["path"], _size(art["bytes"]), art["sha256"][:12] + ("…" if art["files"] == 1 else f" (+{art['files'] - 1})"),
                      *cols, parity)
    console.print(table)
    timings = manifest.get("timings_s") or {}
    if timings:
        console.print("timings: " + ", ".join(f"{k} {v:.2f}s" for k, v in timings.items()))
    for w in manifest.get("warnings", []):
        console.print(f"[yellow]warning:[/] {w}")
