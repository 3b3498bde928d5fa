"""report.html from a fixed manifest: every section renders, optional ones vanish, hostile strings stay text."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from fxport.report import COLLAPSE_ABOVE_NODES, MAX_DRAWN_NODES, render_report, write_report
from tests.report.conftest import ReportIndex, remote_refs

ALWAYS = ("overview", "parity", "capture", "passes", "graph", "artifacts", "input", "toolchain", "spec", "timings")


def _index(m: dict[str, Any]) -> tuple[str, ReportIndex]:
    text = render_report(m)
    return text, ReportIndex(text)


# ---------------------------------------------------------------- each section from the fixed manifest


def test_every_section_of_the_int8_resnet18_report_renders(manifest: dict[str, Any]) -> None:
    text, idx = _index(manifest)
    for sid in ALWAYS + ("profile", "quantization", "warnings"):
        assert sid in idx.ids, f"section #{sid} missing"
    assert "error" not in idx.ids  # a succeeded job has no error section
    assert "could not be rendered" not in text
    assert text.startswith("<!DOCTYPE html>")


def test_input_digest_spec_and_toolchain(manifest: dict[str, Any]) -> None:
    text, idx = _index(manifest)
    assert manifest["input"]["sha256"] in text
    assert idx.body_rows["toolchain-table"] == len(manifest["toolchain"])
    # the spec read as a table: one row per leaf, nested keys dotted, not a line of JSON
    assert idx.body_rows["spec-table"] > len(manifest["spec"])
    assert "<code>verify.atol</code></td><td>0.0001</td>" in text.replace("\n", "")
    assert "<code>targets</code></td><td>torchscript, onnx, exported_program, fx_source</td>" in text
    assert idx.body_rows["signature-table"] == 1 + len(manifest.get("outputs") or [])  # inputs, then outputs
    assert "2.13.0+cpu" in text and "not installed" in text  # tensorrt is None in the fixture


def test_the_signature_table_lists_outputs_and_the_batch_axis(manifest: dict[str, Any]) -> None:
    manifest["outputs"] = [{"name": "logits", "dtype": "float32", "shape": ["batch", 10]}]
    manifest["signature"] = {"batch": {"dim": "batch", "note": "dim 0 of every input and output is the dynamic "
                                                              "dim 'batch'"}}
    text, idx = _index(manifest)
    assert idx.body_rows["signature-table"] == 2
    assert "<td>output</td><td>logits</td>" in text
    # markupsafe writes ' as &#39; (html.escape wrote &#x27;): the same character
    assert "Batch axis: dim 0 of every input and output is the dynamic dim &#39;batch&#39;." in text


def test_capture_ladder_shows_which_rung_worked_and_why_others_failed(manifest: dict[str, Any]) -> None:
    manifest["capture"] = {"method": "export", "level": "aten", "attempts": [
        {"method": "export", "strict": False, "ok": False, "error": "data-dependent control flow",
         "source_line": "model.py:42: if x.sum() > 0:"},
        {"method": "export", "strict": True, "ok": True},
    ]}
    text, idx = _index(manifest)
    assert idx.body_rows["capture-table"] == 2
    assert "on rung 2 of 2" in text
    assert "data-dependent control flow" in text and "model.py:42: if x.sum() &gt; 0:" in text
    assert '<tr class="fail">' in text and '<tr class="ok">' in text


def test_passes_table_and_operator_count_changes(manifest: dict[str, Any]) -> None:
    text, idx = _index(manifest)
    assert idx.body_rows["passes-table"] == len(manifest["passes"])
    assert "folded 20 batch_norm into conv2d" in text
    assert '<tr class="changed">' in text
    # batch_norm goes 20 -> 0 with fuse_conv_bn
    assert "-20</span>" in text
    assert idx.body_rows["opcount-table"] == len(set(manifest["graph_before"]["op_counts"])
                                                 | set(manifest["graph_after"]["op_counts"]))


def test_artifact_table_has_every_file_with_size_and_digest(manifest: dict[str, Any]) -> None:
    text, idx = _index(manifest)
    assert idx.body_rows["artifacts-table"] == len(manifest["artifacts"])
    for a in manifest["artifacts"]:
        assert a["sha256"] in text and a["path"] in text


def test_parity_table_one_row_per_artifact_coloured(manifest: dict[str, Any]) -> None:
    manifest["verification"][1].update(passed=False, cosine=0.91, max_abs_diff=0.5)
    text, idx = _index(manifest)
    assert idx.body_rows["parity-table"] == len(manifest["verification"])
    assert text.count('<td class="status ok">pass</td>') == len(manifest["verification"]) - 1
    assert text.count('<td class="status fail">FAIL</td>') == 1
    assert "[4, 3, 64, 64]" in text  # every shape checked is listed


def test_the_parity_header_states_the_tolerances_each_verdict_used(manifest: dict[str, Any]) -> None:
    """An int8 job is judged by int8's tolerances (cosine), not the spec's fp32 atol: each record
    carries the ones its verdict used (precision.Tolerances.as_dict), and the header says those."""
    int8 = {"precision": "int8", "min_cosine": 0.98, "max_unmatched_detections": 0}
    for record in manifest["verification"]:
        record["tolerances"] = int8
    text, _ = _index(manifest)
    note = re.search(r"tolerances \(int8\): ([^<]*)", text)
    assert note, "no int8 tolerances in the parity header"
    assert "min cosine=0.98" in note.group(1) and "not judged" in note.group(1) and "atol" not in note.group(1)
    assert "atol=0.0001" not in text  # the spec's fp32 default, which no verdict used

    manifest["verification"][0]["tolerances"] = {"precision": "fp32", "atol": 1e-4, "rtol": 1e-3, "min_cosine": 0.999}
    text, _ = _index(manifest)  # two sets: each named with its artifacts
    assert "torchscript (torch.jit): tolerances (fp32): atol=0.0001" in text
    assert "onnx (onnxruntime), " in text and "tolerances (int8)" in text


def test_parity_rows_per_shape_when_the_manifest_breaks_them_down(manifest: dict[str, Any]) -> None:
    rec = manifest["verification"][0]
    rec["per_shape"] = [{"shape": s, "max_abs_diff": 1e-6, "max_rel_diff": 1e-5, "cosine": 1.0, "passed": i != 2}
                        for i, s in enumerate(rec["shapes_checked"])]
    _, idx = _index(manifest)
    assert idx.body_rows["parity-table"] == len(manifest["verification"]) - 1 + len(rec["shapes_checked"])


def test_profile_bar_chart_is_inline_svg(manifest: dict[str, Any]) -> None:
    text, idx = _index(manifest)
    assert idx.svg_in.get("profile") == 1
    assert "profile-chart" in idx.ids
    top = manifest["profile"]["top_nodes"]
    assert idx.body_rows["profile-table"] == len(top)
    assert f"{top[0]['node']} (linear)" in text  # chart label: node and short op


def test_sqnr_chart_marks_fallback_layers(manifest: dict[str, Any]) -> None:
    text, idx = _index(manifest)
    layers = manifest["quantization"]["layers"]
    fallbacks = [layer for layer in layers if layer.get("fallback")]
    assert fallbacks, "the fixture must keep one fallback layer"
    assert idx.svg_in.get("quantization") == 1
    assert idx.body_rows["quantization-table"] == len(layers)
    assert text.count('<tr class="fallback">') == len(fallbacks)
    assert f"{fallbacks[0]['node']} (fallback)" in text  # the chart's axis label
    assert "#d93025" in text  # the fallback bar's colour


def test_graph_before_and_after_are_drawn_and_big_ones_collapse(manifest: dict[str, Any], dot_binary: str) -> None:
    text, idx = _index(manifest)
    assert "Graph not drawn" not in text, text[text.find("Graph not drawn"):][:300]
    assert idx.svg_in.get("graph") == 2
    assert "graph-before" in idx.ids and "graph-after" in idx.ids
    assert "graph-before-graph0" in idx.ids and "graph-after-graph0" in idx.ids  # dot's ids made unique
    assert idx.body_rows["graph-after-nodes"] == len(manifest["graph_after"]["nodes"])
    boxes = sum(1 for n in manifest["graph_after"]["nodes"] if n["op"] != "get_attr")
    assert boxes > COLLAPSE_ABOVE_NODES
    assert '<details class="graph-details"><summary>' in text  # collapsed, not open


def test_small_graph_is_drawn_open(manifest: dict[str, Any], dot_binary: str) -> None:
    small = {"node_count": 3, "op_counts": {"aten.relu.default": 1}, "nodes": [
        {"name": "x", "op": "placeholder", "target": "x", "inputs": []},
        {"name": "relu", "op": "call_function", "target": "aten.relu.default", "inputs": ["x"]},
        {"name": "output", "op": "output", "target": "output", "inputs": ["relu"]}]}
    manifest["graph_before"] = manifest["graph_after"] = small
    text, _ = _index(manifest)
    assert text.count('<details class="graph-details" open>') == 2


def test_a_graph_past_the_budget_is_drawn_as_a_summary_and_says_so(manifest: dict[str, Any]) -> None:
    n = MAX_DRAWN_NODES + 50
    nodes = [{"name": "x", "op": "placeholder", "target": "x", "inputs": []}]
    nodes += [{"name": f"relu_{i}", "op": "call_function", "target": "aten.relu.default",
               "inputs": [nodes[-1]["name"] if i == 0 else f"relu_{i - 1}"]} for i in range(n)]
    manifest["graph_after"] = {"node_count": 5000, "op_counts": {"aten.relu.default": n}, "nodes": nodes}
    text, idx = _index(manifest)
    # the input stays a box of its own; the chain of relus, each feeding only the next, is one box
    assert "Graph diagram (5000 nodes, 2 drawn as boxes)" in text
    assert f"{n + 1} nodes to draw are more than dot lays out in a few seconds: this is a summary" in text
    assert f"({n + 1} nodes in 2 boxes)" in text
    assert f"lists only the first {n + 1} of 5000 nodes" in text
    assert idx.body_rows["graph-after-nodes"] == n + 1  # the table keeps them all


# ---------------------------------------------------------------- optional sections and failures


def test_without_profile_or_quantization_those_sections_are_absent(manifest: dict[str, Any]) -> None:
    manifest["profile"] = None
    del manifest["quantization"]
    manifest["warnings"] = []
    text, idx = _index(manifest)
    for sid in ("profile", "quantization", "warnings"):
        assert sid not in idx.ids
        assert f'href="#{sid}"' not in text
    for sid in ALWAYS:
        assert sid in idx.ids


def test_failed_job_renders_the_error_first(manifest: dict[str, Any]) -> None:
    manifest.update(status="failed", capture=None, passes=[], artifacts=[], verification=[], profile=None,
                    quantization=None, error={"stage": "capture", "code": "conversion_failed",
                                              "message": "every capture rung failed: fx: Proxy cannot be iterated",
                                              "detail": None, "field": None})
    for k in ("graph_before", "graph_after", "inputs"):
        manifest.pop(k)
    text, idx = _index(manifest)
    assert "error" in idx.ids
    assert text.index('id="error"') < text.index('id="overview"')
    assert "failed during capture" in text and "Proxy cannot be iterated" in text
    assert "status-badge-failed" in idx.ids
    assert "stopped before the graph was captured" in text
    assert "could not be rendered" not in text


def test_a_malformed_section_costs_only_that_section(manifest: dict[str, Any]) -> None:
    manifest["passes"] = "not a list of records"
    text, idx = _index(manifest)
    assert "The passes section could not be rendered" in text
    assert "parity-table" in idx.ids


def _with_benchmark(m: dict[str, Any]) -> dict[str, Any]:
    from fxport.benchmark import recommend

    def row(artifact: str, batch: int, p50: float, verified: bool = True) -> dict[str, Any]:
        return {"artifact": artifact, "runtime": artifact, "batch": batch, "p50_ms": p50, "p95_ms": p50 * 1.2,
                "mean_ms": p50, "throughput_per_s": batch * 1000 / p50, "peak_rss_mib": 612.0, "threads": 2,
                "runs": 50, "verified": verified}

    results = [row("eager", 1, 20.0), row("eager", 8, 120.0), row("onnx", 1, 6.0), row("onnx", 8, 30.0),
               row("torchscript", 1, 9.0), row("torchscript", 8, 50.0)]
    m["benchmark"] = {"results": results, "recommendation": recommend(results),
                      "skipped": [{"artifact": "exported_program", "batch": 8, "reason": "only 2 run(s) fit"}],
                      "machine": {"cpu": "AMD EPYC 9B14", "cores": 2, "usable_cpus": 2, "isa": ["avx2", "avx512f"],
                                  "arch": "x86_64", "gpu": None},
                      "settings": {"batches": [1, 8], "warmup": 10, "runs": 50, "threads": 2, "max_seconds": 120.0},
                      "seconds": 14.2}
    return m


def test_benchmark_section_charts_table_and_the_recommendation_first(manifest: dict[str, Any]) -> None:
    text, idx = _index(_with_benchmark(manifest))
    assert "benchmark" in idx.ids and "benchmark-table" in idx.ids
    assert idx.body_rows["benchmark-table"] == 6
    for chart in ("benchmark-latency-1-box", "benchmark-latency-8-box", "benchmark-speedup-box"):
        assert chart in idx.ids, chart
    # what to deploy opens the overview, before the cards
    overview = text[text.index('<section id="overview"'):]
    assert overview.index('id="recommendation"') < overview.index('class="cards"')
    assert "Recommended: onnx at batch 8" in overview
    assert "3.3× eager at batch 1, 4.0× at 8" in text
    assert "exported_program at batch 8: only 2 run(s) fit" in text and "AMD EPYC 9B14" in text
    assert "could not be rendered" not in text


def test_without_a_benchmark_there_is_no_benchmark_section(manifest: dict[str, Any]) -> None:
    text, idx = _index(manifest)
    assert "benchmark" not in idx.ids and 'id="recommendation"' not in text


# ---------------------------------------------------------------- safety: escaping, no network


HOSTILE = "<script>alert(1)</script>"
HOSTILE_ATTR = '"><img src=x onerror=alert(2)>'


def _poison(m: dict[str, Any]) -> dict[str, Any]:
    g = m["graph_after"]
    g["nodes"][1]["name"] = HOSTILE
    g["nodes"][1]["target"] = HOSTILE_ATTR + "-->"
    g["nodes"][2]["inputs"] = [HOSTILE]
    g["op_counts"][HOSTILE] = 1
    m["job_id"] = HOSTILE
    m["warnings"] = [HOSTILE, "see https://evil.example/x.js"]
    m["passes"][0]["notes"] = HOSTILE_ATTR
    m["profile"]["top_nodes"][0]["node"] = HOSTILE
    m["quantization"]["layers"][0]["node"] = HOSTILE
    m["artifacts"][0]["path"] = HOSTILE_ATTR
    m["capture"]["attempts"][0]["note"] = HOSTILE
    m["toolchain"]["torch"] = HOSTILE
    m["spec"]["labels"] = {HOSTILE: HOSTILE_ATTR}
    m["error"] = {"stage": HOSTILE, "message": HOSTILE_ATTR}
    _with_benchmark(m)
    m["benchmark"]["results"][2]["artifact"] = HOSTILE
    m["benchmark"]["recommendation"]["reason"] = HOSTILE_ATTR
    m["benchmark"]["machine"]["cpu"] = HOSTILE
    return m


def test_hostile_strings_from_the_manifest_are_escaped_everywhere(manifest: dict[str, Any], dot_binary: str) -> None:
    text = render_report(_poison(manifest))
    assert "<script" not in text.lower()  # the report never has a script, so any would be injected
    assert "<img" not in text.lower()
    assert "onerror=alert(2)>" not in text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text
    assert 'id="graph-after-graph0"' in text  # the poisoned graph was drawn, not skipped
    assert "could not be rendered" not in text


def test_report_has_no_remote_references(manifest: dict[str, Any]) -> None:
    for m in (manifest, _poison(json.loads(json.dumps(manifest)))):
        text = render_report(m)
        assert remote_refs(text) == []
        assert "Content-Security-Policy" in text and "default-src 'none'" in text
        # the only links are the in-page navigation
        assert all(h.startswith("#") for h in re.findall(r'\bhref="([^"]*)"', text))


def test_remote_ref_probe_catches_what_it_must() -> None:
    bad = ['<img src="https://x.example/a.png">', "<script src='//cdn.example/x.js'></script>",
           '<link href="http://x.example/s.css">', "<style>a{background:url(https://x.example/i.png)}</style>",
           "<style>@import 'x.css';</style>", '<image xlink:href="https://x.example/i.png"/>']
    for b in bad:
        assert remote_refs(b), b
    assert remote_refs('<svg xmlns="http://www.w3.org/2000/svg"><a href="#parity">x</a></svg>') == []


# ---------------------------------------------------------------- missing tools degrade, never crash


def test_missing_dot_binary_leaves_a_note_and_the_tables(manifest: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
                                                         tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no `dot` on an empty PATH
    from fxport.report import clear_layout_cache

    clear_layout_cache()  # nothing laid out earlier
    text, idx = _index(manifest)
    assert "Graphviz <code>dot</code> is not installed" in text
    assert idx.svg_in.get("graph") is None
    assert "graph-after-nodes" in idx.ids
    assert idx.svg_in.get("profile") == 1  # charts don't need dot


def test_missing_python_libraries_leave_notes(manifest: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pygal", None)  # import pygal -> ImportError
    monkeypatch.setitem(sys.modules, "graphviz", None)
    text, idx = _index(manifest)
    assert "pygal is not installed" in text and "graphviz is not installed" in text
    assert not idx.svg_in
    assert "profile-table" in idx.ids and "quantization-table" in idx.ids


# ---------------------------------------------------------------- files, CLI, thin-client imports


def test_write_report_puts_report_html_beside_the_manifest(tmp_path: Path, manifest: dict[str, Any]) -> None:
    mpath = tmp_path / "job" / "manifest.json"
    mpath.parent.mkdir()
    mpath.write_text(json.dumps(manifest))
    out = write_report(mpath)
    assert out == mpath.with_name("report.html")
    assert 'id="parity-table"' in out.read_text()


def test_report_command_writes_and_prints_the_path(tmp_path: Path, manifest: dict[str, Any]) -> None:
    import typer

    from fxport.cli.report_command import report_command

    app = typer.Typer()
    app.command()(report_command)
    mpath = tmp_path / "manifest.json"
    mpath.write_text(json.dumps(manifest))
    dest = tmp_path / "out" / "r.html"
    res = CliRunner().invoke(app, [str(mpath), "--out", str(dest)])
    assert res.exit_code == 0, res.output
    assert str(dest) in res.output and dest.is_file()

    missing = CliRunner().invoke(app, [str(tmp_path / "nope.json")])
    assert missing.exit_code == 2 and "does not exist" in missing.output
    (tmp_path / "bad.json").write_text("{not json")
    bad = CliRunner().invoke(app, [str(tmp_path / "bad.json")])
    assert bad.exit_code == 2 and "not a readable manifest" in bad.output


def test_renderer_imports_neither_torch_nor_onnx() -> None:
    code = ("import sys, fxport.report, fxport.cli.report_command; "
            "bad = [m for m in ('torch', 'onnx', 'onnxruntime', 'tensorrt') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


def test_shape_checks_are_left_out_of_the_drawing_and_counted() -> None:
    from fxport.report import shape_checks

    nodes = [
        {"name": "x", "op": "placeholder", "target": "x", "inputs": []},
        {"name": "sym_size_int", "op": "call_function", "target": "aten.sym_size.int", "inputs": ["x"]},
        {"name": "ge", "op": "call_function", "target": "_operator.ge", "inputs": ["sym_size_int"]},
        {"name": "_assert_scalar", "op": "call_function", "target": "aten._assert_scalar.default",
         "inputs": ["ge"]},
        {"name": "add", "op": "call_function", "target": "_operator.add", "inputs": ["x", "sym_size_int"]},
        {"name": "size", "op": "call_method", "target": "size", "inputs": ["x"]},  # a traced graph's checks
        {"name": "getitem", "op": "call_function", "target": "_operator.getitem", "inputs": ["size"]},
        {"name": "eq", "op": "call_function", "target": "_operator.eq", "inputs": ["getitem"]},
        {"name": "_assert", "op": "call_function", "target": "torch._assert", "inputs": ["eq"]},
        {"name": "linear", "op": "call_function", "target": "aten.linear.default", "inputs": ["x"]},
        {"name": "output", "op": "output", "target": "output", "inputs": ["linear"]},
    ]
    # a size read, a comparison of sizes and the assert go; an operator over a tensor stays
    assert shape_checks(nodes) == {"sym_size_int", "ge", "_assert_scalar", "size", "getitem", "eq", "_assert"}
    m = {"graph_before": {"nodes": nodes, "node_count": len(nodes)}, "status": "succeeded"}
    text, _ = _index(m)
    assert "Graph diagram (11 nodes, 4 drawn as boxes)" in text
    assert "7 shape-check nodes" in text


@pytest.mark.parametrize("path", sorted((Path(__file__).parents[1] / "fixtures" / "manifests").glob("*.json"))
                         + [Path(__file__).parent / "fixtures" / "manifest_resnet18_int8.json"], ids=lambda p: p.name)
def test_a_manifest_of_every_schema_version_renders_whole(path: Path) -> None:
    """Manifests written before versioning (schema 1) and by this version (3) read through the type and render
    every section that applies, none of them in part."""
    text = render_report(json.loads(path.read_text()), layout=lambda source: b"<svg></svg>")
    assert "could not be rendered" not in text and 'id="unreadable"' not in text
    for sid in ALWAYS:
        assert f'<section id="{sid}"' in text
