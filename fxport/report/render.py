"""report.html from the section views: Jinja2 templates with autoescaping, one per section.

Every value a template prints is escaped (autoescape is on for every template), so a string a
manifest holds — a layer name, an error message, a label a model chose — is text in the page,
never markup. The only markup that is not the templates' own is SVG: pygal's charts and dot's
graph drawings, which escape their own text (fxport/report/charts.py, graph.py).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jinja2 import Environment, PackageLoader, StrictUndefined
from markupsafe import Markup

from fxport.manifest import Manifest, read_leniently
from fxport.report import bounds
from fxport.report.data import SECTION_FIELDS, SECTIONS, Badge, View, badge_class, status_of, views
from fxport.report.graph import DotLayout, run_dot


@dataclass
class RenderedSection:
    id: str
    title: str
    body: Markup


def _environment() -> Environment:
    env = Environment(loader=PackageLoader("fxport.report", "templates"), autoescape=True, trim_blocks=True,
                      lstrip_blocks=True, undefined=StrictUndefined,
                      finalize=lambda value: "" if value is None else value)  # a missing value prints as nothing
    env.globals["badge_class"] = badge_class
    env.tests["badge"] = lambda value: isinstance(value, Badge)
    return env


ENV = _environment()
CSS = Markup(Path(__file__).with_name("templates").joinpath("report.css").read_text(encoding="utf-8"))


def render_report(manifest: Manifest | Mapping[str, Any], *, layout: DotLayout | None = None) -> str:
    """The whole report.html for `manifest` (a Manifest, or a parsed manifest.json of any origin)
    as one string, drawn from at most MAX_REPORT_ITEMS items of each list and MAX_REPORT_CHARS
    characters of each string (`bounded`), and at most MAX_REPORT_BYTES long. `layout` runs `dot`
    (default: `run_dot`, a plain subprocess)."""
    data = manifest.to_dict() if isinstance(manifest, Manifest) else dict(manifest)
    cut: list[str] = []
    data = bounds.bounded(data, cut)
    page = _page(data, cut, layout or run_dot)
    if len(page) > bounds.MAX_REPORT_BYTES:
        cut = [f"the report came to {len(page) >> 20} MiB, past the {bounds.MAX_REPORT_BYTES >> 20} MiB a report "
               "may take"]
        brief = {k: data[k] for k in ("job_id", "status", "fxport_version", "error") if k in data}
        page = _page(brief, cut, layout or run_dot)
    return page


def _page(data: dict[str, Any], cut: list[str], layout: DotLayout) -> str:
    try:
        manifest, unreadable = read_leniently(data)
    except ValueError as exc:  # no field to leave out would make it readable
        manifest, unreadable = Manifest(), {"manifest": str(exc)}
    builders = views(layout)
    sections = []
    for sid, title in SECTIONS:
        body = _section(sid, title, manifest, unreadable, builders[sid])
        if body is not None:  # None: the section does not apply to this job (no profile, not int8, no error, ...)
            sections.append(RenderedSection(sid, title, body))
    return ENV.get_template("page.html.j2").render(
        job=manifest.job_id or "local conversion", status=status_of(manifest), version=manifest.fxport_version,
        css=CSS, sections=sections, cut=cut, unreadable=unreadable, max_items=bounds.MAX_REPORT_ITEMS,
        max_chars=bounds.MAX_REPORT_CHARS) + "\n"


def _section(sid: str, title: str, manifest: Manifest, unreadable: dict[str, str],
             build: Callable[[Manifest], View | None]) -> Markup | None:
    """One section's HTML. A malformed or older manifest must not cost the reader the whole report:
    a section whose field could not be read, or that fails to render, says why in its place."""
    broken = [unreadable[field] for field in SECTION_FIELDS.get(sid, ()) if field in unreadable]
    if broken:
        return _missing(title, "; ".join(broken))
    try:
        view = build(manifest)
        if view is None:
            return None
        return Markup(ENV.get_template(f"sections/{sid}.html.j2").render(**view))
    except Exception as exc:
        return _missing(title, f"{type(exc).__name__}: {exc}")


def _missing(title: str, why: str) -> Markup:
    return Markup(ENV.get_template("missing.html.j2").render(title=title, why=why))


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
