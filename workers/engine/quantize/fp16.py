"""fp16: the graph in half precision, with normalizations and reductions kept in fp32.

`to_half` rewrites a copy of the graph:
- float parameters and buffers become fp16, except those only fp32 ops read;
- float inputs are cast to fp16 on entry, float outputs back to fp32 on exit, so every
  artifact keeps the model's fp32 interface (a drop-in replacement);
- ops on the keep-in-fp32 list (`KEEP_FP32_*`: norms, softmax, reductions — where fp16's
  10-bit mantissa or 65504 ceiling loses accuracy or overflows) read fp32 inputs and
  give fp16 back;
- the activation input of every Conv/Linear/matmul is cast to fp16 (a no-op when it is
  already), so fp32 values made inside the graph (masks, `.float()` calls) cannot reach
  an fp16 weight.
The ONNX exporter turns the casts into Cast nodes around the fp32 islands; jit.trace
keeps them, giving a TorchScript half model.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeGuard

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import GraphModule, Node
from torch.fx.passes.shape_prop import ShapeProp

from fxport.workers.engine.passes.graph_attrs import bind_tensor, fetch_attr, is_own_container, split_target
from fxport.workers.engine.quantize.int8 import copy_graph_module

aten = torch.ops.aten
HALF = torch.float16

KEEP_FP32_MODULES = (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm,
                     nn.Softmax, nn.LogSoftmax)
KEEP_FP32_FUNCTIONS = {
    F.layer_norm, F.group_norm, F.batch_norm, F.instance_norm, F.softmax, F.log_softmax, F.normalize,
    torch.softmax, torch.log_softmax, torch.mean, torch.sum, torch.norm, torch.var, torch.std, torch.cumsum,
    torch.logsumexp, torch.var_mean, torch.std_mean, torch.rsqrt,
    aten.layer_norm.default, aten.native_layer_norm.default, aten.group_norm.default, aten.native_group_norm.default,
    aten.batch_norm.default, aten._native_batch_norm_legit_no_training.default, aten.instance_norm.default,
    aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default,
    aten.mean.dim, aten.mean.default, aten.sum.dim_IntList, aten.sum.default, aten.linalg_vector_norm.default,
    aten.norm.ScalarOpt_dim, aten.var.correction, aten.std.correction, aten.var_mean.correction,
    aten.cumsum.default, aten.logsumexp.default, aten.rsqrt.default,
}
KEEP_FP32_METHODS = {"softmax", "log_softmax", "mean", "sum", "norm", "var", "std", "cumsum", "logsumexp", "rsqrt"}
# ops whose activation input must match an fp16 weight / other operand
COMPUTE_FUNCTIONS = {
    F.conv1d, F.conv2d, F.conv3d, F.linear, torch.matmul, torch.bmm, torch.mm, torch.baddbmm, torch.addmm,
    F.scaled_dot_product_attention,
    aten.conv1d.default, aten.conv2d.default, aten.conv3d.default, aten.convolution.default, aten.linear.default,
    aten.matmul.default, aten.bmm.default, aten.mm.default, aten.addmm.default, aten.baddbmm.default,
    aten.scaled_dot_product_attention.default,
}
COMPUTE_METHODS = {"matmul", "bmm", "mm"}
COMPUTE_MODULES = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear, nn.ConvTranspose1d, nn.ConvTranspose2d)


@dataclass
class HalfResult:
    graph_module: GraphModule
    kept_fp32: list[dict[str, str]] = field(default_factory=list)  # {"node", "op"}
    casts: int = 0


def _op_name(node: Node) -> str:
    if node.op == "call_module":
        return str(node.target)
    target = node.target
    return target if isinstance(target, str) else getattr(target, "__name__", str(target))


def keeps_fp32(node: Node, gm: GraphModule) -> bool:
    if node.meta.get("fxport_keep_fp32"):
        return True
    if node.op == "call_function":
        return node.target in KEEP_FP32_FUNCTIONS
    if node.op == "call_method":
        return node.target in KEEP_FP32_METHODS
    if node.op == "call_module":
        return isinstance(gm.get_submodule(str(node.target)), KEEP_FP32_MODULES)
    return False


def _is_compute(node: Node, gm: GraphModule) -> bool:
    if node.op == "call_function":
        return node.target in COMPUTE_FUNCTIONS
    if node.op == "call_method":
        return node.target in COMPUTE_METHODS
    if node.op == "call_module":
        return isinstance(gm.get_submodule(str(node.target)), COMPUTE_MODULES)
    return False


def _other_than(keep: Node) -> Callable[[Node], bool]:
    """A replace_all_uses_with `delete_user_cb` that leaves `keep` (the new node itself) reading the old one."""
    return lambda user: user is not keep


def _float_tensor(node: Any) -> TypeGuard[Node]:
    if not isinstance(node, Node):
        return False
    tm = node.meta.get("tensor_meta")
    return tm is not None and hasattr(tm, "dtype") and tm.dtype.is_floating_point


def to_half(gm: GraphModule, example_inputs: tuple[Any, ...]) -> HalfResult:
    """A copy of `gm` computing in fp16 except the keep-in-fp32 ops; fp32 in, fp32 out. `gm` is unchanged."""
    hgm = copy_graph_module(gm)
    graph = hgm.graph
    for node in list(graph.nodes):
        # torch.export's dtype assertions (float32 here) no longer hold once the graph is fp16
        if node.op == "call_function" and node.target is aten._assert_tensor_metadata.default:
            graph.erase_node(node)
    hgm.recompile()
    ShapeProp(hgm).propagate(*example_inputs)  # dtype of every node's result, in fp32
    kept: list[dict[str, str]] = []
    casts = 0

    def cast(value: Node, dtype: torch.dtype, *, before: Node | None = None, after: Node | None = None) -> Node:
        nonlocal casts
        ctx = graph.inserting_before(before) if before is not None else graph.inserting_after(after)
        with ctx:
            new = graph.call_method("to", (value, dtype))
        new.meta["tensor_meta"] = value.meta.get("tensor_meta")  # still a float tensor, for later checks
        new.meta["fxport_cast"] = True
        casts += 1
        return new

    nodes = list(graph.nodes)
    fp32_readers = _attrs_read_only_by_fp32_ops(hgm, nodes)
    for node in nodes:
        if node.op == "placeholder" and _float_tensor(node):
            anchor = [n for n in graph.nodes if n.op == "placeholder"][-1]
            half = cast(node, HALF, after=anchor)
            node.replace_all_uses_with(half, delete_user_cb=_other_than(half))
        elif node.op == "get_attr":
            value = fetch_attr(hgm, str(node.target))
            if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != HALF \
                    and str(node.target) not in fp32_readers:
                _rebind_half(hgm, str(node.target), value)
        elif node.op == "call_module" and not keeps_fp32(node, hgm):
            mod = hgm.get_submodule(str(node.target))
            if type(mod) in _FUNCTIONAL and getattr(mod, "padding_mode", "zeros") == "zeros":
                _functional_half(hgm, node, mod)
            elif any(t.is_floating_point() for t in list(mod.parameters()) + list(mod.buffers())):
                # A module rebuilt from its repr (FX source does that) comes back fp32 whatever its
                # weights were, so other modules with weights run in fp32, between casts.
                node.meta["fxport_keep_fp32"] = True

    for node in nodes:
        if node.op in ("call_function", "call_method", "call_module") and keeps_fp32(node, hgm):
            kept.append({"node": node.name, "op": _op_name(node)})
            for arg in list(node.all_input_nodes):
                if arg.op == "get_attr" and str(arg.target) in fp32_readers:
                    continue  # left in fp32: only fp32 ops read it
                if _float_tensor(arg):
                    node.replace_input_with(arg, cast(arg, torch.float32, before=node))
            outs = [node] if _float_tensor(node) else [u for u in node.users if u.op == "call_function"
                                                        and u.target is operator.getitem and _float_tensor(u)]
            for out in outs:
                half = cast(out, HALF, after=out)
                out.replace_all_uses_with(half, delete_user_cb=_other_than(half))
        elif node.op in ("call_function", "call_method", "call_module") and _is_compute(node, hgm):
            x = node.args[0] if node.args else None
            if _float_tensor(x):
                node.replace_input_with(x, cast(x, HALF, before=node))
            if node.op != "call_module" and len(node.args) > 1 and _float_tensor(node.args[1]) \
                    and node.args[1].op != "get_attr":  # matmul of two activations
                node.replace_input_with(node.args[1], cast(node.args[1], HALF, before=node))

    output = next(n for n in graph.nodes if n.op == "output")
    def back_to_fp32(value: Any) -> Any:
        if isinstance(value, Node) and _float_tensor(value):
            return cast(value, torch.float32, before=output)
        if isinstance(value, (list, tuple)):
            return type(value)(back_to_fp32(v) for v in value)
        if isinstance(value, dict):
            return {k: back_to_fp32(v) for k, v in value.items()}
        return value
    output.args = tuple(back_to_fp32(a) for a in output.args)
    graph.lint()
    hgm.recompile()
    casts -= _drop_noop_casts(hgm, example_inputs)
    return HalfResult(hgm, kept, casts)


def _drop_noop_casts(hgm: GraphModule, example_inputs: tuple[Any, ...]) -> int:
    """Run the half graph once (it must run) and remove the casts whose input has the target dtype."""
    ShapeProp(hgm).propagate(*example_inputs)
    dropped = 0
    for node in list(hgm.graph.nodes):
        if not node.meta.get("fxport_cast"):
            continue
        src, dtype = node.args
        tm = src.meta.get("tensor_meta") if isinstance(src, Node) else None
        if tm is not None and getattr(tm, "dtype", None) == dtype:
            node.replace_all_uses_with(src)
            hgm.graph.erase_node(node)
            dropped += 1
    hgm.graph.lint()
    hgm.recompile()
    return dropped


_FUNCTIONAL: dict[type[nn.Module], Callable[..., Any]] = {
    nn.Conv1d: F.conv1d, nn.Conv2d: F.conv2d, nn.Conv3d: F.conv3d, nn.Linear: F.linear,
}


def _functional_half(gm: GraphModule, node: Node, mod: Any) -> None:
    """call_module Conv/Linear ⇒ F.conv*/F.linear on fp16 copies of its weight and bias (in place on `node`).

    `mod`: an nn.Conv1d/2d/3d or nn.Linear (a key of _FUNCTIONAL)."""
    target = str(node.target)
    holder = nn.Module()
    holder.register_buffer("weight", mod.weight.detach().to(HALF))
    if mod.bias is not None:
        holder.register_buffer("bias", mod.bias.detach().to(HALF))
    _replace_module(gm, target, holder)
    graph = gm.graph
    with graph.inserting_before(node):
        w = graph.get_attr(f"{target}.weight")
        b = graph.get_attr(f"{target}.bias") if mod.bias is not None else None
    for attr in (w, b):
        if attr is not None:
            attr.meta["tensor_meta"] = None
    extra = () if isinstance(mod, nn.Linear) else (mod.stride, mod.padding, mod.dilation, mod.groups)
    node.op, node.target = "call_function", _FUNCTIONAL[type(mod)]
    node.args = (node.args[0], w, b, *extra)
    node.kwargs = {}


def _attrs_read_only_by_fp32_ops(gm: GraphModule, nodes: list[Node]) -> set[str]:
    """get_attr targets whose every reader keeps fp32 (a LayerNorm's weight at aten level)."""
    out = set()
    for node in nodes:
        if node.op == "get_attr" and node.users and all(keeps_fp32(u, gm) for u in node.users):
            out.add(str(node.target))
    return out


def _rebind_half(gm: GraphModule, target: str, value: torch.Tensor) -> None:
    prefix, name = split_target(target)
    owner = gm.get_submodule(prefix) if prefix else gm
    if not is_own_container(gm, owner):  # a tensor inside the user's module: give the graph its own holder
        holder = copy.copy(owner)
        holder._parameters, holder._buffers = dict(owner._parameters), dict(owner._buffers)
        _replace_module(gm, prefix, holder)
        owner = holder
    bind_tensor(owner, name, value.detach().to(HALF), like=value)


def _replace_module(gm: GraphModule, target: str, module: nn.Module) -> None:
    prefix, name = split_target(target)
    parent = gm.get_submodule(prefix) if prefix else gm
    setattr(parent, name, module)
