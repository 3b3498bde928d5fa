"""int8 static post-training quantization of an FX graph: observers → calibration → Q/DQ nodes.

The result is a *QDQ graph*: the float graph with quantize/dequantize pairs written into it,
the form ONNX QDQ and TensorRT explicit quantization consume.

- Q/DQ ops: `torch.ops.quantized_decomposed.{quantize,dequantize}_per_tensor` for activations
  and `dequantize_per_channel` on an int8 weight buffer. torch.export keeps them, the
  torch.export-based ONNX exporter turns each into QuantizeLinear/DequantizeLinear (with the
  int8 weight as an initializer), and the .pt2 stores int8 weights. (`aten.fake_quantize_*`
  also export to Q/DQ, but only under no_grad — their cachemask form has no FakeTensor
  kernel — and they keep fp32 weights.) The op library must be imported before a .pt2
  holding these ops is loaded: `import torch.ao.quantization.fx._decomposed`. That module
  is only the op definitions; nothing here uses torch.ao's deprecated FX quantization API.
- Scheme (scheme.py), chosen by the runtime the artifact is for: weights symmetric per output
  channel (int8 in [-127, 127], or [-63, 63] with reduce_range); activations per tensor,
  symmetric int8 with zero point 0 for TensorRT, asymmetric uint8 for onnxruntime.
- Placement (`plan_qdq`): every quantized layer's input and output; a ReLU, average pool or
  residual add whose inputs are quantized gets its own Q/DQ; ops that only move values
  (max pool, flatten, reshape, permute) reuse their input's scale when a layer needs them
  quantized. Measured with onnxruntime 1.32: it fuses DQ→Conv→Q into QLinearConv only when
  the Q follows the Conv directly (Conv→ReLU→Q stays a float FusedConv, ~3.5x slower), so
  a ReLU sits between two Q/DQ pairs: Conv→Q→DQ→ReLU→Q→DQ. Symmetric, every reader of a
  quantized tensor gets its own pair (see `convert` for why their scales differ by one float32
  ulp). Asymmetric, a ReLU whose input's Q already clips at 0 is dropped and each tensor has one
  pair shared by its readers: the form onnxruntime's own quantize_static writes, which it runs
  as int8 kernels end to end (NHWC, no float islands; see `_idle_relus`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch
import torch.ao.quantization.fx._decomposed  # noqa: F401  (defines torch.ops.quantized_decomposed)
import torch.nn.functional as F
from torch import nn
from torch.fx import GraphModule, Node

from fxport.workers.engine.passes import node_arg
from fxport.workers.engine.passes.graph_attrs import (
    fetch_attr,
    is_own_container,
    prune_unused_attrs,
    split_target,
    unique_name,
)
from fxport.workers.engine.quantize.layers import (
    Layer,
    data_input,
    is_add,
    is_avg_pool,
    is_clamp,
    is_pass_through,
    is_relu,
)
from fxport.workers.engine.quantize.observers import ActivationObserver, quantize_weight
from fxport.workers.engine.quantize.scheme import TENSORRT, Int8Scheme

qd = torch.ops.quantized_decomposed
QUANTIZE_OPS = {qd.quantize_per_tensor.default, qd.quantize_per_channel.default}
DEQUANTIZE_OPS = {qd.dequantize_per_tensor.default, qd.dequantize_per_channel.default}
OBSERVER_PREFIX = "_fxport_observer_"
_CALL_OPS = ("call_function", "call_method", "call_module")


def copy_graph_module(gm: GraphModule) -> GraphModule:
    """A new GraphModule over a copy of `gm`'s graph, sharing its tensors and leaf modules.

    The copy gets fresh containers, so rebinding names on it never touches `gm` (see graph_attrs).
    """
    new = GraphModule(gm, copy.deepcopy(gm.graph), class_name=type(gm).__name__)
    new.meta = dict(getattr(gm, "meta", {}))
    return new


# --------------------------------------------------------------------------------------
# Where Q/DQ goes
# --------------------------------------------------------------------------------------


def plan_qdq(gm: GraphModule, layers: Iterable[Layer], quantized: set[str]) -> dict[str, str]:
    """Tensors (node names) that get a Q/DQ pair → the node whose range sets their scale.

    `quantized` names the layers to quantize; the rest (fallbacks) stay float and add nothing.
    """
    by_node = {layer.node: layer for layer in layers}
    observed: dict[str, str] = {}

    def need(node: Node) -> None:
        if node.name in observed or node.op in ("get_attr", "output"):
            return
        if is_pass_through(node, gm):
            src = data_input(node)
            if src is not None and src.name in observed:
                observed[node.name] = observed[src.name]
                return
        observed[node.name] = node.name

    for node in gm.graph.nodes:
        layer = by_node.get(node.name)
        if layer is not None and layer.name in quantized:
            need(layer.activation(node))
            # Its output too, even when only the graph's output reads it (logits): measured with
            # onnxruntime 1.32, a DQ→Gemm with no Q after it runs as a float Gemm, and rounding the
            # logits to int8 costs little next to the error of the layers before.
            observed[node.name] = node.name
            continue
        if node.op not in _CALL_OPS:
            continue
        src = data_input(node)
        if src is None or src.name not in observed:
            continue
        if is_relu(node, gm) or is_clamp(node, gm):
            # The input is on an int8 grid already: requantizing at a finer scale only adds a
            # second rounding, so ReLU shares its input's scale. When ReLU is the only reader
            # of a layer's output, that output takes the ReLU's (non-negative) range: the
            # negatives it then clips are zeroed by the ReLU anyway, and the positives get
            # all 127 steps instead of sharing them with values the ReLU discards.
            if observed[src.name] == src.name and len(src.users) == 1:
                observed[src.name] = node.name
                observed[node.name] = node.name
            else:
                observed[node.name] = observed[src.name]
        elif is_avg_pool(node, gm):
            observed[node.name] = node.name
        elif is_add(node, gm) and all(a.name in observed for a in node.args if isinstance(a, Node)):
            observed[node.name] = node.name
    return observed


# --------------------------------------------------------------------------------------
# Observers and calibration
# --------------------------------------------------------------------------------------


def insert_observers(
    gm: GraphModule, nodes: Iterable[str], kind: str
) -> tuple[GraphModule, dict[str, ActivationObserver]]:
    """A copy of `gm` with an observer (a call_module node) after each of `nodes`."""
    obs_gm = copy_graph_module(gm)
    by_name = {n.name: n for n in obs_gm.graph.nodes}
    observers: dict[str, ActivationObserver] = {}
    last_placeholder = _last_placeholder(obs_gm)
    for i, name in enumerate(sorted(set(nodes), key=list(by_name).index)):
        node = by_name[name]
        observer = ActivationObserver(kind)
        attr = f"{OBSERVER_PREFIX}{i}"
        obs_gm.add_submodule(attr, observer)
        anchor = last_placeholder if node.op == "placeholder" else node
        with obs_gm.graph.inserting_after(anchor):
            obs_node = obs_gm.graph.call_module(attr, (node,))
        # called within replace_all_uses_with, in this iteration
        node.replace_all_uses_with(obs_node, delete_user_cb=lambda user: user is not obs_node)  # noqa: B023
        observers[name] = observer
    obs_gm.graph.lint()
    obs_gm.recompile()
    return obs_gm, observers


def calibrate(obs_gm: GraphModule, batches: list[tuple[Any, ...]],
              on_batch: Callable[[int, int], None] | None = None) -> None:
    with torch.no_grad():
        for i, args in enumerate(batches):
            obs_gm(*args)
            if on_batch:
                on_batch(i + 1, len(batches))


# --------------------------------------------------------------------------------------
# Q/DQ conversion
# --------------------------------------------------------------------------------------


@dataclass
class QdqGraph:
    """A converted graph and where things landed in it."""

    gm: GraphModule
    layer_nodes: dict[str, str]  # layer name → its conv/linear node in gm
    layer_outputs: dict[str, str]  # layer name → node holding its (dequantized) output
    input_scales: dict[str, float]  # layer name → scale of its input activation
    output_scales: dict[str, float]  # layer name → scale of its output activation (absent: float output)
    scheme: Int8Scheme = TENSORRT
    input_zero_points: dict[str, int] = field(default_factory=dict)
    output_zero_points: dict[str, int] = field(default_factory=dict)
    qdq_pairs: int = 0
    fallback: list[str] = field(default_factory=list)
    # layer → the ReLU/clamp (node name) whose range its output Q takes, as it alone reads it
    # (see plan_qdq): the layer's error counts after that op, since what it discards is no error
    activation_after: dict[str, str] = field(default_factory=dict)


def convert(gm: GraphModule, layers: list[Layer], quantized: set[str], qparams: dict[str, tuple[float, int]],
            plan: dict[str, str], scheme: Int8Scheme = TENSORRT) -> QdqGraph:
    """A copy of `gm` with Q/DQ per `plan` and the `quantized` layers reading int8 weights.

    `gm` is not modified. `qparams` maps the source nodes of `plan` to their activation
    (scale, zero point) in `scheme`.
    """
    qgm = copy_graph_module(gm)
    graph = qgm.graph
    idle_relus = _idle_relus(qgm, plan, qparams, scheme) if scheme.asymmetric else []
    for relu in idle_relus:  # its input's Q already clips at 0: its readers read that tensor's pair
        relu.replace_all_uses_with(node_arg(relu, 0))
        graph.erase_node(relu)
        plan = {k: v for k, v in plan.items() if k != relu.name}
    by_name = {n.name: n for n in graph.nodes}
    dq_of, pairs = _insert_activation_qdq(qgm, by_name, plan, qparams, scheme)
    result = QdqGraph(qgm, {}, {}, {}, {}, scheme=scheme, qdq_pairs=pairs,
                      fallback=[layer.name for layer in layers if layer.name not in quantized])
    weights_done: dict[str, tuple[str, str, str]] = {}
    for layer in layers:
        if layer.name in quantized:
            _record_activation_scales(result, layer, by_name[layer.node], plan, qparams)
            _read_int8_weight(result, gm, layer, by_name[layer.node], weights_done)
            result.layer_outputs[layer.name] = dq_of[layer.node].name if layer.node in dq_of \
                else result.layer_nodes[layer.name]
    prune_unused_attrs(qgm)
    graph.lint()
    qgm.recompile()
    return result


def _insert_activation_qdq(qgm: GraphModule, by_name: dict[str, Node], plan: dict[str, str],
                           qparams: dict[str, tuple[float, int]], scheme: Int8Scheme
                           ) -> tuple[dict[str, Node], int]:
    """A Q→DQ pair after every tensor of `plan`, in its source's (scale, zero point). Returns each
    tensor's first DQ node and the number of pairs inserted."""
    graph = qgm.graph
    last_placeholder = _last_placeholder(qgm)
    dq_of: dict[str, Node] = {}
    pairs = 0
    for name, src in plan.items():
        node = by_name[name]
        base_scale, zero = float(qparams[src][0]), int(qparams[src][1])
        qargs = (zero, scheme.act_qmin, scheme.act_qmax, scheme.act_dtype)
        anchor = last_placeholder if node.op == "placeholder" else node
        # asymmetric: one pair shared by every reader (onnxruntime gives each reader its own DQ itself)
        users = list(node.users) if not scheme.asymmetric else [None]
        # Symmetric: one Q→DQ pair per reader, each pair's scale one float32 step above the
        # previous reader's. Measured with onnxruntime 1.32 on x86: symmetric int8 activations
        # run as uint8 kernels only where a QuantizeLinear has a single DequantizeLinear reader;
        # both the exporter's optimizer and ORT's own CSE merge identical pairs back into a shared
        # one, and a Conv behind a shared pair stays a float Conv (11 of 20 in a ResNet-18). Pairs
        # whose scales differ by 1 ulp (1.2e-7 relative) are not identical, so they survive,
        # and every Conv becomes a QLinearConv. Asymmetric uint8 needs none of that: onnxruntime
        # gives each reader of a shared pair its own DQ and fuses them all (measured: the
        # ResNet-18 benchmark's graph then optimizes to the same ops as quantize_static's).
        for k, user in enumerate(users):
            scale = _float32_step(base_scale, k)
            with graph.inserting_after(anchor):
                q = graph.call_function(qd.quantize_per_tensor.default, (node, scale, *qargs))
            with graph.inserting_after(q):
                dq = graph.call_function(qd.dequantize_per_tensor.default, (q, scale, *qargs))
            if user is None:
                # called within replace_all_uses_with, in this iteration
                node.replace_all_uses_with(dq, delete_user_cb=lambda u: u is not q)  # noqa: B023
            else:
                user.replace_input_with(node, dq)
            q.meta["fxport_qdq"] = dq.meta["fxport_qdq"] = {"tensor": name, "scale": scale, "zero_point": zero}
            dq_of.setdefault(name, dq)
            pairs += 1
    return dq_of, pairs


