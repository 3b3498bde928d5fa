"""profile_nodes: per-node timings land in the report; the graph is not touched."""

from __future__ import annotations

import torch
from torch import nn

from fxport.pass_catalog import ProfileNodesOptions
from fxport.workers.engine.passes import PassContext
from fxport.workers.engine.passes.profile_nodes import profile_nodes
from tests.workers.passes.conftest import assert_close, capture, context


def test_profile_lands_in_report_and_graph_is_unchanged(level):
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.Flatten(), nn.Linear(8 * 8 * 8, 4))
    model.eval()
    args = (torch.randn(2, 3, 12, 12),)
    gm = capture(model, args, level)
    code = gm.code
    ctx = context(level, args)

    result = profile_nodes(gm, ProfileNodesOptions(runs=2, top=3), ctx)

    gm.graph.lint()
    assert not result.changed
    assert result.graph_module.code == code
    profile = ctx.report["profile"]
    top = profile["top_nodes"]
    assert len(top) == 3
    assert [t["ms"] for t in top] == sorted((t["ms"] for t in top), reverse=True)
    assert profile["total_ms"] > 0 and profile["runs"] == 2
    assert all(set(t) == {"node", "op", "kind", "ms", "share"} and 0 <= t["share"] <= 1 for t in top)
    names = {n.name: n for n in gm.graph.nodes}
    assert all(t["node"] in names and names[t["node"]].op == t["kind"] and t["op"] for t in top)
    # which node is slowest depends on the machine's load; that the table names real nodes does not
    assert "profiled" in result.notes
    assert_close(result.graph_module, model, args)


def test_without_example_inputs_nothing_is_profiled():
    gm = torch.fx.symbolic_trace(nn.ReLU())
    ctx = PassContext(level="torch")
    result = profile_nodes(gm, ProfileNodesOptions(), ctx)
    assert not result.changed
    assert "profile" not in ctx.report
    assert "no example inputs" in result.notes
