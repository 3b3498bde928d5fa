"""Lower a QDQ graph to torch's int8 CPU kernels (x86/fbgemm): the fast TorchScript int8 form.

An activation of either scheme (scheme.py) is a quint8 tensor, the form torch's quantized
kernels take: asymmetric uint8 as it is, symmetric int8 (scale s, zero point 0, [-128, 127])
as quint8 with scale s and zero point 128. Patterns whose inputs are dequantized and whose
outputs all go to QuantizeLinear become int8 kernels:

    DQ → Conv/Linear(int8 weight) → Q    torch.ao.nn.quantized Conv*/Linear (packed weights)
      … → ReLU (only reader)             fused: ConvReLU* / LinearReLU
    DQ, DQ → add → Q                     quantized::add (add_relu when a ReLU follows)
    DQ → ReLU / max pool / reshape → Q   the same op on the int8 tensor (same scale)

Everything else keeps its float form between a real `torch.quantize_per_tensor` and
`.dequantize()` — the same numbers as the QDQ graph. The pairs of one tensor that differ
by a float32 ulp (int8.convert) are treated as one scale here.

Deprecation, measured on torch 2.13: creating quantized tensors warns that quint8/qint8
tensors are deprecated and will be removed; the kernels still run. The warnings are filtered
where the lowering calls them; the archive depends on them all the same (see the manifest).
"""

from __future__ import annotations

import math
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn
from torch.fx import Graph, GraphModule, Node

from fxport.workers.engine.passes import node_arg
from fxport.workers.engine.passes.graph_attrs import bind_op_args, fetch_attr
from fxport.workers.engine.quantize.int8 import qd
from fxport.workers.engine.quantize.layers import (
    CONV_ATEN,
    CONV_FUNCTIONS,
    is_add,
    is_pass_through,
    is_relu,
)

INT8_SHIFT = 128  # int8 [-128, 127] with zero point z == quint8 [0, 255] with zero point z + 128


def _quint8_zero_point(zero_point: int, dtype: torch.dtype) -> int:
    return int(zero_point) + (INT8_SHIFT if dtype == torch.int8 else 0)


def _q_params(q: Node) -> tuple[float, int]:
    """(scale, quint8 zero point) of a quantize_per_tensor node: args (x, scale, zero_point, min, max, dtype)."""
    return float(cast(float, q.args[1])), _quint8_zero_point(cast(int, q.args[2]), cast(torch.dtype, q.args[5]))


def _weight_tensors(qgm: GraphModule, dq: Node) -> tuple[Any, Any, Any]:
    """The int8 weight, scales and zero points a dequantize_per_channel node reads (its get_attr args)."""
    w, s, z = (fetch_attr(qgm, str(a.target)) for a in cast("tuple[Node, ...]", dq.args[:3]))
    return w, s, z


@dataclass
class Lowered:
    graph_module: GraphModule
    kernels: dict[str, int] = field(default_factory=dict)
    float_islands: int = 0  # float ops between int8 tensors (quantize → op → dequantize)


def _same_scale(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-5, abs_tol=0.0)


