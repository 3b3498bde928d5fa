"""fuse_conv_bn: fold eval-mode BatchNorm into the Conv, ConvTranspose (or Linear) that feeds it.

The pass walks the graph once and hands each batch norm to its level's folds:

    ops.py          what the nodes are: the op tables, the batch norm's site, names for the notes
    fold.py         the arithmetic: a layer's weight and bias with the batch norm folded in
    shapes.py       shape ops between a layer and its batch norm, and the proof that they carry
                    the layer's output channels onto the batch norm's channel dim
    fuser.py        what every fold shares: the walk through shape ops, the bookkeeping, the notes
    torch_level.py  call_module / F.batch_norm batch norms (a symbolic_trace graph)
    aten_level.py   aten batch-norm ops (a torch.export graph): the layer's weights rewritten in place
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn
from torch.fx import GraphModule

from fxport.pass_catalog import FuseConvBnOptions
from fxport.workers.engine.passes import PassContext, PassResult
from fxport.workers.engine.passes.fuse_conv_bn.aten_level import AtenLevelFolds
from fxport.workers.engine.passes.fuse_conv_bn.ops import _BN_OPS, _erase_unused_bn_attrs, _module
from fxport.workers.engine.passes.fuse_conv_bn.torch_level import TorchLevelFolds
from fxport.workers.engine.passes.graph_attrs import erase_if_unused, prune_unused_attrs


class _Fuser(TorchLevelFolds, AtenLevelFolds):
    """Both levels' folds over one graph (a graph is at one level; the walk asks each node's)."""


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
