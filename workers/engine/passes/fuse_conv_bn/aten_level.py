"""fuse_conv_bn at aten level (a torch.export graph): an eval batch-norm op folded into the aten conv,
linear, addmm, mm or bmm whose weight is a get_attr — the layer's weight and bias rewritten in
place as new tensors bound on the graph's own containers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
from torch.fx import Node

from fxport.workers.engine.passes import node_arg, target_name
from fxport.workers.engine.passes.fuse_conv_bn.fold import _BnTensors, _fold
from fxport.workers.engine.passes.fuse_conv_bn.fuser import _FuserBase
from fxport.workers.engine.passes.fuse_conv_bn.ops import (
    _BROADCAST_OPS,
    _CONV_OPS,
    _CONV_TRANSPOSE_OPS,
    _LINEAR_OPS,
    _PERMUTE_OPS,
    _bn_outputs,
    _describe,
    _is_attr,
    _is_bias_add,
    _module_kind,
    _op_label,
    _op_name,
    _Site,
    aten,
)
from fxport.workers.engine.passes.fuse_conv_bn.shapes import (
    _aten_channel_axes,
    _ends_with,
    _is_aten_shape_op,
    _layer_channel_axis,
    _Unproven,
)
from fxport.workers.engine.passes.graph_attrs import (
    bind_op_args,
    bind_tensor,
    fetch_attr,
    is_own_container,
    node_shape,
    set_op_arg,
    split_target,
    unique_name,
)


class AtenLevelFolds(_FuserBase):
    """The aten-level folds: the layer op keeps its place and gets the fused tensors."""

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

        w_user = weight_arg[1] if weight_arg[0] == "user" else layer
        new_w_node = self._bind(weight_node, new_w, fallback_owner=weight_node.target, before=w_user)
        if weight_arg[0] == "user":
            w_user.replace_input_with(weight_node, new_w_node)
        else:
            set_op_arg(layer, weight_arg[1], new_w_node)
        new_b_node = self._bind(bias_node, new_b, fallback_owner=weight_node.target, before=layer)
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
        self, old: Node | None, value: torch.Tensor, *, fallback_owner: str, before: Node
    ) -> Node:
        """A get_attr node holding `value`: rebinds `old`'s name when nothing else reads it."""
        gm, uses = self.gm, self.attr_uses()
        if old is not None:
            prefix, field = split_target(target_name(old))
            owner = gm.get_submodule(prefix) if prefix else gm
            current = fetch_attr(gm, target_name(old))
            if len(old.users) == 1 and uses.count(current) == 1 and is_own_container(gm, owner):
                bind_tensor(owner, field, value, like=current)
                uses.rebound(target_name(old))
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
        self.attr_added(node)
        if old is not None:
            node.meta.update(old.meta)
        return node