def _record_activation_scales(result: QdqGraph, layer: Layer, node: Node, plan: dict[str, str],
                              qparams: dict[str, tuple[float, int]]) -> None:
    """The (scale, zero point) of a quantized layer's input and output activations, as `result` reports them."""
    in_name = _undo_dq(layer.activation(node))
    if in_name in plan:
        result.input_scales[layer.name] = _float32_step(qparams[plan[in_name]][0], 0)
        result.input_zero_points[layer.name] = int(qparams[plan[in_name]][1])
    else:
        result.input_scales[layer.name] = float("nan")
    if layer.node in plan:
        result.output_scales[layer.name] = _float32_step(qparams[plan[layer.node]][0], 0)
        result.output_zero_points[layer.name] = int(qparams[plan[layer.node]][1])
        if plan[layer.node] != layer.node:
            result.activation_after[layer.name] = plan[layer.node]


def _read_int8_weight(result: QdqGraph, gm: GraphModule, layer: Layer, node: Node,
                      weights_done: dict[str, tuple[str, str, str]]) -> None:
    """Make the layer's node read its weight as int8 through a per-channel DQ (one int8 copy per weight
    however many layers share it); a call_module layer becomes its functional form."""
    qgm, scheme = result.gm, result.scheme
    graph = qgm.graph
    if layer.weight not in weights_done:
        weights_done[layer.weight] = _bind_int8_weight(qgm, layer, scheme.weight_qmax)
    w_int8, w_scale, w_zp = weights_done[layer.weight]
    with graph.inserting_before(node):
        wq = graph.get_attr(w_int8)
        ws = graph.get_attr(w_scale)
        wz = graph.get_attr(w_zp)
        wdq = graph.call_function(qd.dequantize_per_channel.default,
                                  (wq, ws, wz, layer.axis, -scheme.weight_qmax, scheme.weight_qmax, torch.int8))
    if node.op == "call_module":
        node = _functional_layer(qgm, node, layer, wdq, gm.get_submodule(str(node.target)))
    else:
        args = list(node.args)
        old_weight = args[layer.w_arg]
        args[layer.w_arg] = wdq
        node.args = tuple(args)
        if isinstance(old_weight, Node) and not old_weight.users:
            graph.erase_node(old_weight)
    node.meta["fxport_layer"] = layer.name
    result.layer_nodes[layer.name] = node.name


