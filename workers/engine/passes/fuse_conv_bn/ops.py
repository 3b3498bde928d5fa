"""What fuse_conv_bn looks at: the layer and batch-norm ops and modules it recognizes, the site a
note names, and the small readers of nodes (their module, their kind, their label in the notes)."""

from __future__ import annotations

import inspect
import operator
from dataclasses import dataclass
from typing import TypeGuard

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import GraphModule, Node

from fxport.workers.engine.passes import node_arg, target_name
from fxport.workers.engine.passes.graph_attrs import fetch_attr, split_target

aten = torch.ops.aten

_CONV_MODULES = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
_LAYER_MODULES = (*_CONV_MODULES, nn.Linear)  # what a torch-level batch norm folds into
# A subclass that overrides forward (a weight-standardized or fake-quantized conv, say) does
# something else with its weight than the fold assumes, so only these forwards qualify.
_PLAIN_FORWARDS = {nn.Conv1d.forward, nn.Conv2d.forward, nn.Conv3d.forward, nn.Linear.forward,
                   nn.ConvTranspose1d.forward, nn.ConvTranspose2d.forward, nn.ConvTranspose3d.forward,
                   nn.modules.batchnorm._BatchNorm.forward, nn.SyncBatchNorm.forward}

# Eval batch norm as torch.export emits it. In torch 2.13 `export` keeps
# aten.batch_norm.default(..., training=False, ...); `run_decompositions()` turns it into
# aten._native_batch_norm_legit_no_training.default, which returns a tuple read by getitem.
_BN_OPS = {
    aten.batch_norm.default,
    aten._native_batch_norm_legit_no_training.default,
    aten._native_batch_norm_legit.default,
    aten.native_batch_norm.default,
}
_CONV_OPS = {
    aten.conv1d.default, aten.conv2d.default, aten.conv3d.default,
    aten.conv1d.padding, aten.conv2d.padding, aten.conv3d.padding,
    aten.convolution.default, aten._convolution.default,
    aten.conv_transpose1d.default, aten.conv_transpose2d.input, aten.conv_transpose3d.input,
}
_CONV_TRANSPOSE_OPS = {aten.conv_transpose1d.default, aten.conv_transpose2d.input, aten.conv_transpose3d.input}
_PERMUTE_OPS = {aten.permute.default, aten.t.default}
_LINEAR_OPS = {aten.linear.default, aten.addmm.default, aten.mm.default, aten.bmm.default}
# How decomposition broadcasts a Linear's weight over a 3-D input's batch for bmm.
_BROADCAST_OPS = {aten.expand.default, aten.view.default, aten._unsafe_view.default, aten.reshape.default}


_F_BATCH_NORM_SIGNATURE = inspect.signature(F.batch_norm)


@dataclass(frozen=True)
class _Site:
    """The batch norm being looked at, as the notes name it: its class and where it lives."""

    kind: str  # "BatchNorm2d", "BatchNormAct2d (F.batch_norm)", "batch_norm"
    name: str  # "layer1.0.bn1"


def _bn_outputs(bn_node: Node) -> list[Node] | None:
    """The nodes carrying the normalized tensor; None when a tuple op's other outputs are read."""
    if bn_node.target == aten.batch_norm.default:
        return [bn_node]
    outs = []
    for user in bn_node.users:
        if user.op == "call_function" and user.target is operator.getitem and user.args[1] == 0:
            outs.append(user)
        else:
            return None
    return outs


def _erase_unused_bn_attrs(gm: GraphModule, prefixes: set[str]) -> None:
    """Drop get_attr nodes left for a fused BatchNorm (num_batches_tracked is fetched, never read)."""
    for node in list(gm.graph.nodes):
        if node.op == "get_attr" and not node.users and split_target(node.target)[0] in prefixes:
            gm.graph.erase_node(node)


def _module(gm: GraphModule, node) -> nn.Module | None:
    if not isinstance(node, Node) or node.op != "call_module":
        return None
    return gm.get_submodule(target_name(node))


_KNOWN_KINDS = ("BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm", "Conv1d", "Conv2d", "Conv3d", "Linear")


def _module_kind(node: Node, default: str) -> str:
    """The torch.nn class an aten node came from (export records it in nn_module_stack), for notes."""
    stack = node.meta.get("nn_module_stack")
    if stack:
        _path, cls = list(stack.values())[-1]
        name = (cls if isinstance(cls, str) else getattr(cls, "__name__", str(cls))).rsplit(".", 1)[-1]
        if name in _KNOWN_KINDS:
            return name
    return default


def _op_name(node: Node) -> str:
    return getattr(node.target, "__name__", str(node.target)).split(".")[0]


def _describe(gm: GraphModule, node) -> str:
    if not isinstance(node, Node):
        return repr(node)
    if node.op == "call_module":
        return f"{type(gm.get_submodule(target_name(node))).__name__} {node.target}"
    if node.op == "call_function":
        return _op_name(node) if hasattr(node.target, "_schema") else getattr(node.target, "__name__", str(node.target))
    return f"{node.op} {node.target}"


def _op_label(gm: GraphModule, node: Node) -> str:
    """How notes name a shape op: `flatten` (method, function or aten op), `Flatten` (module)."""
    if node.op == "call_method":
        return target_name(node)
    if node.op == "call_module":
        return type(gm.get_submodule(target_name(node))).__name__
    return _op_name(node)


def _named(names: list[str], shown: int = 3) -> str:
    """` (bn1, bn2, bn3, +4 more)`: the first few names of a group in the notes; "" when it has none."""
    names = [n for n in names if n]
    if not names:
        return ""
    more = f", +{len(names) - shown} more" if len(names) > shown else ""
    return f" ({', '.join(names[:shown])}{more})"


def _is_attr(value: object) -> TypeGuard[Node]:
    return isinstance(value, Node) and value.op == "get_attr"


def _functional_kind(node: Node) -> str:
    """`BatchNormAct2d (F.batch_norm)`: the BatchNorm subclass whose forward called F.batch_norm."""
    stack = node.meta.get("nn_module_stack")
    if stack:
        _path, cls = list(stack.values())[-1]
        if isinstance(cls, type) and issubclass(cls, nn.modules.batchnorm._BatchNorm):
            return f"{cls.__name__} (F.batch_norm)"
    return "F.batch_norm"


def _is_bias_add(gm: GraphModule, node) -> bool:
    """`add(x, bias)` with a 1-D constant `bias`: how decomposition adds a Linear's bias after a bmm."""
    return (isinstance(node, Node) and node.op == "call_function" and node.target == aten.add.Tensor
            and len(node.args) == 2 and not node.kwargs and isinstance(node.args[0], Node)
            and _is_attr(node.args[1]) and fetch_attr(gm, target_name(node_arg(node, 1))).dim() == 1)


def _hashable(target) -> bool:
    try:
        hash(target)
    except TypeError:
        return False
    return True