def _quantized_modules() -> tuple[Any, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torch.ao.nn.intrinsic.quantized as nniq
        import torch.ao.nn.quantized as nnq
    return nnq, nniq


class _Lowerer:
    def __init__(self, qgm: GraphModule) -> None:
        self.qgm = qgm
        self.root = nn.Module()
        self.graph = Graph()
        self.env: dict[Node, Any] = {}  # old node → new node with its float value
        # old node → (new node holding it as quint8, scale, quint8 zero point)
        self.twin: dict[Node, tuple[Node, float, int]] = {}
        self.kernels: Counter[str] = Counter()
        self.float_islands = 0
        self.modules = 0
        self.nnq, self.nniq = _quantized_modules()

    # -- values ---------------------------------------------------------------------------

    def value(self, old: Any) -> Any:
        """The new-graph float value of an old node (dequantizing its int8 twin on first need)."""
        if isinstance(old, Node):
            if old not in self.env:
                if old in self.twin:
                    self.env[old] = self.graph.call_method("dequantize", (self.twin[old][0],))
                elif old.op == "call_function" and old.target is qd.dequantize_per_tensor.default:
                    q = node_arg(old, 0)
                    self.env[old] = self.graph.call_method("dequantize", (self.twin[q][0],))
                else:
                    raise RuntimeError(f"node {old.name} has no value in the lowered graph")
            return self.env[old]
        if isinstance(old, (list, tuple)):
            return type(old)(self.value(a) for a in old)
        if isinstance(old, dict):
            return {k: self.value(v) for k, v in old.items()}
        return old

    def int8_input(self, old: Any) -> tuple[Node, float, int] | None:
        """(int8 twin, scale, zero point) if `old` is a DQ of a quantized value, else None."""
        if isinstance(old, Node) and old.op == "call_function" and old.target is qd.dequantize_per_tensor.default:
            q = node_arg(old, 0)
            return self.twin.get(q)
        return None

    def output_qparams(self, node: Node) -> tuple[float, int] | None:
        """(scale, quint8 zero point) every reader quantizes `node` to, if all its readers are Q nodes
        of one scale and zero point."""
        users = list(node.users)
        if not users or any(u.op != "call_function" or u.target is not qd.quantize_per_tensor.default for u in users):
            return None
        params = [_q_params(u) for u in users]
        scale, zero = params[0]
        return params[0] if all(_same_scale(scale, s) and z == zero for s, z in params) else None

    # -- the walk ----------------------------------------------------------------------------

    def run(self) -> GraphModule:
        for node in self.qgm.graph.nodes:
            if node.op == "placeholder":
                new = self.graph.placeholder(node.target, type_expr=node.type)
                new.meta = dict(node.meta)
                self.env[node] = new
            elif node.op == "get_attr":
                continue  # copied on first use
            elif node.op == "output":
                self.graph.output(self.value(node.args[0]))
            elif node.op == "call_function" and node.target is qd.quantize_per_tensor.default:
                self.quantize(node)
            elif node.op == "call_function" and node.target in (qd.dequantize_per_tensor.default,
                                                                  qd.dequantize_per_channel.default):
                continue  # consumed by patterns, or dequantized when a float op needs it
            elif not self.try_int8(node):
                self.copy(node)
        gm = GraphModule(self.root, self.graph, class_name="FxportInt8Module")
        gm.graph.eliminate_dead_code()
        self.fuse_relu(gm)
        gm.graph.lint()
        gm.recompile()
        return gm

    def copy(self, node: Node) -> None:
        def arg(a: Node) -> Any:
            if a.op == "get_attr":
                return self.attr(a)
            if a.op == "call_function" and a.target is qd.dequantize_per_channel.default:
                return self.dequantized_weight(a)
            return self.value(a)

        if node.op == "call_module":
            name = str(node.target).replace(".", "_")
            if not hasattr(self.root, name):
                self.root.add_module(name, self.qgm.get_submodule(str(node.target)))
            new = self.graph.call_module(name, torch.fx.node.map_arg(node.args, arg),
                                         torch.fx.node.map_arg(node.kwargs, arg))
        else:
            new = self.graph.create_node(node.op, node.target, torch.fx.node.map_arg(node.args, arg),
                                         torch.fx.node.map_arg(node.kwargs, arg), name=node.name)
        new.meta = dict(node.meta)
        self.env[node] = new
        if any(isinstance(a, Node) and a.target is qd.dequantize_per_tensor.default for a in node.all_input_nodes):
            self.float_islands += 1

    def attr(self, old: Node) -> Node:
        name = "_attr_" + str(old.target).replace(".", "_")
        if not hasattr(self.root, name):
            value = fetch_attr(self.qgm, str(old.target))
            if isinstance(value, torch.Tensor):
                self.root.register_buffer(name, value)
            else:
                setattr(self.root, name, value)
        return self.graph.get_attr(name)

    def dequantized_weight(self, dq: Node) -> Node:
        w, s, z = _weight_tensors(self.qgm, dq)
        axis = cast(int, dq.args[3])
        shape = [1] * w.dim()
        shape[axis] = -1
        name = f"_weight_{dq.name}"
        if not hasattr(self.root, name):
            self.root.register_buffer(name, (w.float() - z.reshape(shape).float()) * s.reshape(shape).float())
        return self.graph.get_attr(name)

    def quantize(self, q: Node) -> None:
        x, (scale, zero) = node_arg(q, 0), _q_params(q)
        if x in self.twin and _same_scale(self.twin[x][1], scale) and self.twin[x][2] == zero:
            self.twin[q] = self.twin[x]  # the producer already gives this int8 tensor
            return
        new = self.graph.call_function(torch.quantize_per_tensor, (self.value(x), scale, zero, torch.quint8))
        self.twin[q] = (new, scale, zero)

    # -- int8 patterns ------------------------------------------------------------------------

    def try_int8(self, node: Node) -> bool:
        if node.op not in ("call_function", "call_method", "call_module"):
            return False
        out = self.output_qparams(node)
        if out is None:
            return False
        if node.op == "call_function" and (node.target in CONV_FUNCTIONS or node.target in CONV_ATEN):
            return self.layer(node, out)
        if is_relu(node, self.qgm) or is_pass_through(node, self.qgm):
            src = self.int8_input(node.args[0] if node.args else None)
            if src is None or not _same_scale(src[1], out[0]) or src[2] != out[1]:
                return False
            if is_relu(node, self.qgm):
                new = self.graph.call_function(torch.relu, (src[0],))
                self.kernels["relu (int8)"] += 1
            else:
                args = (src[0], *[self.value(a) for a in node.args[1:]])
                kwargs = {k: self.value(v) for k, v in node.kwargs.items()}
                if node.op == "call_module":
                    name = str(node.target).replace(".", "_")
                    if not hasattr(self.root, name):
                        self.root.add_module(name, self.qgm.get_submodule(str(node.target)))
                    new = self.graph.call_module(name, args, kwargs)
                else:
                    new = self.graph.create_node(node.op, node.target, args, kwargs)
                self.kernels["max pool / reshape (int8)"] += 1
            self.twin[node] = (new, src[1], src[2])
            return True
        if is_add(node, self.qgm):
            a, b = (self.int8_input(x) for x in node.args[:2])
            if a is None or b is None:
                return False
            new = self.graph.call_function(torch.ops.quantized.add, (a[0], b[0], *out))
            self.twin[node] = (new, *out)
            self.kernels["quantized add"] += 1
            return True
        return False

    def layer(self, node: Node, out: tuple[float, int]) -> bool:
        x = self.int8_input(node.args[0])
        wdq = node.args[1] if len(node.args) > 1 else None
        if x is None or not (isinstance(wdq, Node) and wdq.target is qd.dequantize_per_channel.default):
            return False
        kind = CONV_FUNCTIONS.get(node.target) or CONV_ATEN.get(node.target)
        w_int8, w_scale, w_zp = _weight_tensors(self.qgm, wdq)
        if int(cast(int, wdq.args[3])) != 0 or bool((w_zp != 0).any()):
            return False
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            qweight = torch._make_per_channel_quantized_tensor(
                w_int8, w_scale.double(), torch.zeros_like(w_zp, dtype=torch.long), 0)
        bias = self._bias(node)
        if kind == "linear":
            module = self.nnq.Linear(w_int8.shape[1], w_int8.shape[0], bias_=bias is not None)
        else:
            spec = self._conv_args(node)
            if spec is None:
                return False
            stride, padding, dilation, groups = spec
            if isinstance(padding, str):
                return False
            dims = w_int8.dim() - 2
            cls = {1: self.nnq.Conv1d, 2: self.nnq.Conv2d, 3: self.nnq.Conv3d}.get(dims)
            if cls is None:
                return False
            module = cls(w_int8.shape[1] * groups, w_int8.shape[0], tuple(w_int8.shape[2:]), stride=stride,
                         padding=padding, dilation=dilation, groups=groups, bias=bias is not None)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module.set_weight_bias(qweight, bias)
        module.scale, module.zero_point = float(out[0]), int(out[1])
        name = f"qlayer_{self.modules}"
        self.modules += 1
        self.root.add_module(name, module)
        new = self.graph.call_module(name, (x[0],))
        new.meta["fxport_layer"] = node.meta.get("fxport_layer", node.name)
        self.twin[node] = (new, float(out[0]), int(out[1]))
        self.kernels[f"quantized {'linear' if kind == 'linear' else kind}"] += 1
        return True

    def _bias(self, node: Node) -> torch.Tensor | None:
        b = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        if b is None:
            return None
        if isinstance(b, Node) and b.op == "get_attr":
            bias: torch.Tensor = fetch_attr(self.qgm, str(b.target))
            return bias.detach().float()
        raise RuntimeError(f"bias of {node.name} is not a constant")

    def _conv_args(self, node: Node) -> tuple[Any, Any, Any, int] | None:
        if node.target in CONV_FUNCTIONS:  # F.conv*(input, weight, bias, stride, padding, dilation, groups)
            names = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
            defaults = {"stride": 1, "padding": 0, "dilation": 1, "groups": 1}
            got: dict[str, Any] = dict(defaults)
            got.update({n: a for n, a in zip(names, node.args)})
            got.update(node.kwargs)
        else:
            got = bind_op_args(node) or {}
            if node.target is torch.ops.aten.convolution.default and (
                got.get("transposed") or any(got.get("output_padding") or [])
            ):
                return None
        if any(isinstance(got[k], Node) for k in ("stride", "padding", "dilation", "groups")):
            return None
        return got["stride"], got["padding"], got["dilation"], int(got["groups"])

    # -- ReLU fusion ------------------------------------------------------------------------

    def fuse_relu(self, gm: GraphModule) -> None:
        """int8 Conv/Linear or add whose only reader is an int8 ReLU ⇒ the fused kernel."""
        fused = {self.nnq.Conv1d: self.nniq.ConvReLU1d, self.nnq.Conv2d: self.nniq.ConvReLU2d,
                 self.nnq.Conv3d: self.nniq.ConvReLU3d, self.nnq.Linear: self.nniq.LinearReLU}
        for relu in list(gm.graph.nodes):
            if relu.op != "call_function" or relu.target is not torch.relu:
                continue
            src = relu.args[0]
            if not isinstance(src, Node) or len(src.users) != 1:
                continue
            if src.op == "call_module":
                mod = gm.get_submodule(str(src.target))
                cls = fused.get(type(mod))
                if cls is None:
                    continue
                setattr(gm, str(src.target), _fused_copy(mod, cls))
                self.kernels[f"{type(mod).__name__} + ReLU fused"] += 1
            elif src.op == "call_function" and src.target is torch.ops.quantized.add:
                src.target = torch.ops.quantized.add_relu
                self.kernels["add + ReLU fused"] += 1
            else:
                continue
            self.kernels["relu (int8)"] -= 1
            relu.replace_all_uses_with(src)
            gm.graph.erase_node(relu)
        for key in [k for k, v in self.kernels.items() if v <= 0]:
            del self.kernels[key]


def _fused_copy(mod: Any, cls: type) -> nn.Module:
    """`mod`: a torch.ao quantized Conv/Linear (its weight() and bias() are methods)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        weight, bias = mod.weight(), mod.bias()
        if hasattr(mod, "in_channels"):
            new = cls(mod.in_channels, mod.out_channels, mod.kernel_size, stride=mod.stride, padding=mod.padding,
                      dilation=mod.dilation, groups=mod.groups, bias=bias is not None)
        else:
            new = cls(mod.in_features, mod.out_features, bias=bias is not None)
        new.set_weight_bias(weight, bias)
    new.scale, new.zero_point = mod.scale, mod.zero_point
    return cast(nn.Module, new)


def lower_to_quantized_kernels(qgm: GraphModule) -> Lowered:
    """The QDQ graph `qgm` (not modified) with int8 kernels where the patterns above match."""
    lowerer = _Lowerer(qgm)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gm = lowerer.run()
    if not any(k.startswith("quantized") for k in lowerer.kernels):
        raise RuntimeError("no Conv/Linear matched an int8 kernel")
    return Lowered(gm, dict(lowerer.kernels), lowerer.float_islands)
