"""dead_code_elimination: unused nodes and what only they referenced go; guards and outputs stay."""

from __future__ import annotations

import torch
from torch import nn

from tests.workers.passes.conftest import apply, assert_close, capture


class WithDeadCode(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.unused = nn.Linear(4, 4)

    def forward(self, x):
        self.unused(x)  # result discarded: symbolic_trace records it, torch.export drops it
        _ = x * 2
        return torch.relu(self.fc(x))


def test_dead_nodes_and_their_attributes_are_removed(level):
    model = WithDeadCode().eval()
    args = (torch.randn(2, 4),)
    gm = capture(model, args, level)
    if level != "torch":  # export already dropped the dead code; plant a dead op to remove
        x = next(n for n in gm.graph.nodes if n.op == "placeholder")
        with gm.graph.inserting_after(x):
            gm.graph.call_function(torch.ops.aten.mul.Tensor, (x, 2))
        gm.recompile()
    n_before = len(gm.graph.nodes)

    result = apply("dead_code_elimination", gm, level, args)

    assert result.changed
    assert len(result.graph_module.graph.nodes) < n_before
    assert "removed" in result.notes
    assert_close(result.graph_module, model, args)
    assert not hasattr(result.graph_module, "unused")
    assert isinstance(model.unused, nn.Linear)  # the user's model keeps its module
    if level != "torch":  # ep.module()'s input guard has no users but is impure: it must stay
        assert any(n.target == "_guards_fn" for n in result.graph_module.graph.nodes)


def test_no_dead_code_is_unchanged(level):
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU()).eval()
    args = (torch.randn(2, 4),)
    gm = capture(model, args, level)
    code = gm.code
    result = apply("dead_code_elimination", gm, level, args)
    assert not result.changed
    assert result.notes == "no dead code"
    assert result.graph_module.code == code


def shift(t, amount, inplace=False):
    """A user's function with an `inplace` flag, kept whole in the graph by torch.fx.wrap."""
    return t.add_(amount) if inplace else t + amount


torch.fx.wrap("shift")


class InPlaceUnusedResults(nn.Module):
    """In-place calls whose results nobody reads: torch's own eliminate_dead_code drops them."""

    def __init__(self) -> None:
        super().__init__()
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        y = x.clone()
        y.add_(1)
        torch.relu_(y)
        z = x * 2
        self.relu(z)
        w = x - 1
        shift(w, 1.0, True)  # inplace by position: found through the function's signature
        return y + z + w


def test_inplace_ops_with_unused_results_are_kept():
    model = InPlaceUnusedResults().eval()
    args = (torch.randn(3, 4),)
    for _ in range(2):  # the second graph is judged from the signatures cached for the first
        gm = capture(model, args, "torch")
        n_before = len(gm.graph.nodes)
        result = apply("dead_code_elimination", gm, "torch", args)
        assert not result.changed
        assert len(result.graph_module.graph.nodes) == n_before
        assert_close(result.graph_module, model, args)
