"""fuse_conv_bn on a model that reaches the engine as a .pt2 (issue 44 item 1): the capture keeps
export's shape metadata, so the BatchNorms behind a flatten fold as they do through the FX rung,
and the ones no rule can fold are named with their reason. Plus the per-pass attribute-use index."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.export import Dim

from fxport.workers.engine.load import load_model
from fxport.workers.engine.passes.graph_attrs import AttrUses, fetch_attr
from tests.workers.passes.conftest import apply, assert_close, capture, randomize_batchnorm
from tests.workers.passes.test_fuse_conv_bn import LeViTStyle, LinearNorm, batchnorm_left


class LeViTWithLeftovers(nn.Module):
    """The LeViT-style model (3 ConvNorm, 8 LinearNorm: Linear → flatten(0, 1) → BatchNorm1d →
    reshape_as) plus two BatchNorms no rule folds: one after a mean, one whose conv has 2 users."""

    def __init__(self) -> None:
        super().__init__()
        self.levit = LeViTStyle()
        self.pool_bn = nn.BatchNorm1d(32)
        self.side, self.side_bn = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)

    def forward(self, x):
        tokens = self.levit.blocks(self.levit.stem(x).flatten(2).transpose(1, 2))
        logits = self.levit.head(self.pool_bn(tokens.mean(1)))
        side = self.side(x)
        return logits + (self.side_bn(side) + side).mean((1, 2, 3)).unsqueeze(1)


def _from_pt2(model: nn.Module, args: tuple[torch.Tensor, ...], tmp_path: Path) -> torch.fx.GraphModule:
    """`model` exported with a dynamic batch, saved, loaded and captured as the engine does a .pt2."""
    from fxport.workers.engine.capture import fx_from_exported

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ep = torch.export.export(model.eval(), args, dynamic_shapes=({0: Dim("batch", min=1, max=64)},))
        torch.export.save(ep, str(tmp_path / "model.pt2"))
    loaded = load_model(tmp_path / "model.pt2")
    return fx_from_exported(loaded.exported_program, loaded.module)


FOLDED = ("folded 3 BatchNorm2d into Conv2d; 8 BatchNorm1d into Linear through flatten "
          "(levit.blocks.0.attn.qkv.bn into levit.blocks.0.attn.qkv.linear, ")
LEFT = ("Left 1 BatchNorm1d: its input is not a Conv/Linear (mean) (pool_bn); "
        "1 BatchNorm2d: the Conv2d output has 2 users (side_bn)")


def test_levit_style_pt2_folds_every_foldable_batchnorm_and_names_the_rest(tmp_path: Path) -> None:
    model = randomize_batchnorm(LeViTWithLeftovers()).eval()
    args = (torch.randn(2, 3, 32, 32),)
    gm = _from_pt2(model, args, tmp_path)
    assert len(batchnorm_left(gm)) == 13

    result = apply("fuse_conv_bn", gm, "aten", args)

    assert result.notes.startswith(FOLDED), result.notes
    assert result.notes.endswith(LEFT), result.notes
    assert len(batchnorm_left(result.graph_module)) == 2
    assert_close(result.graph_module, model, args)
    assert_close(result.graph_module, model, (torch.randn(5, 3, 32, 32),))  # another batch: the fold holds


def test_pt2_folds_what_the_fx_rung_folds(tmp_path: Path) -> None:
    model = randomize_batchnorm(LeViTWithLeftovers()).eval()
    args = (torch.randn(2, 3, 32, 32),)
    from_pt2 = apply("fuse_conv_bn", _from_pt2(model, args, tmp_path), "aten", args)
    from_fx = apply("fuse_conv_bn", capture(model, args, "torch"), "torch", args)
    assert len(batchnorm_left(from_pt2.graph_module)) == len(batchnorm_left(from_fx.graph_module)) == 2
    assert from_pt2.notes.split(". Left")[0].replace("flatten", "?") == \
        from_fx.notes.split(". Left")[0].replace("flatten", "?")


class HeldOut(nn.Module):
    """Linear → flatten(0, 1) → BatchNorm1d → reshape_as alone, the issue's held-out model."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = LinearNorm(6, 5)

    def forward(self, x):
        return self.norm(x)


def test_held_out_linear_flatten_batchnorm_folds_from_a_pt2(tmp_path: Path) -> None:
    model = randomize_batchnorm(HeldOut()).eval()
    args = (torch.randn(3, 7, 6),)
    result = apply("fuse_conv_bn", _from_pt2(model, args, tmp_path), "aten", args)
    assert result.notes == "folded 1 BatchNorm1d into Linear through flatten (norm.bn into norm.linear)"
    assert batchnorm_left(result.graph_module) == []
    assert_close(result.graph_module, model, (torch.randn(9, 7, 6),))


def _fresh_counts(gm: torch.fx.GraphModule) -> dict[int, int]:
    """What one scan of the graph says: id(tensor) → uses over every get_attr node."""
    counts: dict[int, int] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = fetch_attr(gm, node.target)
            counts[id(value)] = counts.get(id(value), 0) + len(node.users)
    return counts


class TwoConvsOneWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)

    def forward(self, x):
        return self.conv(x) + nn.functional.conv2d(x, self.conv.weight)


@pytest.mark.parametrize("edit", ["rebind", "new node", "erase"])
def test_attr_uses_stays_what_a_fresh_scan_says_through_edits(edit: str) -> None:
    gm = capture(TwoConvsOneWeight(), (torch.randn(2, 3, 4, 4),), "aten")
    uses = AttrUses(gm)
    weight = gm.get_parameter("conv.weight")
    assert uses.count(weight) == _fresh_counts(gm)[id(weight)] == 2
    first = next(n for n in gm.graph.nodes if n.op == "get_attr" and n.target == "conv.weight")
    conv2 = [u for u in first.users][-1]
    if edit == "rebind":  # the second conv reads a new name; then the old name is bound to a new tensor
        gm.register_parameter("w2", nn.Parameter(weight.detach().clone()))
        with gm.graph.inserting_before(conv2):
            node = gm.graph.get_attr("w2")
        uses.added(node)
        conv2.replace_input_with(first, node)
        gm.get_submodule("conv").register_parameter("weight", nn.Parameter(weight.detach() * 2))
        uses.rebound("conv.weight")
    elif edit == "new node":  # a second get_attr of the same tensor
        with gm.graph.inserting_before(conv2):
            node = gm.graph.get_attr("conv.weight")
        uses.added(node)
        conv2.replace_input_with(first, node)
    else:  # a user of the weight goes away
        conv2.replace_all_uses_with(conv2.args[0])
        gm.graph.erase_node(conv2)
    fresh = _fresh_counts(gm)
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = fetch_attr(gm, node.target)
            assert uses.count(value) == fresh[id(value)], (edit, node.target)
    assert uses.count(weight) == fresh.get(id(weight), 0)