def _idle_relus(qgm: GraphModule, plan: dict[str, str], qparams: dict[str, tuple[float, int]],
                scheme: Int8Scheme) -> list[Node]:
    """The ReLUs that only repeat what their input's Q already does.

    When a ReLU is the only reader of a tensor, that tensor's Q takes the ReLU's range (plan_qdq);
    asymmetric, that range starts at 0, so the zero point is the lowest code and the Q clips
    every negative already: DQ→ReLU→Q computes nothing. Measured with onnxruntime 1.32 on the
    ResNet-18 benchmark, those ReLUs (after the residual adds) stayed float ops between int8
    kernels, with layout transposes around them. (Symmetric int8 keeps negatives down to -128
    steps, so there the ReLU does work and stays.)"""
    idle = []
    for node in qgm.graph.nodes:
        if node.name not in plan or plan[node.name] != node.name or not is_relu(node, qgm):
            continue
        x = data_input(node)
        if x is not None and plan.get(x.name) == node.name and len(x.users) == 1 \
                and qparams[node.name][1] == scheme.act_qmin:
            idle.append(node)
    return idle


def _float32_step(scale: float, steps: int) -> float:
    """`scale` as a float32 value, `steps` float32 ulps up (exact as a Python float)."""
    value = np.float32(scale)
    for _ in range(steps):
        value = np.nextafter(value, np.float32(np.inf), dtype=np.float32)
    return float(value)


