"""Shared pieces for the report tests: the fixed int8 ResNet-18 manifest and small HTML probes."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

FIXTURE = Path(__file__).parent / "fixtures" / "manifest_resnet18_int8.json"


def require_tool(name: str, hint: str = "run scripts/install_report_deps.sh") -> str:
    """Path of system tool `name`. Missing: fail under CI=true (the install step broke), skip elsewhere."""
    path = shutil.which(name)
    if path:
        return path
    reason = f"{name} is not installed ({hint})"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(reason)
    pytest.skip(reason)


@pytest.fixture
def dot_binary() -> str:
    """Graphviz's `dot`, which lays out the FX graph drawings."""
    return require_tool("dot")


@pytest.fixture(scope="session")
def _fixture_manifest() -> dict[str, Any]:
    return json.loads(FIXTURE.read_text())


@pytest.fixture
def manifest(_fixture_manifest: dict[str, Any]) -> dict[str, Any]:
    """A fresh copy per test: tests edit it into failed / hostile / minimal variants."""
    return copy.deepcopy(_fixture_manifest)


class ReportIndex(HTMLParser):
    """Element ids, the tags inside each id'd table/section, and `<tr>` counts of each table body."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.body_rows: dict[str, int] = {}
        self.svg_in: dict[str, int] = {}  # section id -> number of <svg> inside it
        self._stack: list[tuple[str, str | None]] = []
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if a.get("id"):
            self.ids.add(a["id"])  # type: ignore[arg-type]
        if tag == "tr" and any(t == "tbody" for t, _ in self._stack):
            table = next((i for t, i in reversed(self._stack) if t == "table"), None)
            if table:
                self.body_rows[table] = self.body_rows.get(table, 0) + 1
        if tag == "svg":
            for t, i in self._stack:
                if t == "section" and i:
                    self.svg_in[i] = self.svg_in.get(i, 0) + 1
        if tag not in ("br", "meta", "img", "input", "hr", "link", "polygon", "path", "ellipse", "line", "rect",
                       "circle", "polyline", "stop"):
            self._stack.append((tag, a.get("id")))

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if a.get("id"):
            self.ids.add(a["id"])  # type: ignore[arg-type]

    def handle_endtag(self, tag: str) -> None:
        for k in range(len(self._stack) - 1, -1, -1):
            if self._stack[k][0] == tag:
                del self._stack[k:]
                return


REMOTE_REF = re.compile(
    r"""(?:\b(?:src|href|xlink:href|action|poster|data)\s*=\s*["']?\s*(?:https?:)?//)"""
    r"""|(?:url\(\s*["']?\s*(?:https?:)?//)|(?:@import)""",
    re.I,
)


def remote_refs(text: str) -> list[str]:
    """Every attribute or CSS reference in `text` that would fetch from the network."""
    return [m.group(0) for m in REMOTE_REF.finditer(text)]
