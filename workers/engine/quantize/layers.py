"""Which nodes of an FX graph quantize, at both IR levels, and how their operands are found.

A *layer* is a Conv{1,2,3}d or Linear with a constant weight: a `call_module` of
nn.Conv*/nn.Linear (torch level), or a `call_function` of F.conv*/F.linear or
aten.conv*/aten.linear/aten.convolution whose weight is a `get_attr` (aten level, and
functional torch-level code). Layers are named by their module path ("layer1.0.conv1"),
which both levels share: the weight's qualified name without ".weight".

The other tables classify the ops between layers so that Q/DQ lands where ONNX Runtime
fuses it into int8 kernels and TensorRT reads it as explicit quantization (see int8.py).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import GraphModule, Node
from torch.fx.node import Target

from fxport.workers.engine.passes import node_arg, target_name
from fxport.workers.engine.passes.graph_attrs import fetch_attr

aten = torch.ops.aten

# keyed by FX targets (a node's `target` is looked up in them)
CONV_FUNCTIONS: dict[Target, str] = {F.conv1d: "conv1d", F.conv2d: "conv2d", F.conv3d: "conv3d", F.linear: "linear"}
CONV_ATEN: dict[Target, str] = {
    aten.conv1d.default: "conv1d", aten.conv2d.default: "conv2d", aten.conv3d.default: "conv3d",
    aten.conv1d.padding: "conv1d", aten.conv2d.padding: "conv2d", aten.conv3d.padding: "conv3d",
    aten.linear.default: "linear", aten.convolution.default: "convolution",
}
# x @ W with a constant W of shape [in, out] (GPT-2's Conv1D: addmm(bias, x, W)): per-column scales
MATMUL_ATEN: dict[Target, tuple[int, int]] = {
    aten.addmm.default: (1, 2), aten.mm.default: (0, 1), aten.matmul.default: (0, 1),
    torch.addmm: (1, 2), torch.mm: (0, 1), torch.matmul: (0, 1),
}
CONV_MODULES = {nn.Conv1d: "conv1d", nn.Conv2d: "conv2d", nn.Conv3d: "conv3d", nn.Linear: "linear"}
_PLAIN_FORWARDS = {nn.Conv1d.forward, nn.Conv2d.forward, nn.Conv3d.forward, nn.Linear.forward}

# ReLU: shares its input's scale (see int8.plan_qdq); ORT runs DQ→Relu→Q, TensorRT fuses it into the conv.
RELU = {torch.relu, torch.relu_, F.relu, aten.relu.default, aten.relu_.default, "relu", "relu_"}
RELU_MODULES = (nn.ReLU,)
# Clamps (ReLU6, hardtanh): like ReLU, they map an int8 grid onto itself (but for a bound off
# the grid), so they share their input's scale too.
CLAMP = {F.relu6, F.hardtanh, torch.clamp, aten.hardtanh.default, aten.hardtanh_.default, aten.relu6.default,
         aten.clamp.default, "clamp", "clamp_"}
CLAMP_MODULES = (nn.ReLU6, nn.Hardtanh)
# Elementwise add of two quantized tensors: ORT runs it as QLinearAdd, TensorRT in int8.
ADD = {operator.add, operator.iadd, torch.add, aten.add.Tensor, aten.add_.Tensor, "add", "add_"}
# Averaging: own range (means shrink), ORT has QLinearAveragePool / QLinearGlobalAveragePool.
AVG_POOL = {F.adaptive_avg_pool1d, F.adaptive_avg_pool2d, F.avg_pool1d, F.avg_pool2d,
            aten.adaptive_avg_pool1d.default, aten.adaptive_avg_pool2d.default, aten.avg_pool2d.default,
            aten._adaptive_avg_pool2d.default, aten.mean.dim}
AVG_POOL_MODULES = (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AvgPool1d, nn.AvgPool2d)
# Ops that only move or select values: their output reuses the input's scale, so ORT drops the
# DQ→op→Q around them (MaxPool, Reshape, Transpose run on int8) and TensorRT commutes through.
PASS_THROUGH = {F.max_pool1d, F.max_pool2d, F.max_pool3d, torch.flatten, torch.reshape, torch.permute,
                torch.transpose, torch.squeeze, torch.unsqueeze,
                aten.max_pool1d.default, aten.max_pool2d.default, aten.max_pool3d.default,
                aten.flatten.using_ints, aten.view.default, aten.reshape.default, aten.permute.default,
                aten.transpose.int, aten.squeeze.dim, aten.unsqueeze.default, aten.contiguous.default,
                aten.clone.default, aten.dropout.default,
                "flatten", "view", "reshape", "permute", "transpose", "contiguous", "squeeze", "unsqueeze"}
PASS_THROUGH_MODULES = (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.Flatten, nn.Identity, nn.Dropout)


@dataclass
class Layer:
    """One quantizable Conv/Linear in the (unquantized) graph."""

    name: str  # module path, e.g. "layer1.0.conv1"
    node: str  # FX node name in the graph it was found in
    op: str  # conv1d | conv2d | conv3d | convolution | linear
    weight: str  # qualified name of the weight tensor
    bias: str | None  # qualified name of the bias, if a constant
    out_channels: int
    macs_per_output: int  # multiply-adds per output element (a latency weight for reports)
    notes: list[str] = field(default_factory=list)
    x_arg: int = 0  # which argument is the activation
    w_arg: int = 1  # which argument is the weight
    axis: int = 0  # the weight's output-channel axis (1 for a [in, out] matmul weight)

    def activation(self, node: Node) -> Node:
        return node_arg(node, self.x_arg)


@dataclass
class LayerScan:
    layers: list[Layer]
    skipped: list[dict[str, str]]  # {"node": ..., "reason": ...} for conv/linear left in float


def _matches(node: Node, gm: GraphModule, functions: set[Any], modules: tuple[type, ...] = ()) -> bool:
    if node.op == "call_function":
        return node.target in functions
    if node.op == "call_method":
        return node.target in functions
    if node.op == "call_module" and modules:
        return isinstance(gm.get_submodule(target_name(node)), modules)
    return False


def is_relu(node: Node, gm: GraphModule) -> bool:
    return _matches(node, gm, RELU, RELU_MODULES)


def is_clamp(node: Node, gm: GraphModule) -> bool:
    return _matches(node, gm, CLAMP, CLAMP_MODULES)


def is_add(node: Node, gm: GraphModule) -> bool:
    if not _matches(node, gm, ADD):
        return False
    if node.op == "call_function" and node.target in (aten.add.Tensor, aten.add_.Tensor, torch.add):
        alpha = node.kwargs.get("alpha", 1)
        if alpha != 1:
            return False
    tensors = [a for a in node.args if isinstance(a, Node)]
    return len(tensors) == 2


def is_avg_pool(node: Node, gm: GraphModule) -> bool:
    if node.op == "call_function" and node.target is aten.mean.dim:
        # only a spatial mean that keeps the channel axis (global average pooling)
        dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        return isinstance(dims, (list, tuple)) and all(d in (-1, -2, 2, 3) for d in dims)
    return _matches(node, gm, AVG_POOL, AVG_POOL_MODULES)


def is_pass_through(node: Node, gm: GraphModule) -> bool:
    return _matches(node, gm, PASS_THROUGH, PASS_THROUGH_MODULES)


def data_input(node: Node) -> Node | None:
    """The tensor an op (relu, pool, reshape, layer) reads its data from: its first argument."""
    if node.op == "call_method" or node.op == "call_function" or node.op == "call_module":
        first = node.args[0] if node.args else node.kwargs.get("input")
        return first if isinstance(first, Node) else None
    return None


def scan_layers(gm: GraphModule) -> LayerScan:
    """Every Conv/Linear of `gm` in graph order, with the ones that cannot be quantized and why."""
    layers: list[Layer] = []
    skipped: list[dict[str, str]] = []
    for node in gm.graph.nodes:
        found = _layer(gm, node)
        if found is None:
            continue
        if isinstance(found, str):
            skipped.append({"node": _display_name(gm, node), "reason": found})
            continue
        layers.append(found)
    # one module called twice (weight sharing) gets one name per call
    seen: dict[str, int] = {}
    for layer in layers:
        count = seen.get(layer.name, 0)
        seen[layer.name] = count + 1
        if count:
            layer.name = f"{layer.name}#{count + 1}"
    return LayerScan(layers, skipped)


def _display_name(gm: GraphModule, node: Node) -> str:
    if node.op == "call_module":
        return str(node.target)
    w = node.args[1] if len(node.args) > 1 else None
    if isinstance(w, Node) and w.op == "get_attr":
        return str(w.target).rpartition(".")[0] or str(w.target)
    return node.name


def _layer(gm: GraphModule, node: Node) -> Layer | str | None:
    """A Layer, a reason string (a conv/linear that stays float), or None (not a conv/linear)."""
    if node.op == "call_module":
        mod = gm.get_submodule(target_name(node))
        kind = next((k for t, k in CONV_MODULES.items() if type(mod) is t), None)
        if kind is None:
            if isinstance(mod, tuple(CONV_MODULES)):
                return "a subclass of Conv/Linear with its own forward"
            return None
        if type(mod).forward not in _PLAIN_FORWARDS:
            return "overrides forward"
        if getattr(mod, "padding_mode", "zeros") != "zeros":
            return f"padding_mode={mod.padding_mode!r} (only zero padding is quantized)"
        if not isinstance(mod.weight, torch.Tensor) or not mod.weight.is_floating_point():
            return "weight is not a float tensor"
        bias_name = f"{node.target}.bias" if getattr(mod, "bias", None) is not None else None
        return Layer(name=str(node.target), node=node.name, op=kind, weight=f"{node.target}.weight",
                     bias=bias_name, out_channels=int(mod.weight.shape[0]),
                     macs_per_output=int(mod.weight[0].numel()))
    if node.op != "call_function":
        return None
    if node.target in MATMUL_ATEN:
        return _matmul_layer(gm, node)
    kind = CONV_FUNCTIONS.get(node.target) or CONV_ATEN.get(node.target)
    if kind is None:
        return None
    if kind == "convolution":
        transposed = node.args[6] if len(node.args) > 6 else node.kwargs.get("transposed", False)
        if transposed:
            return "transposed convolution (not quantized)"
        kind = "conv"
    if len(node.args) < 2 or not isinstance(node.args[0], Node):
        return "input or weight passed by keyword (not quantized)"
    weight = node.args[1]
    if not isinstance(weight, Node) or weight.op != "get_attr":
        return "weight is computed in the graph, not a constant"
    try:
        w = fetch_attr(gm, target_name(weight))
    except AttributeError:
        return "weight attribute not found"
    if not isinstance(w, torch.Tensor) or not w.is_floating_point() or w.dim() < 2:
        return "weight is not a float tensor of rank >= 2"
    if kind == "conv":
        kind = f"conv{w.dim() - 2}d"
    bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    bias_name = str(bias.target) if isinstance(bias, Node) and bias.op == "get_attr" else None
    if isinstance(bias, Node) and bias.op != "get_attr":
        return "bias is computed in the graph, not a constant"
    name = str(weight.target)
    name = name[: -len(".weight")] if name.endswith(".weight") else name
    return Layer(name=name, node=node.name, op=kind, weight=str(weight.target), bias=bias_name,
                 out_channels=int(w.shape[0]), macs_per_output=int(w[0].numel()))


def _matmul_layer(gm: GraphModule, node: Node) -> Layer | str | None:
    x_arg, w_arg = MATMUL_ATEN[node.target]
    if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
        return "addmm with alpha/beta (not quantized)"
    if len(node.args) <= w_arg or not isinstance(node.args[x_arg], Node):
        return None
    weight = node.args[w_arg]
    if not isinstance(weight, Node) or weight.op != "get_attr":
        return None  # a product of two activations (attention): not a layer
    try:
        w = fetch_attr(gm, target_name(weight))
    except AttributeError:
        return "weight attribute not found"
    if not isinstance(w, torch.Tensor) or not w.is_floating_point() or w.dim() != 2:
        return "matmul weight is not a 2-D float constant"
    if x_arg == 1:
        bias = node.args[0]
        if isinstance(bias, Node) and bias.op != "get_attr":
            return "bias is computed in the graph, not a constant"
    name = str(weight.target)
    name = name[: -len(".weight")] if name.endswith(".weight") else name
    bias_name = str(node.args[0].target) if x_arg == 1 and isinstance(node.args[0], Node) else None
    return Layer(name=name, node=node.name, op="matmul", weight=str(weight.target), bias=bias_name,
                 out_channels=int(w.shape[1]), macs_per_output=int(w.shape[0]), x_arg=x_arg, w_arg=w_arg, axis=1)
