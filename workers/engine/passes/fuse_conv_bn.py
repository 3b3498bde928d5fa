"""fuse_conv_bn: fold eval-mode BatchNorm into the Conv, ConvTranspose (or Linear) that feeds it."""

from __future__ import annotations

import copy
import operator
from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import GraphModule, Node
from torch.fx.passes.shape_prop import ShapeProp

from fxport.spec import FuseConvBnOptions
from fxport.workers.engine.passes import PassContext, PassResult
from fxport.workers.engine.passes.graph_attrs import (
    bind_op_args,
    bind_tensor,
    erase_if_unused,
    fetch_attr,
    get_attr_users,
    is_own_container,
    node_rank,
    prune_unused_attrs,
    replace_submodule,
    set_op_arg,
    split_target,
    unique_name,
)

aten = torch.ops.aten

_CONV_MODULES = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
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


def fuse_conv_bn(gm: GraphModule, opts: FuseConvBnOptions, ctx: PassContext) -> PassResult:
    """Conv → BatchNorm(eval) ⇒ one Conv; with `opts.linear`, Linear → BatchNorm1d ⇒ one Linear.

    Mutates `gm` in place: fused weights are new tensors bound on gm's own containers; the
    user's modules and tensors (which the graph shares) are never written.

    Torch level: call_module Conv{1,2,3}d (or Linear) → call_module BatchNorm. Aten level:
    aten conv / linear / addmm / mm whose weight is a get_attr → an eval batch-norm op.
    A BatchNorm is left alone, and the notes say why, when its producer has other users,
    is shared, is not a Conv/Linear, or when it uses batch statistics (training mode).
    """
    fuser = _Fuser(gm, opts, ctx)
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and isinstance(_module(gm, node), nn.modules.batchnorm._BatchNorm):
            fuser.torch_level(node)
        elif node.op == "call_function" and node.target in _BN_OPS:
            fuser.aten_level(node)
        elif node.op == "call_function" and node.target is F.batch_norm:
            fuser._leave("F.batch_norm", "functional batch norm is folded only in aten graphs (capture with export)")
    changed = bool(fuser.folded)
    if changed:
        erase_if_unused(gm, fuser.maybe_dead)
        _erase_unused_bn_attrs(gm, fuser.bn_prefixes)
        prune_unused_attrs(gm)
        gm.graph.lint()
        gm.recompile()
    return PassResult(gm, changed, fuser.notes())