def _undo_dq(node: Any) -> str | None:
    """The tensor a DQ node dequantizes (the name `plan` knows it by), else the node's own name."""
    if not isinstance(node, Node):
        return None
    if node.op == "call_function" and node.target is qd.dequantize_per_tensor.default:
        q = node.args[0]
        if isinstance(q, Node) and q.target is qd.quantize_per_tensor.default and isinstance(q.args[0], Node):
            return q.args[0].name
    return node.name


def _container(qgm: GraphModule, prefix: str) -> nn.Module:
    """The module at `prefix` in qgm, created (as a plain container) where missing."""
    owner: nn.Module = qgm
    for part in [p for p in prefix.split(".") if p]:
        child = getattr(owner, part, None)
        if not isinstance(child, nn.Module):
            child = nn.Module()
            owner.add_module(part, child)
        owner = child
    return owner


def _bind_int8_weight(qgm: GraphModule, layer: Layer, qmax: int) -> tuple[str, str, str]:
    """Register the layer's int8 weight, scales and zero points on qgm; return their qualified names."""
    weight = fetch_attr(qgm, layer.weight)
    w_int8, w_scale = quantize_weight(weight, axis=layer.axis, qmax=qmax)
    prefix, field_name = split_target(layer.weight)
    owner = _container(qgm, prefix)
    if not is_own_container(qgm, owner):
        # a call_module layer: its own module is the user's; it is replaced in _functional_layer,
        # so the int8 tensors go on a fresh container bound in its place first
        fresh = nn.Module()
        parent_prefix, leaf = split_target(prefix)
        setattr(_container(qgm, parent_prefix), leaf, fresh)
        if getattr(owner, "bias", None) is not None:
            fresh.register_buffer("bias", cast(torch.Tensor, owner.bias).detach())
        owner = fresh
    names = []
    zero_point = torch.zeros_like(w_scale, dtype=torch.int64)
    for suffix, value in (("int8", w_int8), ("scale", w_scale), ("zero_point", zero_point)):
        attr = unique_name(owner, f"{field_name}_{suffix}")
        owner.register_buffer(attr, value)
        names.append(f"{prefix}.{attr}" if prefix else attr)
    return names[0], names[1], names[2]


