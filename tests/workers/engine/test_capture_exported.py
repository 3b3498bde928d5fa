"""Capture of an exported program (`fx_from_exported`): a plain GraphModule that keeps what export
recorded on every node (issue 44 item 1), the guards, the outputs' structure, and the fallbacks."""

from __future__ import annotations

import importlib.util
import pickle
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.export import Dim

from fxport.workers.engine.capture import fx_from_exported
from fxport.workers.engine.exporters.fx_source import MODULE_CLASS, FxSourceFromGraphModule


class ConvHeads(nn.Module):
    """Conv → BN → ReLU, then two outputs in a dict (one in a list): a nested output structure."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn, self.fc = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Linear(4, 2)

    def forward(self, x, y):
        h = torch.relu(self.bn(self.conv(x)))
        return {"logits": self.fc(h.mean((2, 3))), "extra": [y * 2]}


def _saved_and_loaded(model: nn.Module, args: tuple[Any, ...], tmp_path: Path, dynamic: Any = None) -> Any:
    """`model` through torch.export → .pt2 → torch.export.load, as a user's archive reaches the engine."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ep = torch.export.export(model.eval(), args, dynamic_shapes=dynamic)
        torch.export.save(ep, str(tmp_path / "model.pt2"))
        return torch.export.load(str(tmp_path / "model.pt2"))


@pytest.fixture
def program(tmp_path: Path) -> tuple[Any, nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    model = ConvHeads().eval()
    args = (torch.randn(2, 3, 8, 8), torch.randn(5))
    ep = _saved_and_loaded(model, args, tmp_path, ({0: Dim("batch", min=1, max=16)}, None))
    return ep, model, args


def test_every_node_keeps_the_metadata_export_recorded(program) -> None:
    ep, _, _ = program
    gm = fx_from_exported(ep)
    computed = [n for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)]
    sources = [n for n in ep.graph.nodes if n.op == "call_function"]
    assert [str(n.target) for n in computed] == [str(n.target) for n in sources]
    for node, source in zip(computed, sources):
        assert set(source.meta) <= set(node.meta), node.name  # a .pt2 keeps val, not tensor_meta
        assert isinstance(node.meta.get("val"), torch.Tensor), node.name
        assert "test_capture_exported.py" in node.meta.get("stack_trace", ""), node.name
    assert computed[0].meta["nn_module_stack"]
    # the batch stays symbolic: the shapes hold for every input the program accepts, not just the example
    conv = next(n for n in computed if "conv" in str(n.target))
    assert not isinstance(conv.meta["val"].shape[0], int)
    assert all(isinstance(n.meta.get("val"), torch.Tensor) for n in gm.graph.nodes if n.op == "placeholder")


def test_a_plain_graph_module_with_flat_inputs_and_the_programs_outputs(program) -> None:
    ep, model, args = program
    gm = fx_from_exported(ep)
    assert type(gm).__mro__[1] is torch.fx.GraphModule  # not ep.module()'s _StatefulGraphModule
    assert not hasattr(gm, "_in_spec") and not hasattr(gm, "_guards_fn")
    assert [n.name for n in gm.graph.nodes if n.op == "placeholder"] == ["x", "y"]
    assert "tree_flatten" not in gm.code and "tree_unflatten" not in gm.code
    assert not [n for n in gm.graph.nodes if n.op == "get_attr" and not n.users]  # num_batches_tracked
    with torch.no_grad():
        got, want = gm(*args), model(*args)
    assert set(got) == {"logits", "extra"} and isinstance(got["extra"], list)
    torch.testing.assert_close(got["logits"], want["logits"])
    torch.testing.assert_close(got["extra"][0], want["extra"][0])
    restored = pickle.loads(pickle.dumps(gm))  # ep.module()'s local guard function can't be pickled
    with torch.no_grad():
        torch.testing.assert_close(restored(*args)["logits"], want["logits"])


def test_the_guards_stay_as_assert_nodes(program) -> None:
    ep, _, args = program
    gm = fx_from_exported(ep)
    asserts = [n for n in gm.graph.nodes if n.target is torch._assert]
    assert asserts and all(n.meta.get("val") is None for n in asserts)
    with pytest.raises(AssertionError, match=r"Guard failed: x.size\(\)\[2\] == 8"):
        gm(torch.randn(2, 3, 9, 8), args[1])
    with torch.no_grad():  # a batch inside the range passes
        assert gm(torch.randn(7, 3, 8, 8), args[1])["logits"].shape == (7, 2)


def test_same_computation_as_retracing_the_program(program) -> None:
    """The copy records what symbolic_trace(ep.module()) recorded, in the same order (the attribute
    reads aside, which a trace makes where first used): only the metadata is new."""
    ep, _, _ = program
    gm, traced = fx_from_exported(ep), torch.fx.symbolic_trace(ep.module())

    def ops(g: torch.fx.GraphModule) -> list[tuple[str, str]]:
        return [(n.op, str(n.target)) for n in g.graph.nodes if n.op != "get_attr"]

    assert ops(gm) == ops(traced)
    assert sorted(n.target for n in gm.graph.nodes if n.op == "get_attr") == sorted(
        n.target for n in traced.graph.nodes if n.op == "get_attr")
    assert sum("val" in n.meta for n in traced.graph.nodes) == 0  # what issue 44 measured


def test_the_user_models_tensors_are_shared_not_copied(program) -> None:
    ep, _, _ = program
    unlifted = ep.module()
    gm = fx_from_exported(ep, unlifted)
    assert gm.get_parameter("conv.weight") is unlifted.get_parameter("conv.weight")
    assert type(gm.get_submodule("conv")) is nn.Module  # the graph's own container (passes/graph_attrs.py)


def test_fx_source_writes_the_captured_graph(program, tmp_path: Path) -> None:
    ep, model, args = program
    FxSourceFromGraphModule(fx_from_exported(ep))(tmp_path / "src")
    spec = importlib.util.spec_from_file_location("fx_source_captured_exported", tmp_path / "src" / "module.py")
    assert spec is not None and spec.loader is not None
    source = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(source)
    loaded = getattr(source, MODULE_CLASS)()
    with torch.no_grad():
        torch.testing.assert_close(loaded(*args)["logits"], model(*args)["logits"])


class Branchy(nn.Module):
    def forward(self, x):
        return torch.cond(x.sum() > 0, lambda a: a + 1, lambda a: a - 1, (x,))


def test_a_higher_order_op_keeps_the_unlifted_module(tmp_path: Path) -> None:
    ep = _saved_and_loaded(Branchy(), (torch.randn(3),), tmp_path)
    unlifted = ep.module()
    assert fx_from_exported(ep, unlifted) is unlifted
    x = torch.ones(3)
    torch.testing.assert_close(unlifted(x), x + 1)


class DictInput(nn.Module):
    def forward(self, batch):
        return batch["a"] + batch["b"]


def test_nested_inputs_are_retraced_as_before(tmp_path: Path) -> None:
    """Inputs in a structure (the engine passes flat tensors; a library caller may not): the old re-trace."""
    args = ({"a": torch.randn(3), "b": torch.randn(3)},)
    gm = fx_from_exported(_saved_and_loaded(DictInput(), args, tmp_path))
    assert isinstance(gm, torch.fx.GraphModule) and not hasattr(gm, "_in_spec")
    torch.testing.assert_close(gm(*args), args[0]["a"] + args[0]["b"])
