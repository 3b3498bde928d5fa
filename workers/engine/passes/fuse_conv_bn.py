"""fuse_conv_bn: fold eval-mode BatchNorm into the Conv, ConvTranspose (or Linear) that feeds it."""

from __future__ import annotations

import copy
import inspect
import math
import operator
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import GraphModule, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.fx.passes.shape_prop import ShapeProp

from fxport.spec import FuseConvBnOptions
from fxport.workers.engine.passes import PassContext, PassResult, node_arg, target_fn, target_name
from fxport.workers.engine.passes.graph_attrs import (
    bind_op_args,
    bind_tensor,
    erase_if_unused,
    fetch_attr,
    get_attr_users,
    is_own_container,
    node_rank,
    node_shape,
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
_LINEAR_OPS = {aten.linear.default, aten.addmm.default, aten.mm.default, aten.bmm.default}
# How decomposition broadcasts a Linear's weight over a 3-D input's batch for bmm.
_BROADCAST_OPS = {aten.expand.default, aten.view.default, aten._unsafe_view.default, aten.reshape.default}

# Shape ops a BatchNorm may sit behind (issue 21): timm's LeViT runs Linear → flatten(0, 1) →
# BatchNorm1d, token models Linear → transpose(1, 2) → BatchNorm1d. They move values without
# changing them, so the fold holds when they carry the layer's output channels onto dim 1, the
# dim BatchNorm normalizes — which `_aten_channel_axes` / `_torch_channel_axis` prove.
_ATEN_SQUEEZES = {aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims}
_ATEN_RESHAPES = {
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.flatten.using_ints,
    aten.unflatten.int, aten.unsqueeze.default, aten.view_as.default, aten.reshape_as.default, *_ATEN_SQUEEZES,
}
_ATEN_MOVES = {aten.permute.default, aten.transpose.int, aten.t.default}
_ATEN_IDENTITIES = {aten.clone.default, aten.contiguous.default, aten.alias.default}
_ATEN_SHAPE_OPS = _ATEN_RESHAPES | _ATEN_MOVES | _ATEN_IDENTITIES
# Torch level: one kind per op, whichever spelling (tensor method, torch function, module).
_TORCH_METHOD_KINDS = {
    "flatten": "flatten", "unflatten": "unflatten", "reshape": "reshape", "view": "reshape",
    "view_as": "reshape", "reshape_as": "reshape", "permute": "permute", "transpose": "transpose",
    "swapaxes": "transpose", "squeeze": "squeeze", "unsqueeze": "unsqueeze", "t": "t", "contiguous": "identity",
}
_TORCH_FUNCTION_KINDS: dict[Callable[..., Any], str] = {
    torch.flatten: "flatten", torch.unflatten: "unflatten", torch.reshape: "reshape", torch.permute: "permute",
    torch.transpose: "transpose", torch.swapaxes: "transpose", torch.squeeze: "squeeze",
    torch.unsqueeze: "unsqueeze", torch.t: "t",
}
_TORCH_DIM_PARAMS = {  # kind → (name, default) of each argument after the input
    "flatten": (("start_dim", 0), ("end_dim", -1)),
    "unflatten": (("dim", None), ("sizes", None)),
    "squeeze": (("dim", None),),
    "unsqueeze": (("dim", None),),
    "transpose": (("dim0", None), ("dim1", None)),
}
# Users that read only a tensor's shape (timm's `_assert(x.ndim == 4)`, LeViT's `.reshape_as(x)`):
# the fold changes values, never shapes, so they do not keep a layer from being fused.
_SHAPE_ATTRS = {"shape", "ndim", "dtype", "device"}
_SHAPE_METHODS = {"size", "dim", "numel"}
_SHAPE_TEMPLATES = {"view_as", "reshape_as", "expand_as",
                    aten.view_as.default, aten.reshape_as.default, aten.expand_as.default}
_SHAPE_QUERIES = {aten.sym_size.int, aten.sym_numel.default, aten.sym_stride.int, aten.sym_storage_offset.default}
_F_BATCH_NORM_SIGNATURE = inspect.signature(F.batch_norm)


def fuse_conv_bn(
    gm: GraphModule, opts: FuseConvBnOptions, ctx: PassContext, *, look_through: bool = True
) -> PassResult:
    """Conv → BatchNorm(eval) ⇒ one Conv; with `opts.linear`, Linear → BatchNorm1d ⇒ one Linear.

    Mutates `gm` in place: fused weights are new tensors bound on gm's own containers; the
    user's modules and tensors (which the graph shares) are never written.

    Torch level: call_module Conv{1,2,3}d (or Linear) → call_module BatchNorm, or → the
    `F.batch_norm(x, running_mean, running_var, weight, bias, False, …)` that timm's
    BatchNormAct2d traces to, its tensors get_attr nodes. Aten level: aten conv / linear /
    addmm / mm / bmm whose weight is a get_attr → an eval batch-norm op.
    Between the layer and the batch norm may sit shape ops (view, reshape, flatten, permute,
    transpose, [un]squeeze, …) that nothing else reads, when they provably carry the layer's
    output channels onto the batch norm's channel dim; the notes name those ops. With
    `look_through=False` only a batch norm right after its layer folds (the pass before
    issue 21 item 2, which bench/bench_fold_bn.py compares against).
    A BatchNorm is left alone, and the notes say why, when its producer has other users,
    is shared, is not a Conv/Linear, when the shape ops move its channels elsewhere, or
    when it uses batch statistics (training mode).
    """
    fuser = _Fuser(gm, opts, ctx, look_through=look_through)
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and isinstance(_module(gm, node), nn.modules.batchnorm._BatchNorm):
            fuser.torch_level(node)
        elif node.op == "call_function" and node.target in _BN_OPS:
            fuser.aten_level(node)
        elif node.op == "call_function" and node.target is F.batch_norm:
            fuser.torch_functional(node)
    changed = bool(fuser.folded)
    if changed:
        erase_if_unused(gm, fuser.maybe_dead)
        _erase_unused_bn_attrs(gm, fuser.bn_prefixes)
        prune_unused_attrs(gm)
        gm.graph.lint()
        gm.recompile()
    return PassResult(gm, changed, fuser.notes())


@dataclass(frozen=True)
class _Site:
    """The batch norm being looked at, as the notes name it: its class and where it lives."""

    kind: str  # "BatchNorm2d", "BatchNormAct2d (F.batch_norm)", "batch_norm"
    name: str  # "layer1.0.bn1"


class _Unproven(Exception):
    """Why shape ops are not shown to carry a layer's output channels onto BatchNorm's dim 1."""


class _Fuser:
    def __init__(self, gm: GraphModule, opts: FuseConvBnOptions, ctx: PassContext, *, look_through: bool) -> None:
        self.gm, self.opts, self.ctx = gm, opts, ctx
        self.look_through = look_through
        # "BatchNorm1d into Linear through flatten" → one entry per fold: "bn into fc" when shape
        # ops sat between them (the notes name those), "" for a plain fold (the notes count it)
        self.folded: dict[str, list[str]] = defaultdict(list)
        self.left: dict[str, list[str]] = defaultdict(list)  # "BatchNorm2d: reason" → batch norm names
        self.maybe_dead: list[Node] = []
        self.bn_prefixes: set[str] = set()
        self._shapes_known = False

    # -- torch level ----------------------------------------------------------------------

    def torch_level(self, bn_node: Node) -> None:
        # fuse_conv_bn calls this only for a call_module whose module is a _BatchNorm
        bn = cast(nn.modules.batchnorm._BatchNorm, _module(self.gm, bn_node))
        site = _Site(type(bn).__name__, target_name(bn_node))
        if type(bn).forward not in _PLAIN_FORWARDS:
            return self._leave(site, f"{type(bn).__name__} overrides forward, so the fold may not hold")
        if bn.training or bn.running_mean is None or bn.running_var is None:
            return self._leave(site, "it normalizes with batch statistics (training mode or no running stats)")
        src = bn_node.args[0] if bn_node.args else None
        self._fold_into_module(site, bn_node, src, bn, bn.num_features)

    def torch_functional(self, bn_node: Node) -> None:
        """`F.batch_norm` whose tensors are attributes, as timm's BatchNormAct2d traces (issue 23):
        with `training` a constant False it is an eval BatchNorm, folded like the module."""
        bound = _F_BATCH_NORM_SIGNATURE.bind(*bn_node.args, **bn_node.kwargs)
        bound.apply_defaults()
        args = bound.arguments
        stats = [args["running_mean"], args["running_var"]]
        owner = split_target(target_name(stats[0]))[0] if _is_attr(stats[0]) else ""
        site = _Site(_functional_kind(bn_node), owner or bn_node.name)
        if isinstance(args["training"], Node):
            return self._leave(site, "its training flag is computed in the graph, so it may use batch statistics")
        if args["training"]:
            return self._leave(site, "it normalizes with batch statistics (training=True)")
        if not all(_is_attr(s) for s in stats):
            return self._leave(site, "its running statistics are not constant attributes")
        for name in ("weight", "bias"):
            if args[name] is not None and not _is_attr(args[name]):
                return self._leave(site, f"its {name} is computed in the graph, not an attribute")
        if not isinstance(args["eps"], (int, float)):
            return self._leave(site, "its eps is computed in the graph")
        gm = self.gm
        bn = _BnTensors(
            weight=fetch_attr(gm, args["weight"].target) if args["weight"] is not None else None,
            bias=fetch_attr(gm, args["bias"].target) if args["bias"] is not None else None,
            running_mean=fetch_attr(gm, stats[0].target),
            running_var=fetch_attr(gm, stats[1].target),
            eps=float(args["eps"]),
        )
        if self._fold_into_module(site, bn_node, args["input"], bn, bn.running_mean.numel()):
            self.maybe_dead += [a for a in (args["weight"], args["bias"], *stats) if isinstance(a, Node)]
            if owner:
                self.bn_prefixes.add(owner)

    def _fold_into_module(self, site: _Site, bn_node: Node, src, bn, features: int) -> bool:
        """Fold `bn` into the call_module Conv/Linear that produces `src`, through shape ops."""
        gm = self.gm
        producer, ops = self._look_through(src, lambda n: _torch_shape_op(gm, n) is not None)
        layer = _module(gm, producer)
        if not isinstance(layer, (*_CONV_MODULES, nn.Linear)):
            self._leave(site, f"its input is not a Conv/Linear ({_describe(gm, producer)}{self._through(ops)})")
            return False
        kind = type(layer).__name__
        if type(layer).forward not in _PLAIN_FORWARDS:
            self._leave(site, f"{kind} overrides forward, so the fold may not hold")
            return False
        is_linear = isinstance(layer, nn.Linear)
        if is_linear and not self.opts.linear:
            self._leave(site, "it follows a Linear and options.linear is false")
            return False
        if why := self._other_readers(producer, ops, kind):
            self._leave(site, why)
            return False
        if sum(1 for n in gm.graph.nodes if n.op == "call_module" and n.target == producer.target) != 1:
            self._leave(site, f"the {kind} module is called more than once")
            return False
        if why := self._torch_channels_reach_bn(producer, layer, ops):
            self._leave(site, why)
            return False
        out_features = layer.out_features if isinstance(layer, nn.Linear) else layer.out_channels
        if out_features != features:
            self._leave(site, f"it has {features} features, its input {out_features}")
            return False
        if any(n.op == "get_attr" and n.target.startswith(producer.target + ".") for n in gm.graph.nodes):
            self._leave(site, f"the {kind} parameters are also read elsewhere")
            return False
        transposed_groups = layer.groups if isinstance(layer, nn.modules.conv._ConvTransposeNd) else None
        weight, bias = _fold(layer.weight, layer.bias, bn, out_axis=0, transposed_groups=transposed_groups)
        fused = copy.deepcopy(layer)
        fused.weight = nn.Parameter(weight, requires_grad=False)
        fused.bias = nn.Parameter(bias, requires_grad=False)
        replace_submodule(gm, producer.target, fused)
        bn_node.replace_all_uses_with(ops[-1] if ops else producer)
        gm.graph.erase_node(bn_node)
        self._record(site, kind, producer.target, ops)
        return True

    def _torch_channels_reach_bn(
        self, producer: Node, layer: nn.modules.conv._ConvNd | nn.Linear, ops: list[Node]
    ) -> str | None:
        """None when the layer's output channels are the batch norm's dim 1 for every input; else why not.

        Shapes here are the example's (ShapeProp), so only ranks are taken from them: each
        op's effect on the channel dim is worked out from its arguments (`_torch_channel_axis`).
        """
        is_linear = isinstance(layer, nn.Linear)
        rank = self._rank(producer)
        if not ops:
            if is_linear and rank != 2:
                why = "its rank is unknown without example inputs" if rank is None else f"it has {rank} dims"
                return f"the Linear output is not 2-D ({why}), so BatchNorm's channels are not its features"
            if not is_linear and rank is not None and rank != layer.weight.dim():  # Conv{k}d: k + 2 dims
                return f"the conv output has {rank} dims (unbatched?)"
            return None
        ranks = [rank, *(self._rank(op) for op in ops)]
        if None in ranks:
            return f"the shapes{self._through(ops)} are unknown without example inputs"
        assert rank is not None  # ranks[0], and no rank is None
        kind = type(layer).__name__
        axis = _layer_channel_axis(is_linear, rank, layer.weight.dim())
        channels = layer.out_features if isinstance(layer, nn.Linear) else layer.out_channels
        for op, rank_in, rank_out in zip(ops, ranks, ranks[1:]):
            assert rank_in is not None and rank_out is not None  # no rank is None
            shape_op = _torch_shape_op(self.gm, op)
            assert shape_op is not None  # `ops` are the nodes _torch_shape_op recognized
            op_kind, params = shape_op
            try:
                axis = _torch_channel_axis(op_kind, params, axis, rank_in, rank_out, channels)
            except _Unproven as why:
                return f"the {_op_label(self.gm, op)} after the {kind} {why}"
        return None if axis == 1 else self._moved(kind, ops, {axis})

    # -- aten level -----------------------------------------------------------------------

    def aten_level(self, bn_node: Node) -> None:
        bn_args = bind_op_args(bn_node)
        assert bn_args is not None  # the _BN_OPS are OpOverloads
        stats = [bn_args["running_mean"], bn_args["running_var"]]
        site = _Site(_module_kind(bn_node, "batch_norm"),
                     (split_target(target_name(stats[0]))[0] if _is_attr(stats[0]) else "") or bn_node.name)
        if bn_args.get("training", False):
            return self._leave(site, "it normalizes with batch statistics (exported in training mode)")
        if not all(_is_attr(s) for s in stats):
            return self._leave(site, "its running statistics are not constant attributes")
        for name in ("weight", "bias"):
            value = bn_args[name]
            if value is not None and not _is_attr(value):
                return self._leave(site, f"its {name} is computed in the graph, not an attribute")
        out_nodes = _bn_outputs(bn_node)
        if out_nodes is None:
            return self._leave(site, "its saved mean/invstd outputs are used")
        src, ops, bias_add = self._find_aten_layer(bn_args["input"])
        not_a_layer = f"its input is not a Conv/Linear ({_describe(self.gm, src)}{self._through(ops)})"
        if not isinstance(src, Node) or src.op != "call_function":
            return self._leave(site, not_a_layer)
        is_linear = src.target in _LINEAR_OPS
        if src.target in _CONV_OPS:
            plan = self._plan_conv(src, site)
        elif is_linear:
            if not self.opts.linear:
                return self._leave(site, "it follows a Linear and options.linear is false")
            is_bmm = src.target == aten.bmm.default
            plan = self._plan_bmm(src, bias_add, site) if is_bmm else self._plan_linear(src, site)
        else:
            return self._leave(site, not_a_layer)
        if plan is None:
            return
        kind = _module_kind(src, _op_name(src))
        if why := self._other_readers(src, ops, kind):
            return self._leave(site, why)
        weight_node = plan[0]
        weight_rank = fetch_attr(self.gm, weight_node.target).dim()
        if why := self._aten_channels_reach_bn(src, ops, kind, is_linear, weight_rank):
            return self._leave(site, why)

        bn = _BnTensors(
            weight=fetch_attr(self.gm, bn_args["weight"].target) if bn_args["weight"] is not None else None,
            bias=fetch_attr(self.gm, bn_args["bias"].target) if bn_args["bias"] is not None else None,
            running_mean=fetch_attr(self.gm, stats[0].target),
            running_var=fetch_attr(self.gm, stats[1].target),
            eps=float(bn_args["eps"]),
        )
        layer_out = self._rewrite_aten_layer(src, plan, bn, bias_add)
        bn_input = ops[-1] if ops else layer_out
        for out in out_nodes:
            out.replace_all_uses_with(bn_input)
        for out in out_nodes:
            if out is not bn_node:
                self.gm.graph.erase_node(out)
        self.gm.graph.erase_node(bn_node)
        self.maybe_dead += [a for a in (bn_args["weight"], bn_args["bias"], *stats) if isinstance(a, Node)]
        self.bn_prefixes.add(split_target(stats[0].target)[0])
        shape_ops = [op for op in ops if op is not bias_add]  # the bias add is part of the Linear
        self._record(site, kind, split_target(weight_node.target)[0] or src.name, shape_ops)

    def _find_aten_layer(self, bn_input) -> tuple[Any, list[Node], Node | None]:
        """(layer, shape ops after it, the bias add of a bmm Linear or None) behind a batch norm.

        A Linear over a 3-D input that is not contiguous decomposes to bmm → view → add(bias):
        that add belongs to the layer, so the search goes on past it to the bmm.
        """
        src, ops = self._look_through(bn_input, _is_aten_shape_op)
        if self.look_through and _is_bias_add(self.gm, src):
            layer, inner_ops = self._look_through(src.args[0], _is_aten_shape_op)
            if isinstance(layer, Node) and layer.target == aten.bmm.default:
                return layer, [*inner_ops, src, *ops], src
        return src, ops, None

    def _rewrite_aten_layer(self, layer: Node, plan, bn: _BnTensors, bias_add: Node | None) -> Node:
        """Put the fused weight and bias in `layer`'s place. Returns the node now carrying its output."""
        gm = self.gm
        weight_node, bias_node, weight_axis, weight_arg, transposed_groups = plan
        w = fetch_attr(gm, weight_node.target)
        b = fetch_attr(gm, bias_node.target) if bias_node is not None else None
        new_w, new_b = _fold(w, b, bn, out_axis=weight_axis, transposed_groups=transposed_groups)

        uses = get_attr_users(gm)
        w_user = weight_arg[1] if weight_arg[0] == "user" else layer
        new_w_node = self._bind(weight_node, new_w, uses, fallback_owner=weight_node.target, before=w_user)
        if weight_arg[0] == "user":
            w_user.replace_input_with(weight_node, new_w_node)
        else:
            set_op_arg(layer, weight_arg[1], new_w_node)
        new_b_node = self._bind(bias_node, new_b, uses, fallback_owner=weight_node.target, before=layer)
        self.maybe_dead += [n for n in (weight_node, bias_node) if n is not None]
        if layer.target == aten.mm.default:  # mm has no bias: becomes addmm(bias, x, w)
            layer.target = aten.addmm.default
            layer.args = (new_b_node, *layer.args)
            layer.kwargs = {}
        elif layer.target == aten.addmm.default:
            set_op_arg(layer, "self", new_b_node)
        elif layer.target == aten.bmm.default and bias_add is not None:
            bias_add.replace_input_with(bias_node, new_b_node)
        elif layer.target == aten.bmm.default:  # a Linear without bias: add one after the bmm
            with gm.graph.inserting_after(layer):
                add = gm.graph.call_function(aten.add.Tensor, (layer, new_b_node))
            layer.replace_all_uses_with(add, delete_user_cb=lambda user: user is not add)
            add.meta.update({k: v for k, v in layer.meta.items() if k in ("val", "tensor_meta", "nn_module_stack")})
            return add
        else:
            set_op_arg(layer, "bias", new_b_node)
        return layer

    def _plan_conv(self, conv: Node, site: _Site):
        args = bind_op_args(conv)
        assert args is not None  # the _CONV_OPS are OpOverloads
        transposed = bool(args.get("transposed", False)) or conv.target in _CONV_TRANSPOSE_OPS
        groups = args.get("groups", 1)
        if transposed and not isinstance(groups, int):
            return self._leave(site, "the transposed conv's groups is computed in the graph")
        weight, bias = args["weight"], args["bias"]
        if not _is_attr(weight):
            return self._leave(site, "the conv weight is computed in the graph, not an attribute")
        if bias is not None and not _is_attr(bias):
            return self._leave(site, "the conv bias is computed in the graph, not an attribute")
        return weight, bias, 0, ("arg", "weight"), groups if transposed else None

    def _plan_linear(self, lin: Node, site: _Site):
        kind = _module_kind(lin, _op_name(lin))
        args = bind_op_args(lin)
        assert args is not None  # the _LINEAR_OPS are OpOverloads
        where: tuple[str, str | Node]
        if lin.target == aten.linear.default:
            weight, bias, axis, where = args["weight"], args["bias"], 0, ("arg", "weight")
        else:
            if lin.target == aten.addmm.default and (args["beta"] != 1 or args["alpha"] != 1):
                return self._leave(site, f"the {kind} scales its terms (alpha/beta != 1)")
            bias = args["self"] if lin.target == aten.addmm.default else None
            mat2 = args["mat2"]
            if _is_attr(mat2):
                weight, axis, where = mat2, 1, ("arg", "mat2")  # already (in, out)
            elif (isinstance(mat2, Node) and mat2.target in _PERMUTE_OPS and len(mat2.users) == 1
                  and _is_attr(mat2.args[0])
                  and (mat2.target == aten.t.default or list(cast("Sequence[int]", mat2.args[1])) == [1, 0])):
                weight, axis, where = mat2.args[0], 0, ("user", mat2)  # (out, in), transposed in graph
            else:
                return self._leave(site, f"the {kind} weight is not a constant attribute")
        if not _is_attr(weight):
            return self._leave(site, f"the {kind} weight is computed in the graph, not an attribute")
        if bias is not None:
            if not _is_attr(bias):
                return self._leave(site, f"the {kind} bias is computed in the graph, not an attribute")
            if fetch_attr(self.gm, target_name(bias)).dim() != 1:
                return self._leave(site, f"the {kind} bias is not a per-feature vector")
        return weight, bias, axis, where, None

    def _plan_bmm(self, bmm: Node, bias_add: Node | None, site: _Site):
        """A Linear that decomposition spelled bmm(x, expand(wᵀ)): its weight is a constant matrix
        broadcast over the batch, which the chain from the get_attr to the bmm must show."""
        kind = _module_kind(bmm, "bmm")
        node, chain = bmm.args[1], cast("list[Node]", [])
        while isinstance(node, Node) and node.target in _BROADCAST_OPS and len(node.users) == 1:
            chain.append(node)
            node = node.args[0]
        if (isinstance(node, Node) and node.target in _PERMUTE_OPS and len(node.users) == 1 and _is_attr(node.args[0])
                and (node.target == aten.t.default or list(cast("Sequence[int]", node.args[1])) == [1, 0])):
            weight, axis, user = node.args[0], 0, node  # (out, in), transposed in graph
        elif _is_attr(node) and chain:
            weight, axis, user = node, 1, chain[-1]  # already (in, out)
        else:  # attention's q @ k, say
            return self._leave(site, f"its input is not a Conv/Linear ({kind} of computed tensors)")
        matrix = node_shape(node)
        broadcast = [*chain, *(node_arg(c, 0) for c in chain)]  # each op and its input: (…, in, out)
        if matrix is None or len(matrix) != 2 or not all(_ends_with(n, matrix) for n in broadcast):
            return self._leave(site, f"the {kind} weight is not one matrix broadcast over the batch")
        bias = node_arg(bias_add, 1) if bias_add is not None else None  # a get_attr (`_is_bias_add`)
        if bias is not None and fetch_attr(self.gm, target_name(bias)).shape != (matrix[1],):
            return self._leave(site, f"the {kind} bias is not a per-feature vector")
        return weight, bias, axis, ("user", user), None

    def _aten_channels_reach_bn(self, layer: Node, ops: list[Node], kind: str, is_linear: bool,
                                weight_rank: int) -> str | None:
        """None when the layer's output channels are the batch norm's dim 1 for every input; else why not.

        Export's shapes are symbolic and hold for every input the program accepts, so the
        shape ops are followed by comparing sizes (`_aten_channel_axes`).
        """
        rank = self._rank(layer)
        if not ops:
            if is_linear and rank != 2:
                why = "its rank is unknown" if rank is None else f"it has {rank} dims"
                return f"the {kind} output is not 2-D ({why}), so BatchNorm's channels are not its features"
            if not is_linear and rank is not None and rank != weight_rank:
                return f"the conv output has {rank} dims (unbatched?)"
            return None
        if rank is None:
            return f"the {kind} output has no shape metadata"
        axes = {_layer_channel_axis(is_linear, rank, weight_rank)}
        for op in ops:
            try:
                axes = _aten_channel_axes(op, axes)
            except _Unproven as why:
                return f"the {_op_label(self.gm, op)} after the {kind} {why}"
        return None if 1 in axes else self._moved(kind, ops, axes)

    def _bind(
        self, old: Node | None, value: torch.Tensor, uses: dict[int, int], *, fallback_owner: str, before: Node
    ) -> Node:
        """A get_attr node holding `value`: rebinds `old`'s name when nothing else reads it."""
        gm = self.gm
        if old is not None:
            prefix, field = split_target(target_name(old))
            owner = gm.get_submodule(prefix) if prefix else gm
            current = fetch_attr(gm, target_name(old))
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

    def _look_through(self, src, is_shape_op) -> tuple[Any, list[Node]]:
        """The node behind `src` and the shape ops passed on the way, in graph order."""
        ops: list[Node] = []
        while self.look_through and isinstance(src, Node) and is_shape_op(src):
            ops.append(src)
            src = src.args[0]
        return src, ops[::-1]

    def _other_readers(self, layer: Node, ops: list[Node], kind: str) -> str | None:
        """Why the fold would change what another node reads: the layer's output, or a shape
        op's between it and the batch norm, has a user besides the next one that reads values."""
        labels = [kind, *(_op_label(self.gm, op) for op in ops)]
        for node, label in zip([layer, *ops], labels):
            readers = [u for u in node.users if not _reads_only_shape(u, node)]
            if len(readers) != 1:
                return f"the {label} output has {len(readers)} users"
        return None

    def _through(self, ops: list[Node]) -> str:
        """` through flatten`: the shape ops between a layer and its batch norm, for notes."""
        if not ops:
            return ""
        return " through " + "+".join(dict.fromkeys(_op_label(self.gm, op) for op in ops))

    def _moved(self, kind: str, ops: list[Node], axes: set[int]) -> str:
        where = ", ".join(str(a) for a in sorted(axes)) or "no dim"
        return (f"{self._through(ops).strip()} the {kind}'s output channels land on dim {where}, "
                "but BatchNorm normalizes dim 1")

    def _record(self, site: _Site, kind: str, layer_name: str, ops: list[Node]) -> None:
        self.folded[f"{site.kind} into {kind}{self._through(ops)}"].append(
            f"{site.name} into {layer_name}" if ops else "")

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

    def _leave(self, site: _Site, reason: str) -> None:
        self.left[f"{site.kind}: {reason}"].append(site.name)
        return None

    def notes(self) -> str:
        """Counts, and names where they help: `folded 5 BatchNorm2d into Conv2d; 2 BatchNorm1d into
        Linear through flatten (bn1 into fc1, bn2 into fc2). Left 1 BatchNorm2d: the Conv2d output
        has 2 users (bn)`. A plain fold is only counted: it is what the pass is expected to do."""
        def entries(groups: dict[str, list[str]]) -> str:
            return "; ".join(f"{len(names)} {what}{_named(names)}" for what, names in groups.items())

        parts = []
        if self.folded:
            parts.append("folded " + entries(self.folded))
        if self.left:
            parts.append(("Left " if parts else "left ") + entries(self.left))
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


def _reads_only_shape(user: Node, node: Node) -> bool:
    """True when `user` reads only `node`'s shape, dtype or device, which a fold leaves as they are."""
    if user.op not in ("call_method", "call_function") or not _hashable(user.target):
        return False
    if user.target is getattr:
        return user.args[1] in _SHAPE_ATTRS
    if user.target in _SHAPE_METHODS and user.op == "call_method" or user.target in _SHAPE_QUERIES:
        return True
    if user.target in _SHAPE_TEMPLATES:
        return user.args[0] is not node  # `y.reshape_as(node)`: node lends only its shape
    return False


def _is_bias_add(gm: GraphModule, node) -> bool:
    """`add(x, bias)` with a 1-D constant `bias`: how decomposition adds a Linear's bias after a bmm."""
    return (isinstance(node, Node) and node.op == "call_function" and node.target == aten.add.Tensor
            and len(node.args) == 2 and not node.kwargs and isinstance(node.args[0], Node)
            and _is_attr(node.args[1]) and fetch_attr(gm, target_name(node_arg(node, 1))).dim() == 1)


def _ends_with(node: Node, matrix: tuple) -> bool:
    """Whether node's shape ends with the two sizes of `matrix` (for every input)."""
    shape = node_shape(node)
    return (shape is not None and len(shape) >= 2
            and _known_equal(shape[-2], matrix[0]) and _known_equal(shape[-1], matrix[1]))


def _is_aten_shape_op(node: Node) -> bool:
    return (node.op == "call_function" and node.target in _ATEN_SHAPE_OPS
            and bool(node.args) and isinstance(node.args[0], Node))


def _torch_shape_op(gm: GraphModule, node: Node) -> tuple[str, tuple] | None:
    """A torch-level shape op as (kind, arguments after the input), whatever its spelling:
    `x.flatten(0, 1)`, `torch.flatten(x, 0, 1)`, `nn.Flatten(0, 1)`. None for anything else."""
    if node.op == "call_module":
        mod = gm.get_submodule(target_name(node))
        if type(mod) is nn.Flatten:
            return "flatten", (mod.start_dim, mod.end_dim)
        if type(mod) is nn.Unflatten:
            return "unflatten", (mod.dim, tuple(mod.unflattened_size))
        if type(mod) is nn.Identity:
            return "identity", ()
        return None
    if node.op == "call_method":
        kind = _TORCH_METHOD_KINDS.get(target_name(node))
    elif node.op == "call_function":
        kind = _TORCH_FUNCTION_KINDS.get(target_fn(node)) if _hashable(node.target) else None
    else:
        return None
    if kind is None or not node.args or not isinstance(node.args[0], Node):
        return None
    rest, kwargs = node.args[1:], node.kwargs
    if node.target in ("view_as", "reshape_as"):
        return kind, (None,)  # the shape comes from another tensor
    if kind in ("permute", "reshape"):  # x.permute(0, 2, 1), x.permute((0, 2, 1)), torch.permute(x, dims=...)
        sizes: Any = rest[0] if len(rest) == 1 and isinstance(rest[0], (tuple, list)) else rest
        if not sizes:
            sizes = kwargs.get("dims", kwargs.get("shape", kwargs.get("size", ())))
        return kind, (tuple(sizes),)
    params = _TORCH_DIM_PARAMS.get(kind, ())
    return kind, tuple(rest[i] if i < len(rest) else kwargs.get(name, default)
                       for i, (name, default) in enumerate(params))


def _hashable(target) -> bool:
    try:
        hash(target)
    except TypeError:
        return False
    return True


def _layer_channel_axis(is_linear: bool, rank: int, weight_rank: int) -> int:
    """Where a layer's output channels are: a Linear's last dim; a conv's dim 1 (0 when unbatched)."""
    if is_linear:
        return rank - 1
    return 1 if rank == weight_rank else 0


def _dim(d, rank: int) -> int:
    """`d` as a dim in 0..rank-1, or _Unproven when it is not a constant in range."""
    if not isinstance(d, int) or isinstance(d, bool) or not -rank <= d < rank:
        raise _Unproven(f"takes dim {d} that is not a constant dim of its input")
    return d % rank


def _torch_channel_axis(kind: str, params: tuple, axis: int, rank_in: int, rank_out: int, channels: int) -> int:
    """Where the channels at `axis` are after one torch-level shape op — for every input shape.

    A torch-level graph knows only the example's sizes, so this works from the op's arguments:
    flatten / unflatten / [un]squeeze / permute / transpose by dims. A view or reshape moves
    values by shape, which is shown for every input only when the channels are the last dim
    before and after, with the literal size: then element i has channel i mod C on both sides.
    """
    if kind == "identity":
        return axis
    if kind == "flatten":
        start, end = _dim(params[0], rank_in), _dim(params[1], rank_in)
        if axis < start or axis > end:
            return axis if axis < start else axis - (end - start)
        raise _Unproven("merges the channel dim with others (harmless only where they are 1, which export can prove)")
    if kind == "unflatten":
        d = _dim(params[0], rank_in)
        if d == axis:
            raise _Unproven("splits the channel dim")
        return axis + (rank_out - rank_in) if d < axis else axis
    if kind == "unsqueeze":
        return axis + 1 if _dim(params[0], rank_in + 1) <= axis else axis
    if kind == "squeeze":
        dims = params[0] if isinstance(params[0], (tuple, list)) else (params[0],)
        if params[0] is None or any(_dim(d, rank_in) <= axis for d in dims):
            raise _Unproven("may drop a dim at or before the channels, depending on the input's shape")
        return axis
    if kind in ("permute", "transpose", "t"):
        return _permutation(kind, params, rank_in).index(axis)
    shape = params[0]  # view / reshape
    if axis == rank_in - 1 and shape and type(shape[-1]) is int and shape[-1] == channels:
        return rank_out - 1
    raise _Unproven("moves the channels by shape, which a torch-level graph proves only when they stay "
                    f"the last dim, of literal size {channels}; capture with export to prove this one")


def _permutation(kind: str, params: tuple, rank: int) -> list[int]:
    """The dims of a permute / transpose / t output, as dims of its input."""
    if kind == "permute":
        perm = [_dim(d, rank) for d in params[0]]
    elif kind == "transpose":
        a, b = _dim(params[0], rank), _dim(params[1], rank)
        perm = list(range(rank))
        perm[a], perm[b] = b, a
    else:  # t: swaps a matrix's dims, leaves a vector as it is
        perm = list(range(rank))[::-1] if rank == 2 else list(range(rank))
    if sorted(perm) != list(range(rank)):
        raise _Unproven(f"takes dims {perm} that are not a permutation of its input's")
    return perm


def _aten_channel_axes(op: Node, axes: set[int]) -> set[int]:
    """Where the channels at `axes` of op's input are in its output, from export's symbolic shapes.

    A reshape keeps row-major order, so element i has channel (i // inner) mod C, with inner
    the product of the sizes after the channel dim: the channels land on each output dim of
    size C with the same inner product. Sizes are compared only when export can prove them
    equal for every input, so a dynamic dim never passes by a coincidence of the example.
    (A set: with one channel, any size-1 dim carries it.)
    """
    if not all(isinstance(n.meta.get("val"), torch.Tensor) for n in (op, node_arg(op, 0))):
        raise _Unproven("has no shape metadata from export")  # ShapeProp's sizes are the example's only
    src_shape, out_shape = node_shape(node_arg(op, 0)), node_shape(op)
    assert src_shape is not None and out_shape is not None  # both carry a tensor "val"

    if op.target in _ATEN_IDENTITIES:
        return axes
    if op.target == aten.add.Tensor:  # a bmm Linear's bias (`_find_aten_layer`): broadcast on the last dim
        same_shape = len(out_shape) == len(src_shape) and all(map(_known_equal, out_shape, src_shape))
        if len(src_shape) - 1 not in axes or not same_shape:
            raise _Unproven("adds its bias along a dim that is not the Linear's output features")
        return {len(src_shape) - 1}
    if op.target in _ATEN_MOVES:
        kind = {aten.permute.default: "permute", aten.transpose.int: "transpose", aten.t.default: "t"}[op.target]
        perm = _permutation(kind, tuple(op.args[1:]), len(src_shape))
        return {perm.index(a) for a in axes}
    if op.target in _ATEN_SQUEEZES:
        dims = range(len(src_shape)) if op.target == aten.squeeze.default else (
            op.args[1] if isinstance(op.args[1], (tuple, list)) else [op.args[1]])
        size = [src_shape[_dim(d, len(src_shape))] for d in dims]
        if not all(_known_equal(s, 1) or _known_unequal(s, 1) for s in size):
            raise _Unproven("drops a dim that is 1 for some inputs only")
    found = set()
    for a in axes:
        inner = math.prod(src_shape[a + 1:])
        found |= {d for d in range(len(out_shape))
                  if _known_equal(out_shape[d], src_shape[a]) and _known_equal(math.prod(out_shape[d + 1:]), inner)}
    if not found:
        raise _Unproven("merges or splits the channel dim")
    return found


def _known_equal(a, b) -> bool:
    """a == b for every input: plain ints, or export's SymInts where its shape environment proves it."""
    return bool(statically_known_true(a == b))


def _known_unequal(a, b) -> bool:
    return bool(statically_known_true(a != b))