def _functional_layer(qgm: GraphModule, node: Node, layer: Layer, wdq: Node, original: nn.Module) -> Node:
    """Replace a call_module Conv/Linear (whose module was swapped for a container) by F.conv*/F.linear."""
    graph = qgm.graph
    module_path = str(node.target)
    with graph.inserting_before(node):
        bias = graph.get_attr(f"{module_path}.bias") if layer.bias is not None else None
        x = node.args[0]
        if layer.op == "linear":
            new = graph.call_function(F.linear, (x, wdq, bias))
        else:
            fn = {"conv1d": F.conv1d, "conv2d": F.conv2d, "conv3d": F.conv3d}[layer.op]
            conv_args: tuple[Any, ...] = (x, wdq, bias, original.stride, original.padding, original.dilation,
                                          original.groups)
            new = graph.call_function(fn, conv_args)
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    return new


def _last_placeholder(gm: GraphModule) -> Node:
    placeholders: list[Node] = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if not placeholders:
        raise ValueError("the graph has no inputs")
    return placeholders[-1]


def count_qdq(gm: GraphModule) -> dict[str, int]:
    counts = {"quantize": 0, "dequantize": 0}
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in QUANTIZE_OPS:
            counts["quantize"] += 1
        elif n.op == "call_function" and n.target in DEQUANTIZE_OPS:
            counts["dequantize"] += 1
    return counts

