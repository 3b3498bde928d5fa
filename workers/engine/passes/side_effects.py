"""Which nodes write somewhere: the in-place ops `Node.is_impure()` misses on torch-level graphs.

`Node.is_impure()` reads aten schemas, so aten graphs are covered; but on a symbolic_trace
graph `y.add_(1)`, `torch.relu_(y)` and `nn.ReLU(inplace=True)` with unused results look
pure, and `Graph.eliminate_dead_code()` drops them — silently changing the output (seen on
torch 2.13). Passes that delete or pre-evaluate nodes ask `has_side_effects` instead.
"""

from __future__ import annotations

import functools
import inspect
import operator
from collections.abc import Callable
from typing import Any

from torch.fx import GraphModule, Node

from fxport.workers.engine.passes import target_name

_INPLACE_OPERATORS = {
    operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv, operator.imod,
    operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift, operator.irshift,
    operator.imatmul,
}


def has_side_effects(gm: GraphModule, node: Node) -> bool:
    """True when running `node` may change state beyond its own result."""
    if node.is_impure():
        return True
    if node.op == "call_method":
        return _inplace_name(target_name(node))
    if node.op == "call_module":
        return bool(getattr(gm.get_submodule(target_name(node)), "inplace", False))
    if node.op == "call_function":
        target = node.target
        if target in _INPLACE_OPERATORS or _inplace_name(getattr(target, "__name__", "")):
            return True
        return _inplace_flag(node)
    return False


def _inplace_name(name: str) -> bool:
    """`add_`, `relu_`, `copy_` — torch's naming for in-place variants (not dunders)."""
    return name.endswith("_") and not name.endswith("__")


def _inplace_flag(node: Node) -> bool:
    """An `inplace=True` argument, by keyword or (for Python functions like F.relu) by position."""
    if node.kwargs.get("inplace") is True:
        return True
    try:
        signature = _signature(node.target)
    except TypeError:  # an unhashable callable: not cached
        signature = _signature.__wrapped__(node.target)
    if signature is None or "inplace" not in signature.parameters:
        return False
    try:
        bound = signature.bind_partial(*node.args, **node.kwargs)
    except TypeError:
        return False
    return bound.arguments.get("inplace") is True


@functools.lru_cache(maxsize=4096)  # keyed on the callable itself (held: its id is never reused meanwhile)
def _signature(target: Callable[..., Any]) -> inspect.Signature | None:
    """inspect.signature, once per target: for a builtin it parses the text signature (or fails
    to) on every call, which was done for every call_function node of every graph (side by side:
    a tiny job's passes stage 1.7 ms before, 0.5 ms after)."""
    try:
        return inspect.signature(target)
    except (TypeError, ValueError):  # builtins without a signature
        return None
