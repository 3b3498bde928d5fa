"""remove_dropout: eval dropout disappears at every IR level; active dropout stays, and is noted."""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from tests.workers.passes.conftest import apply, assert_close, call_targets, capture


class WithDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.drop = nn.Dropout(0.5)
        self.drop2d = nn.Dropout2d(0.2)

    def forward(self, x):
        y = self.drop(self.fc(x))
        y = F.dropout(y, 0.3, self.training)  # training=False once the model is in eval mode
        return self.drop2d(y.reshape(-1, 6, 1, 1)).flatten(1)


class ActiveDropout(nn.Module):
    """F.dropout without a training flag defaults to training=True: active even in eval."""

    def forward(self, x):
        return F.dropout(x + 1, 0.5)


def dropout_left(gm) -> list[str]:
    left = [t for t in call_targets(gm) if "ropout" in t]
    left += [n.name for n in gm.graph.nodes if "dropout" in str(n.meta.get("torch_fn", ""))]
    return left


def test_eval_dropout_is_removed(level):
    model = WithDropout().eval()
    args = (torch.randn(3, 6),)
    gm = capture(model, args, level)
    assert dropout_left(gm)

    result = apply("remove_dropout", gm, level, args)

    assert result.changed
    assert dropout_left(result.graph_module) == []
    # decomposed, eval feature_dropout (Dropout2d) vanishes and the other two become aten.clone
    expected = "removed 2 aten.clone left by an eval dropout" if level == "aten_decomposed" else "removed "
    assert result.notes.startswith(expected)
    assert sum(int(n) for n in re.findall(r"(\d+) ", result.notes)) == (2 if level == "aten_decomposed" else 3)
    assert_close(result.graph_module, model, args)
    assert not hasattr(result.graph_module, "drop")  # the emptied module is gone from the graph …
    assert isinstance(model.drop, nn.Dropout)  # … but not from the user's model


def test_active_dropout_is_kept(level):
    model = ActiveDropout().eval()
    args = (torch.randn(3, 6),)
    result = apply("remove_dropout", capture(model, args, level), level, args)
    assert not result.changed
    assert "kept active dropout" in result.notes


def test_no_dropout_is_unchanged(level):
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU()).eval()
    args = (torch.randn(2, 4),)
    gm = capture(model, args, level)
    code = gm.code
    result = apply("remove_dropout", gm, level, args)
    assert not result.changed
    assert result.notes == "no dropout nodes"
    assert result.graph_module.code == code