class _Fuser:
    def __init__(self, gm: GraphModule, opts: FuseConvBnOptions, ctx: PassContext) -> None:
        self.gm, self.opts, self.ctx = gm, opts, ctx
        self.folded: Counter[str] = Counter()  # "BatchNorm2d into Conv2d" → n
        self.left: Counter[str] = Counter()  # "BatchNorm2d: reason" → n
        self.maybe_dead: list[Node] = []
        self.bn_prefixes: set[str] = set()
        self._shapes_known = False

    # -- torch level ----------------------------------------------------------------------

    def torch_level(self, bn_node: Node) -> None:
        bn = _module(self.gm, bn_node)
        bn_kind = type(bn).__name__
        src = bn_node.args[0] if bn_node.args else None
        producer = _module(self.gm, src) if isinstance(src, Node) and src.op == "call_module" else None
        is_conv = isinstance(producer, _CONV_MODULES)
        is_linear = isinstance(producer, nn.Linear)
        if not (is_conv or is_linear):
            return self._leave(bn_kind, f"its input is not a Conv/Linear ({_describe(self.gm, src)})")
        for mod in (producer, bn):
            if type(mod).forward not in _PLAIN_FORWARDS:
                return self._leave(bn_kind, f"{type(mod).__name__} overrides forward, so the fold may not hold")
        if is_linear and not self.opts.linear:
            return self._leave(bn_kind, "it follows a Linear and options.linear is false")
        if bn.training or bn.running_mean is None or bn.running_var is None:
            return self._leave(bn_kind, "it normalizes with batch statistics (training mode or no running stats)")
        if len(src.users) != 1:
            return self._leave(bn_kind, f"the {type(producer).__name__} output has {len(src.users)} users")
        if sum(1 for n in self.gm.graph.nodes if n.op == "call_module" and n.target == src.target) != 1:
            return self._leave(bn_kind, f"the {type(producer).__name__} module is called more than once")
        expected_rank = 2 if is_linear else producer.weight.dim()  # Conv{k}d weight and output: k + 2 dims
        rank = self._rank(src)
        if is_linear and rank != 2:
            why = "its rank is unknown without example inputs" if rank is None else f"it has {rank} dims"
            return self._leave(bn_kind, f"the Linear output is not 2-D ({why}), so BatchNorm's channels are not its features")
        if is_conv and rank is not None and rank != expected_rank:
            return self._leave(bn_kind, f"the conv output has {rank} dims (unbatched?)")
        features = producer.out_channels if is_conv else producer.out_features
        if features != bn.num_features:
            return self._leave(bn_kind, f"it has {bn.num_features} features, its input {features}")
        if any(n.op == "get_attr" and n.target.startswith(src.target + ".") for n in self.gm.graph.nodes):
            return self._leave(bn_kind, f"the {type(producer).__name__} parameters are also read elsewhere")
        transposed = isinstance(producer, nn.modules.conv._ConvTransposeNd)
        weight, bias = _fold(producer.weight, producer.bias, bn, out_axis=0,
                             transposed_groups=producer.groups if transposed else None)
        fused = copy.deepcopy(producer)
        fused.weight = nn.Parameter(weight, requires_grad=False)
        fused.bias = nn.Parameter(bias, requires_grad=False)
        replace_submodule(self.gm, src.target, fused)
        bn_node.replace_all_uses_with(src)
        self.gm.graph.erase_node(bn_node)
        self.folded[f"{bn_kind} into {type(producer).__name__}"] += 1

    # -- aten level -----------------------------------------------------------------------

    def aten_level(self, bn_node: Node) -> None:
        bn_args = bind_op_args(bn_node)
        bn_kind = _module_kind(bn_node, "batch_norm")
        src = bn_args["input"]
        if bn_args.get("training", False):
            return self._leave(bn_kind, "it normalizes with batch statistics (exported in training mode)")
        stats = [bn_args["running_mean"], bn_args["running_var"]]
        if not all(isinstance(s, Node) and s.op == "get_attr" for s in stats):
            return self._leave(bn_kind, "its running statistics are not constant attributes")
        for name in ("weight", "bias"):
            value = bn_args[name]
            if value is not None and not (isinstance(value, Node) and value.op == "get_attr"):
                return self._leave(bn_kind, f"its {name} is computed in the graph, not an attribute")
        out_nodes = _bn_outputs(bn_node)
        if out_nodes is None:
            return self._leave(bn_kind, "its saved mean/invstd outputs are used")
        if not isinstance(src, Node) or src.op != "call_function":
            return self._leave(bn_kind, f"its input is not a Conv/Linear ({_describe(self.gm, src)})")
        if src.target in _CONV_OPS:
            plan = self._plan_conv(src, bn_kind)
        elif src.target in (aten.linear.default, aten.addmm.default, aten.mm.default):
            if not self.opts.linear:
                return self._leave(bn_kind, "it follows a Linear and options.linear is false")
            plan = self._plan_linear(src, bn_kind)
        else:
            return self._leave(bn_kind, f"its input is not a Conv/Linear ({_describe(self.gm, src)})")
        if plan is None:
            return
        if len(src.users) != 1:
            return self._leave(bn_kind, f"the {_module_kind(src, str(src.target))} output has {len(src.users)} users")

        weight_node, bias_node, weight_axis, weight_arg, transposed_groups = plan
        gm = self.gm
        bn_t = _BnTensors(
            weight=fetch_attr(gm, bn_args["weight"].target) if bn_args["weight"] is not None else None,
            bias=fetch_attr(gm, bn_args["bias"].target) if bn_args["bias"] is not None else None,
            running_mean=fetch_attr(gm, stats[0].target),
            running_var=fetch_attr(gm, stats[1].target),
            eps=float(bn_args["eps"]),
        )
        w = fetch_attr(gm, weight_node.target)
        b = fetch_attr(gm, bias_node.target) if bias_node is not None else None
        new_w, new_b = _fold(w, b, bn_t, out_axis=weight_axis, transposed_groups=transposed_groups)

        uses = get_attr_users(gm)
        w_user = weight_arg[1] if weight_arg[0] == "permute" else src
        new_w_node = self._bind(weight_node, new_w, uses, fallback_owner=weight_node.target, before=w_user)
        if weight_arg[0] == "permute":
            weight_arg[1].replace_input_with(weight_node, new_w_node)
        else:
            set_op_arg(src, weight_arg[1], new_w_node)
        new_b_node = self._bind(bias_node, new_b, uses, fallback_owner=weight_node.target, before=src)
        if src.target == aten.mm.default:  # mm has no bias: becomes addmm(bias, x, w)
            src.target = aten.addmm.default
            src.args = (new_b_node, *src.args)
            src.kwargs = {}
        elif src.target == aten.addmm.default:
            set_op_arg(src, "self", new_b_node)
        else:
            set_op_arg(src, "bias", new_b_node)

        for out in out_nodes:
            out.replace_all_uses_with(src)
        for out in out_nodes:
            if out is not bn_node:
                gm.graph.erase_node(out)
        gm.graph.erase_node(bn_node)
        self.maybe_dead += [n for n in (weight_node, bias_node) if n is not None]
        self.maybe_dead += [a for a in (bn_args["weight"], bn_args["bias"], *stats) if isinstance(a, Node)]
        self.bn_prefixes.add(split_target(stats[0].target)[0])
        self.folded[f"{bn_kind} into {_module_kind(src, _op_name(src))}"] += 1

    def _plan_conv(self, conv: Node, bn_kind: str):
        args = bind_op_args(conv)
        transposed = bool(args.get("transposed", False)) or conv.target in _CONV_TRANSPOSE_OPS
        groups = args.get("groups", 1)
        if transposed and not isinstance(groups, int):
            return self._leave(bn_kind, "the transposed conv's groups is computed in the graph")
        weight, bias = args["weight"], args["bias"]
        if not (isinstance(weight, Node) and weight.op == "get_attr"):
            return self._leave(bn_kind, "the conv weight is computed in the graph, not an attribute")
        if bias is not None and not (isinstance(bias, Node) and bias.op == "get_attr"):
            return self._leave(bn_kind, "the conv bias is computed in the graph, not an attribute")
        rank, w_rank = node_rank(conv), fetch_attr(self.gm, weight.target).dim()
        if rank is not None and rank != w_rank:
            return self._leave(bn_kind, f"the conv output has {rank} dims (unbatched?)")
        return weight, bias, 0, ("arg", "weight"), groups if transposed else None

    def _plan_linear(self, lin: Node, bn_kind: str):
        kind = _module_kind(lin, _op_name(lin))
        rank = self._rank(lin)
        if rank != 2:
            why = "its rank is unknown" if rank is None else f"it has {rank} dims"
            return self._leave(bn_kind, f"the {kind} output is not 2-D ({why}), so BatchNorm's channels are not its features")
        args = bind_op_args(lin)
        if lin.target == aten.linear.default:
            weight, bias, axis, where = args["weight"], args["bias"], 0, ("arg", "weight")
        else:
            if lin.target == aten.addmm.default and (args["beta"] != 1 or args["alpha"] != 1):
                return self._leave(bn_kind, f"the {kind} scales its terms (alpha/beta != 1)")
            bias = args["self"] if lin.target == aten.addmm.default else None
            mat2 = args["mat2"]
            if isinstance(mat2, Node) and mat2.op == "get_attr":
                weight, axis, where = mat2, 1, ("arg", "mat2")  # already (in, out)
            elif (isinstance(mat2, Node) and mat2.target in _PERMUTE_OPS and len(mat2.users) == 1
                  and isinstance(mat2.args[0], Node) and mat2.args[0].op == "get_attr"
                  and (mat2.target == aten.t.default or list(mat2.args[1]) == [1, 0])):
                weight, axis, where = mat2.args[0], 0, ("permute", mat2)  # (out, in), transposed in graph
            else:
                return self._leave(bn_kind, f"the {kind} weight is not a constant attribute")
        if not (isinstance(weight, Node) and weight.op == "get_attr"):
            return self._leave(bn_kind, f"the {kind} weight is computed in the graph, not an attribute")
        if bias is not None:
            if not (isinstance(bias, Node) and bias.op == "get_attr"):
                return self._leave(bn_kind, f"the {kind} bias is computed in the graph, not an attribute")
            if fetch_attr(self.gm, bias.target).dim() != 1:
                return self._leave(bn_kind, f"the {kind} bias is not a per-feature vector")
        return weight, bias, axis, where, None

    def _bind(
        self, old: Node | None, value: torch.Tensor, uses: dict[int, int], *, fallback_owner: str, before: Node
    ) -> Node:
        """A get_attr node holding `value`: rebinds `old`'s name when nothing else reads it."""
        gm = self.gm
        if old is not None:
            prefix, field = split_target(old.target)
            owner = gm.get_submodule(prefix) if prefix else gm
            current = fetch_attr(gm, old.target)
            if len(old.users) == 1 and uses.get(id(current), 0) == 1 and is_own_container(gm, owner):
                bind_tensor(owner, field, value, like=current)
                return old
            base = f"{field}_fused"
        else:  # a bias the layer did not have: next to the weight, `fc.bias` or `<root weight>_bias`
            prefix, weight_field = split_target(fallback_owner)
            owner = gm.get_submodule(prefix) if prefix else gm
            base = "bias" if prefix else f"{weight_field}_bias"
        if not is_own_container(gm, owner):
            # a module of the user's: the new tensor goes on the root, under a flat readable name
            flat = f"{old.target}_fused" if old is not None else f"{split_target(fallback_owner)[0]}.bias"
            owner, prefix, base = gm, "", flat.replace(".", "_")
        name = unique_name(owner, base)
        bind_tensor(owner, name, value)
        with gm.graph.inserting_before(before):
            node = gm.graph.get_attr(f"{prefix}.{name}" if prefix else name)
        if old is not None:
            node.meta.update(old.meta)
        return node

    # -- shared ---------------------------------------------------------------------------

    def _rank(self, node: Node) -> int | None:
        rank = node_rank(node)
        if rank is None and not self._shapes_known and self.ctx.example_inputs:
            self._shapes_known = True
            try:
                ShapeProp(self.gm).propagate(*self.ctx.example_inputs)
            except Exception:  # shapes are a safety check; without them we stay conservative
                pass
            rank = node_rank(node)
        return rank

    def _leave(self, bn_kind: str, reason: str) -> None:
        self.left[f"{bn_kind}: {reason}"] += 1
        return None

    def notes(self) -> str:
        parts = []
        if self.folded:
            parts.append("folded " + "; ".join(f"{n} {what}" for what, n in self.folded.items()))
        if self.left:
            parts.append(("Left " if parts else "left ") + "; ".join(f"{n} {what}" for what, n in self.left.items()))
        return ". ".join(parts) if parts else "no BatchNorm nodes"


