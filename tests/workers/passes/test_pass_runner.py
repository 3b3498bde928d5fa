"""Every catalog pass runs through `run_passes` at both IR levels and is recorded as applied."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fxport.pass_catalog import DEFAULT_PASSES, PASS_CATALOG
from fxport.spec import PassSpec
from fxport.workers.engine.passes import run_passes
from tests.workers.passes.conftest import assert_close, capture, context, randomize_batchnorm
from tests.workers.passes.test_fuse_conv_bn import ResNetLike


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)
        self.drop = nn.Dropout()

    def forward(self, x):
        return self.drop(F.relu6(self.bn(self.conv(x))))  # F.relu6: export keeps it as aten.relu6


@pytest.mark.parametrize("level", ["torch", "aten"])
def test_every_pass_is_applied_and_timed(level):
    model = randomize_batchnorm(Small()).eval()
    args = (torch.randn(2, 3, 8, 8),)
    ctx = context(level, args)
    gm, records = run_passes(capture(model, args, level), [PassSpec(name=n) for n in PASS_CATALOG], ctx)

    assert [r["name"] for r in records] == list(PASS_CATALOG)
    for record in records:
        assert record["applied"] is True, record
        assert record["seconds"] >= 0 and record["notes"]
    changed = {r["name"]: r["changed"] for r in records}
    assert changed["fuse_conv_bn"] and changed["remove_dropout"] and changed["substitute_ops"]
    assert changed["profile_nodes"] is False
    assert ctx.report["profile"]["top_nodes"]
    assert_close(gm, model, args)


def test_default_chain_on_decomposed_resnet_like():
    model = randomize_batchnorm(ResNetLike()).eval()
    args = (torch.randn(2, 3, 12, 12),)
    gm, records = run_passes(
        capture(model, args, "aten_decomposed"), [PassSpec(name=n) for n in DEFAULT_PASSES], context("aten", args)
    )
    assert all(r["applied"] for r in records)
    assert not any("batch_norm" in str(n.target) for n in gm.graph.nodes)
    assert_close(gm, model, args)


def test_fold_then_fuse_on_decomposed_graph_still_exports():
    """fold_constants turns addmm's permute(w) into a (in, out) buffer; fuse_conv_bn folds into that."""
    model = randomize_batchnorm(ResNetLike()).eval()
    args = (torch.randn(2, 3, 12, 12),)
    passes = [PassSpec(name=n) for n in ("fold_constants", "fuse_conv_bn", "dead_code_elimination")]
    gm, records = run_passes(capture(model, args, "aten_decomposed"), passes, context("aten", args))
    assert "2 permute" in records[0]["notes"]
    assert "2 BatchNorm1d into Linear" in records[1]["notes"]
    assert not any("batch_norm" in str(n.target) for n in gm.graph.nodes)
    assert_close(gm, model, args)
    torch.export.export(gm, args)  # the rewritten module is still a valid input to the exporters
