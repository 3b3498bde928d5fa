"""Shape ops a batch norm may sit behind (issue 21), and the proof that they carry the layer's output
channels onto dim 1, the dim BatchNorm normalizes: at torch level from the ops' arguments
(`_torch_channel_axis`), at aten level from export's symbolic shapes (`_aten_channel_axes`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fxport.workers.engine.passes import node_arg, target_fn, target_name
from fxport.workers.engine.passes.fuse_conv_bn.ops import _hashable, aten
from fxport.workers.engine.passes.graph_attrs import node_shape

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


class _Unproven(Exception):
    """Why shape ops are not shown to carry a layer's output channels onto BatchNorm's dim 1."""


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
