"""`fxport report manifest.json`: regenerate a job's self-contained report.html from its manifest alone."""

from __future__ import annotations

import json
import webbrowser
from pathlib import Path

import typer
from rich.console import Console

from fxport.errors import EXIT_OK, EXIT_USAGE


def report_command(
    manifest: Path = typer.Argument(..., help="A job's manifest.json (from `fxport convert` or "
                                    "`fxport jobs download`)."),
    out: Path | None = typer.Option(None, "--out", "-o", help="Where to write the report; default: report.html "
                                       "beside the manifest."),
    open_browser: bool = typer.Option(False, "--open", help="Open the report in the default browser."),
) -> None:
    """Write report.html — graph, parity, per-node time, per-layer error — from manifest.json, offline."""
    from fxport.report import write_report

    err = Console(stderr=True)
    try:
        path = write_report(manifest, out)
    except FileNotFoundError as exc:
        err.print(f"[red]fxport report: error:[/] manifest {str(manifest)!r} does not exist",
                  highlight=False, soft_wrap=True)
        raise typer.Exit(EXIT_USAGE) from exc
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as exc:
        err.print(f"[red]fxport report: error:[/] {manifest} is not a readable manifest.json: {exc}",
                  highlight=False, soft_wrap=True)
        raise typer.Exit(EXIT_USAGE) from exc
    print(path)
    if open_browser:
        webbrowser.open(path.resolve().as_uri())
    raise typer.Exit(EXIT_OK)
