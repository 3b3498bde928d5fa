"""Every string a manifest holds is text in report.html, in every section: the templates escape
what they print (autoescape), so a layer name, an error message or a label a model chose cannot
open a tag, whichever section prints it."""

from __future__ import annotations

import re
from typing import Any

from fxport.report import data, render_report

HOSTILE = "<script>alert(1)</script>"
ESCAPED = "&lt;script&gt;alert(1)&lt;/script&gt;"


def _everywhere(m: dict[str, Any]) -> dict[str, Any]:
    """`HOSTILE` in a string of every section: names, messages, labels, keys."""
    m["job_id"] = HOSTILE
    m["status"] = "failed"
    m["error"] = {"stage": HOSTILE, "code": "conversion_failed", "message": HOSTILE, "detail": HOSTILE}
    m["warnings"] = [HOSTILE]
    v = m["verification"][0]
    v.update(runtime=HOSTILE, passed=False, error=HOSTILE,
             tolerances={"precision": HOSTILE, "atol": 1e-4, "min_cosine": 0.99, "rule": HOSTILE})
    m["benchmark"] = {"results": [{"artifact": HOSTILE, "runtime": HOSTILE, "batch": 1, "p50_ms": 1.0, "p95_ms": 1.2,
                                   "mean_ms": 1.0, "throughput_per_s": 1000.0, "verified": True},
                                  {"artifact": "eager", "runtime": "torch", "batch": 1, "p50_ms": 3.0,
                                   "p95_ms": 3.5, "mean_ms": 3.0, "throughput_per_s": 333.0, "verified": True}],
                      "recommendation": {"artifact": HOSTILE, "batch": 1, "reason": HOSTILE},
                      "skipped": [{"artifact": HOSTILE, "batch": 8, "reason": HOSTILE}],
                      "machine": {"cpu": HOSTILE, "isa": [HOSTILE], "gpu": HOSTILE},
                      "noise": {"noisy": True, "worst": {"artifact": HOSTILE, "batch": 1, "spread": 2.0}}}
    m["profile"]["top_nodes"][0].update(node=HOSTILE, op=HOSTILE)
    m["quantization"]["layers"][0]["node"] = HOSTILE
    m["quantization"]["runtime"] = HOSTILE
    m["quantization"]["schemes"] = {HOSTILE: {"scheme": {"activations": HOSTILE}}}
    m["capture"]["method"] = HOSTILE
    m["capture"]["attempts"][0].update(method=HOSTILE, note=HOSTILE, source_line=HOSTILE)
    m["passes"][0].update(name=HOSTILE, notes=HOSTILE)
    m["graph_before"]["op_counts"][HOSTILE] = 1
    g = m["graph_after"]
    g["nodes"][1].update(name=HOSTILE, target=HOSTILE)
    g["nodes"][2]["inputs"] = [HOSTILE]
    m["artifacts"][0].update(path=HOSTILE, format=HOSTILE, sha256=HOSTILE)
    m["input"].update(format=HOSTILE, sha256=HOSTILE)
    m["inputs"]["inputs"][0].update(name=HOSTILE, dtype=HOSTILE)
    m["inputs"]["dynamic_dims"][HOSTILE] = {"min": 1, "opt": 2, "max": 3}
    m["outputs"] = [{"name": HOSTILE, "dtype": HOSTILE, "shape": [HOSTILE]}]
    m["signature"] = {"batch": {"note": HOSTILE}}
    m["toolchain"][HOSTILE] = HOSTILE
    m["spec"]["labels"] = {HOSTILE: HOSTILE}
    m["spec"]["precision"] = HOSTILE
    m["timings_s"][HOSTILE] = 1.0
    return m


def _sections(text: str) -> dict[str, str]:
    return dict(re.findall(r'<section id="([a-z]+)"[^>]*>(.*?)</section>', text, re.S))


def test_a_hostile_string_is_text_in_every_section(manifest: dict[str, Any]) -> None:
    text = render_report(_everywhere(manifest), layout=lambda source: b"<svg></svg>")
    sections = _sections(text)
    assert set(sections) == {sid for sid, _ in data.SECTIONS}  # every section rendered...
    for sid, html in sections.items():
        assert "could not be rendered" not in html, (sid, html[:300])  # ...whole
        assert ESCAPED in html, f"section {sid} does not show the hostile string"
        assert "<script" not in html.lower(), f"section {sid} has a script"
    head = text[:text.index("<main>")]
    assert ESCAPED in head and "<script" not in head.lower()  # the title and the header


def test_a_hostile_string_in_an_attribute_cannot_close_it(manifest: dict[str, Any]) -> None:
    breakout = '"><img src=x onerror=alert(2)>'
    manifest["graph_after"]["nodes"][1]["name"] = breakout
    manifest["spec"]["labels"] = {breakout: breakout}
    text = render_report(manifest, layout=lambda source: b"<svg></svg>")
    assert "<img" not in text and 'onerror=alert(2)>' not in text
    assert "&#34;&gt;&lt;img src=x onerror=alert(2)&gt;" in text
