"""fold_constants: parameter-only subgraphs become one buffer; random ops and big results do not."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tests.workers.passes.conftest import apply, assert_close, capture


class WithConstants(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(5, 4))
        self.b = nn.Parameter(torch.randn(5))
        self.register_buffer("scale", torch.rand(5, 1) + 0.5)

    def forward(self, x):
        weight = (self.w * self.scale + 1.0).t()  # depends only on attributes
        return x @ weight + self.b.sum()


class WithRandom(nn.Module):
    """randn_like of a parameter reads only constants, but must draw anew on every call."""

    def __init__(self) -> None:
        super().__init__()
        self.b = nn.Parameter(torch.zeros(4))

    def forward(self, x):
        return x + torch.randn_like(self.b)


def compute_nodes(gm) -> int:
    return sum(n.op in ("call_function", "call_method", "call_module") for n in gm.graph.nodes)


def test_constant_subgraphs_are_folded(level):
    model = WithConstants().eval()
    args = (torch.randn(3, 4),)
    gm = capture(model, args, level)
    before = compute_nodes(gm)
    user_tensors = {k: v.clone() for k, v in model.state_dict().items()}

    result = apply("fold_constants", gm, level, args)

    assert result.changed
    assert "folded 2 constant subgraphs" in result.notes
    assert compute_nodes(result.graph_module) < before
    # w·scale+1 reads two attributes; b.sum() reads one and is named after it
    assert {name for name, _ in result.graph_module.named_buffers()} == {"_folded_const", "b_folded"}
    assert not any(name in ("w", "scale") for name, _ in result.graph_module.named_parameters())
    assert_close(result.graph_module, model, args)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in user_tensors.items())


def test_results_over_max_elements_are_skipped():
    model = WithConstants().eval()
    args = (torch.randn(3, 4),)
    result = apply("fold_constants", capture(model, args, "aten"), "aten", args, max_elements=4)
    assert result.changed  # b.sum() (1 element) still folds
    assert "20 elements > max_elements 4" in result.notes
    assert_close(result.graph_module, model, args)


def test_random_ops_are_not_folded(level):
    model = WithRandom().eval()
    args = (torch.randn(2, 4),)
    result = apply("fold_constants", capture(model, args, level), level, args)
    assert not result.changed
    assert any("randn" in str(n.target) for n in result.graph_module.graph.nodes)


def test_no_constants_is_unchanged(level):
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU()).eval()
    args = (torch.randn(2, 4),)
    gm = capture(model, args, level)
    if level == "aten_decomposed":  # linear became addmm(b, x, permute(w)): permute(w) is constant
        result = apply("fold_constants", gm, level, args)
        assert result.changed and "permute" in result.notes
        assert_close(result.graph_module, model, args)
        return
    code = gm.code
    result = apply("fold_constants", gm, level, args)
    assert not result.changed
    assert result.notes == "no constant subgraphs"
    assert result.graph_module.code == code


class CountsCalls(nn.Module):
    """A buffer the forward updates in place: what is computed from it is not a constant."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros(1))
        self.w = nn.Parameter(torch.randn(4))

    def forward(self, x):
        self.calls.add_(1)
        return x * (self.calls * 2) + self.w.abs()


@pytest.mark.parametrize("level", ["torch", "aten"])
def test_attributes_written_in_place_are_not_constants(level):
    model = CountsCalls().eval()
    reference = copy.deepcopy(model)  # the graph shares `calls` with model; the reference counts alone
    args = (torch.randn(2, 4),)
    if level == "torch":
        # plain symbolic_trace would run calls.add_(1) once at trace time and bake calls * 2
        # into a constant; proxying buffers records the update, as an engine capture should
        tracer = torch.fx.Tracer()
        tracer.proxy_buffer_attributes = True
        gm = torch.fx.GraphModule(model, tracer.trace(model))
    else:  # export records the update as aten.copy_(calls, calls + 1)
        gm = capture(copy.deepcopy(model), args, level)
    result = apply("fold_constants", gm, level, args)
    assert result.changed
    assert "1 abs" in result.notes  # w.abs() folds; calls * 2 does not
    for _ in range(3):  # equal on every call, not just the first
        assert_close(result.graph_module, reference, args)
