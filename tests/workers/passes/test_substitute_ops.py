"""substitute_ops: allowlisted swaps, exact where flagged preserving, gated where not."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError
from torch import nn

from fxport.pass_catalog import SUBSTITUTIONS, SubstituteOpsOptions
from fxport.workers.engine.passes import PassContext
from fxport.workers.engine.passes.substitute_ops import SWAPS, substitute_ops
from tests.workers.passes.conftest import apply, assert_close, call_targets, capture

GELU_TANH_MAX_ERROR = 5e-4  # measured max |exact − tanh| GELU over [-12, 12]: 4.74e-4


class Activations(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.relu6, self.gelu, self.silu = nn.ReLU6(), nn.GELU(), nn.SiLU()

    def forward(self, x):
        x = self.fc(x) * 4
        a = self.relu6(x) + F.relu6(-x)
        b = self.gelu(x) + F.gelu(-x)
        c = self.silu(x) + F.silu(-x)
        return a, b, c


class InplaceSilu(nn.Module):
    """SiLU(inplace=True) overwrites h, which the add reads afterwards: the swap must keep that."""

    def __init__(self) -> None:
        super().__init__()
        self.act = nn.SiLU(inplace=True)

    def forward(self, x):
        h = x * 1.0
        y = self.act(h)
        return y + h


def test_allowlist_has_one_source_of_truth():
    assert set(SWAPS) == set(SUBSTITUTIONS)


def test_relu6_to_hardtanh_is_exact(level):
    model = Activations().eval()
    args = (torch.randn(4, 8),)
    result = apply("substitute_ops", capture(model, args, level), level, args, swaps=["relu6_to_hardtanh"])
    targets = call_targets(result.graph_module)
    # nn.ReLU6 subclasses nn.Hardtanh, so export already records it as aten.hardtanh; only
    # F.relu6 stays aten.relu6. run_decompositions() spells that one as hardtanh too.
    expected = {"torch": "2 nodes", "aten": "1 node ", "aten_decomposed": "nothing to swap"}[level]
    assert f"relu6_to_hardtanh: {expected}" in result.notes
    assert result.changed == (level != "aten_decomposed")
    assert not any("relu6" in t.lower() for t in targets)
    with torch.no_grad():  # bit-identical: hardtanh(0, 6) is the kernel relu6 runs
        assert torch.equal(result.graph_module(*args)[0], model(*args)[0])
    assert_close(result.graph_module, model, args)


def test_gelu_to_tanh_is_skipped_without_permission(level):
    model = Activations().eval()
    args = (torch.randn(4, 8),)
    gm = capture(model, args, level)
    code = gm.code
    result = apply("substitute_ops", gm, level, args, swaps=["gelu_to_tanh_gelu"])
    assert not result.changed
    assert "skipped 2 nodes" in result.notes and "allow_numerics_change" in result.notes
    assert result.graph_module.code == code


def test_gelu_to_tanh_with_permission_within_documented_error(level):
    model = Activations().eval()
    args = (torch.randn(4, 8),)
    result = apply(
        "substitute_ops", capture(model, args, level), level, args,
        swaps=["gelu_to_tanh_gelu"], allow_numerics_change=True,
    )
    assert result.changed
    exact = [n for n in result.graph_module.graph.nodes if "gelu" in str(n.target).lower()
             and n.kwargs.get("approximate") != "tanh"]
    assert exact == []
    assert_close(result.graph_module, model, args, atol=2 * GELU_TANH_MAX_ERROR)  # a sum of two GELUs


def test_silu_to_x_sigmoid(level):
    model = Activations().eval()
    args = (torch.randn(4, 8),)
    result = apply("substitute_ops", capture(model, args, level), level, args, swaps=["silu_to_x_sigmoid"])
    if level == "aten_decomposed":  # already x * sigmoid(x) after run_decompositions()
        assert not result.changed
    else:
        assert result.changed
    assert not any("silu" in t.lower() for t in call_targets(result.graph_module))
    assert_close(result.graph_module, model, args)


def test_inplace_silu_keeps_its_side_effect():
    model = InplaceSilu().eval()
    args = (torch.randn(3, 5),)
    result = apply("substitute_ops", capture(model, args, "torch"), "torch", args, swaps=["silu_to_x_sigmoid"])
    assert result.changed
    assert_close(result.graph_module, model, args)


def test_unknown_swap_is_rejected_with_the_valid_names():
    with pytest.raises(ValidationError, match="valid swaps: relu6_to_hardtanh, gelu_to_tanh_gelu"):
        SubstituteOpsOptions(swaps=["relu_to_gelu"])
    gm = torch.fx.symbolic_trace(nn.ReLU())
    opts = SubstituteOpsOptions.model_construct(swaps=["relu_to_gelu"], allow_numerics_change=False)
    with pytest.raises(ValueError, match="valid swaps: relu6_to_hardtanh"):
        substitute_ops(gm, opts, PassContext(level="torch"))
