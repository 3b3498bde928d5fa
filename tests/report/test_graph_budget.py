"""The graph drawing's budget: a graph dot cannot lay out in a few seconds is drawn as a summary
that says so, and dot past its time limit leaves a note, never a hung report (issue 43)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from fxport.manifest_sections import GraphNode
from fxport.report import graph, render_report
from fxport.report.graph import MAX_DRAWN_NODES, MAX_LAYOUT_COST, layout_cost, plan_drawing, transitive_reduction
from tests.report.conftest import ReportIndex


@pytest.fixture(autouse=True)
def _fresh_layouts():
    """These tests lay graphs out with stand-ins for dot: none of theirs may be remembered for other tests."""
    graph.clear_layout_cache()
    yield
    graph.clear_layout_cache()


def densenet_like(blocks: tuple[int, ...] = (6, 12, 24, 16)) -> list[dict[str, Any]]:
    """A DenseNet-121's graph as torch.fx traces it: in each dense block every layer concatenates
    every feature map before it (bn, relu, 1x1 conv, bn, relu, 3x3 conv), then a transition."""
    nodes: list[dict[str, Any]] = [{"name": "x", "op": "placeholder", "target": "x", "inputs": []}]

    def add(name: str, target: str, inputs: list[str], op: str = "call_module") -> str:
        nodes.append({"name": name, "op": op, "target": target, "inputs": inputs})
        return name

    last = add("conv0", "features.conv0", ["x"])
    for b, layers in enumerate(blocks, 1):
        features = [last]
        for i in range(1, layers + 1):
            p = f"b{b}_l{i}"
            h = add(f"{p}_cat", "torch.cat", list(features), op="call_function")
            for part in ("norm1", "relu1", "conv1", "norm2", "relu2", "conv2"):
                h = add(f"{p}_{part}", f"features.denseblock{b}.denselayer{i}.{part}", [h])
            features.append(h)
        last = add(f"b{b}_cat", "torch.cat", list(features), op="call_function")
        for part in ("norm", "relu", "conv", "pool"):
            last = add(f"t{b}_{part}", f"features.transition{b}.{part}", [last])
    add("output", "output", [last], op="output")
    return nodes


def test_a_dense_graph_is_summarized_within_the_budget() -> None:
    nodes = [GraphNode.model_validate(n) for n in densenet_like()]
    drawable = nodes  # no parameters or shape checks in this graph
    every_node = plan_drawing(drawable[:40])
    assert len(every_node.boxes) == 40 and not every_node.notes  # a small graph: every node its own box

    plan = plan_drawing(drawable)
    assert len(plan.boxes) <= MAX_DRAWN_NODES and layout_cost(len(plan.boxes), plan.edges) <= MAX_LAYOUT_COST
    assert len(plan.boxes) < len(nodes) // 4  # each dense layer's six modules are one box
    assert any("this is a summary" in note for note in plan.notes)
    assert any("edges are left out" in note for note in plan.notes)  # the concatenations' fan-in


def test_the_transitive_reduction_keeps_what_no_longer_path_implies() -> None:
    # 0 -> 1 -> 2, and 0 -> 2 (implied); 0 -> 3 stands alone
    assert transitive_reduction(4, [(0, 1), (1, 2), (0, 2), (0, 3)]) == [(0, 1), (1, 2), (0, 3)]


def test_a_densenet121_sized_report_draws_in_seconds(manifest: dict[str, Any], dot_binary: str) -> None:
    """Drawn whole, 300 of these nodes kept dot past its minute, twice (before and after the passes)."""
    g = {"node_count": 0, "op_counts": {}, "nodes": densenet_like()}
    g["node_count"] = len(g["nodes"])
    manifest["graph_before"] = manifest["graph_after"] = g
    started = time.monotonic()
    text = render_report(manifest)
    assert time.monotonic() - started < 30  # about 1 s on the 2-core CI machine
    idx = ReportIndex(text)
    assert idx.svg_in.get("graph") == 2 and "Graph not drawn" not in text
    assert "this is a summary" in text


def test_dot_past_its_time_limit_leaves_a_note_once_per_graph(manifest: dict[str, Any]) -> None:
    calls = []

    def slow(source: bytes) -> bytes:
        calls.append(source)
        raise subprocess.TimeoutExpired(["dot", "-Tsvg"], graph.DOT_TIMEOUT_S)

    manifest["graph_after"] = manifest["graph_before"]  # the same architecture: tried once per report
    text = render_report(manifest, layout=slow)
    assert text.count(f"within {graph.DOT_TIMEOUT_S} s. The node table below lists the graph.") == 2
    assert len(calls) == 1
    assert ReportIndex(text).body_rows["graph-after-nodes"] == len(manifest["graph_after"]["nodes"])
    # a busy machine is no property of the graph: the next report tries again
    assert "Graph not drawn" not in render_report(manifest, layout=lambda source: b"<svg></svg>")


def test_run_dot_is_stopped_at_its_time_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A `dot` that never returns costs DOT_TIMEOUT_S, not the report."""
    stuck = tmp_path / "dot"
    stuck.write_text("#!/bin/sh\nexec sleep 60\n")
    stuck.chmod(0o755)
    monkeypatch.setattr(graph, "find_dot", lambda path=None: str(stuck))
    monkeypatch.setattr(graph, "DOT_TIMEOUT_S", 0.5)
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        graph.run_dot(b"digraph g { a -> b }")
    assert time.monotonic() - started < 10