@dataclass
class _BnTensors:
    """The tensors of an aten-level batch norm, shaped like nn.BatchNorm's attributes for `_fold`."""

    weight: torch.Tensor | None
    bias: torch.Tensor | None
    running_mean: torch.Tensor
    running_var: torch.Tensor
    eps: float


def _fold(weight: torch.Tensor, bias: torch.Tensor | None, bn, out_axis: int,
          transposed_groups: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights of `bn(layer(x))` as one layer: W·s along the output axis, (b − mean)·s + β.

    A transposed conv's weight is (in, out / groups, *kernel): output channel g·(out/groups) + j
    is column j of group g's rows, so `transposed_groups` scales it group by group on dim 1.
    Computed in float64 and cast back, so the fold adds no rounding beyond the final cast.
    """
    if transposed_groups is not None:
        g = transposed_groups
        rows, per_group, kernel = weight.shape[0], weight.shape[1], weight.shape[2:]
        grouped = weight.reshape(g, rows // g, per_group, *kernel).transpose(0, 1)  # (in/g, g, out/g, *k)
        new_w, new_b = _fold(grouped.reshape(rows // g, g * per_group, *kernel), bias, bn, out_axis=1)
        return new_w.reshape(rows // g, g, per_group, *kernel).transpose(0, 1).reshape(weight.shape), new_b
    dt = torch.float64
    mean, var = bn.running_mean.detach().to(dt), bn.running_var.detach().to(dt)
    gamma = bn.weight.detach().to(dt) if bn.weight is not None else torch.ones_like(mean)
    beta = bn.bias.detach().to(dt) if bn.bias is not None else torch.zeros_like(mean)
    scale = gamma * torch.rsqrt(var + bn.eps)
    shape = [1] * weight.dim()
    shape[out_axis] = -1
    new_w = weight.detach().to(dt) * scale.reshape(shape)
    b = bias.detach().to(dt) if bias is not None else torch.zeros_like(mean)
    new_b = (b - mean) * scale + beta
    bias_dtype = bias.dtype if bias is not None else weight.dtype
    return new_w.to(weight.dtype), new_b.to(bias_dtype)


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
    return gm.get_submodule(node.target)


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
        return f"{type(gm.get_submodule(node.target)).__name__} {node.target}"
    if node.op == "call_function":
        return _op_name(node) if hasattr(node.target, "_schema") else getattr(node.target, "__name__", str(node.target))
    return f"{node.op} {node.target}"
