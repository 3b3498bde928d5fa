"""fuse_conv_bn at torch level (a symbolic_trace graph): a call_module BatchNorm, or the F.batch_norm
timm's BatchNormAct2d traces to, folded into the call_module Conv/Linear that feeds it."""

from __future__ import annotations

import copy
from typing import cast

from torch import nn
from torch.fx import Node

from fxport.workers.engine.passes import target_name
from fxport.workers.engine.passes.fuse_conv_bn.fold import _BnTensors, _fold
from fxport.workers.engine.passes.fuse_conv_bn.fuser import _FuserBase
from fxport.workers.engine.passes.fuse_conv_bn.ops import (
    _F_BATCH_NORM_SIGNATURE,
    _LAYER_MODULES,
    _PLAIN_FORWARDS,
    _describe,
    _functional_kind,
    _is_attr,
    _module,
    _op_label,
    _Site,
)
from fxport.workers.engine.passes.fuse_conv_bn.shapes import (
    _layer_channel_axis,
    _torch_channel_axis,
    _torch_shape_op,
    _Unproven,
)
from fxport.workers.engine.passes.graph_attrs import fetch_attr, replace_submodule, split_target


class TorchLevelFolds(_FuserBase):
    """The torch-level folds: the fused layer replaces the module the graph calls."""

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
        if not isinstance(layer, _LAYER_MODULES):
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
        if self.module_calls(target_name(producer)) != 1:
            self._leave(site, f"the {kind} module is called more than once")
            return False
        if why := self._torch_channels_reach_bn(producer, layer, ops):
            self._leave(site, why)
            return False
        out_features = layer.out_features if isinstance(layer, nn.Linear) else layer.out_channels
        if out_features != features:
            self._leave(site, f"it has {features} features, its input {out_features}")
            return False
        if self.attrs_read_inside(target_name(producer)):
            self._leave(site, f"the {kind} parameters are also read elsewhere")
            return False
        transposed_groups = layer.groups if isinstance(layer, nn.modules.conv._ConvTransposeNd) else None
        weight, bias = _fold(layer.weight, layer.bias, bn, out_axis=0, transposed_groups=transposed_groups)
        fused = copy.deepcopy(layer)
        fused.weight = nn.Parameter(weight, requires_grad=False)
        fused.bias = nn.Parameter(bias, requires_grad=False)
        replace_submodule(gm, producer.target, fused)
        self.submodule_replaced()
        bn_node.replace_all_uses_with(ops[-1] if ops else producer)
        gm.graph.erase_node(bn_node)
        self.module_call_erased(bn_node)
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
