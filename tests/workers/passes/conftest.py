"""Shared helpers for pass tests: capture a tiny model at an IR level, run a pass, compare."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch.export import Dim, export
from torch.fx import GraphModule

from fxport.pass_catalog import PASS_CATALOG
from fxport.workers.engine.passes import PassContext, PassResult, load_pass

# "aten" is what torch.export emits; "aten_decomposed" is the same after run_decompositions()
# (convolution, _native_batch_norm_legit_no_training + getitem, clone for eval dropout, addmm
# for linear). Both are "aten" graphs to the engine; passes must handle both spellings.
LEVELS = ("torch", "aten", "aten_decomposed")


def capture(model: torch.nn.Module, args: tuple[Any, ...], level: str) -> GraphModule:
    """`model` (put in eval mode) as a GraphModule at `level`; aten levels get a dynamic batch dim."""
    model.eval()
    if level == "torch":
        return torch.fx.symbolic_trace(model)
    batch = Dim("batch", min=1, max=64)
    dynamic = tuple({0: batch} if isinstance(a, torch.Tensor) and a.dim() > 0 else None for a in args)
    ep = export(model, args, dynamic_shapes=dynamic)
    if level == "aten_decomposed":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # a pytree LeafSpec deprecation inside torch
            ep = ep.run_decompositions()
    elif level != "aten":
        raise ValueError(f"unknown level {level!r}; use one of {LEVELS}")
    return ep.module()


def context(level: str, args: tuple[Any, ...] = ()) -> PassContext:
    return PassContext(level="torch" if level == "torch" else "aten", example_inputs=args)


def apply(name: str, gm: GraphModule, level: str, args: tuple[Any, ...] = (), **options: Any) -> PassResult:
    """Run catalog pass `name` on `gm` the way the engine does (options through its model), then lint."""
    opts = PASS_CATALOG[name].options.model_validate(options)
    with torch.no_grad():
        result = load_pass(name)(gm, opts, context(level, args))
    result.graph_module.graph.lint()
    return result


def randomize_batchnorm(model: torch.nn.Module) -> torch.nn.Module:
    """Give every BatchNorm non-trivial statistics and affine terms, so a wrong fold shows."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, torch.nn.modules.batchnorm._BatchNorm):
                n = mod.num_features
                mod.running_mean.copy_(torch.rand(n, generator=gen) * 2 - 1)
                mod.running_var.copy_(torch.rand(n, generator=gen) * 1.5 + 0.5)
                if mod.affine:
                    mod.weight.copy_(torch.rand(n, generator=gen) + 0.5)
                    mod.bias.copy_(torch.rand(n, generator=gen) * 2 - 1)
    return model


def assert_close(gm: GraphModule, model: torch.nn.Module, args: tuple[Any, ...], atol: float = 1e-5) -> None:
    """The rewritten graph computes what the eager model computes, within `atol`."""
    with torch.no_grad():
        expected, actual = model(*args), gm(*args)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=0)


def call_targets(gm: GraphModule) -> list[str]:
    """What each compute node runs: module class names (torch level) and op names (aten level)."""
    out = []
    for node in gm.graph.nodes:
        if node.op == "call_module":
            out.append(type(gm.get_submodule(node.target)).__name__)
        elif node.op in ("call_function", "call_method"):
            out.append(str(getattr(node.target, "__name__", node.target)))
    return out


@pytest.fixture(params=LEVELS)
def level(request) -> str:
    return request.param
