"""Attributes of a GraphModule (parameters, buffers, submodules): look up, rebind, prune.

Why the care: the leaf modules of a torch-level graph (`symbolic_trace`) and every tensor of
an aten-level graph (`ep.module()`) are the *same objects* as in the user's model, which the
verify stage later runs as the reference. Passes therefore never write into a tensor or a
leaf module; they rebind names on the containers the GraphModule created for itself (plain
`torch.nn.Module` instances, or the GraphModule root), which the user's model never sees.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch.fx import GraphModule, Node


def split_target(target: str) -> tuple[str, str]:
    """`"layer1.0.conv.weight"` → `("layer1.0.conv", "weight")`."""
    prefix, _, field = target.rpartition(".")
    return prefix, field


def fetch_attr(gm: torch.nn.Module, target: str) -> Any:
    """The object a `get_attr` / `call_module` target names."""
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def is_own_container(gm: GraphModule, module: torch.nn.Module) -> bool:
    """True for modules the GraphModule made itself: the root and plain `nn.Module` holders.

    The user's own modules are always a subclass (a plain `nn.Module` has no forward, so it is
    never a leaf that a graph calls), so editing an exact `nn.Module` cannot reach them.
    """
    return module is gm or type(module) is torch.nn.Module


def unique_name(owner: torch.nn.Module, base: str) -> str:
    """`base`, or `base_1`, `base_2`, … — the first name `owner` does not have yet."""
    name, i = base, 0
    while hasattr(owner, name):
        i += 1
        name = f"{base}_{i}"
    return name


def bind_tensor(owner: torch.nn.Module, name: str, value: torch.Tensor, *, like: Any = None) -> None:
    """Set `owner.name = value`: a Parameter when the old value `like` was one or is absent, else a buffer."""
    as_param = like is None or isinstance(like, torch.nn.Parameter)
    # whatever `name` was before (parameter, buffer, or a plain tensor constant) gives way
    owner._parameters.pop(name, None)
    owner._buffers.pop(name, None)
    owner.__dict__.pop(name, None)
    if as_param:
        owner.register_parameter(name, torch.nn.Parameter(value.detach(), requires_grad=False))
    else:
        owner.register_buffer(name, value.detach())


def replace_submodule(gm: GraphModule, target: str, module: torch.nn.Module) -> None:
    """Rebind the submodule at `target` (its parent must be one of gm's own containers)."""
    prefix, field = split_target(target)
    parent = gm.get_submodule(prefix) if prefix else gm
    if not is_own_container(gm, parent):
        raise RuntimeError(f"refusing to edit {prefix!r}: it is a module of the user's model, not of the graph")
    setattr(parent, field, module)


class AttrUses:
    """How many graph uses a tensor has across all `get_attr` nodes (aliases included), kept
    current while a pass rewrites: one scan of the graph per pass, not one per question.

    The scan indexes every get_attr node by the tensor it fetches and by its target; a count
    sums the users of the indexed nodes that are alive and still fetch that tensor, so edits
    to users need no bookkeeping. A pass tells it only what re-points nodes: a new get_attr
    node (`added`) and a name bound to another tensor (`rebound`).
    """

    def __init__(self, gm: GraphModule) -> None:
        self.gm = gm
        self._by_tensor: dict[int, dict[Node, None]] = {}
        self._by_target: dict[str, dict[Node, None]] = {}
        for node in gm.graph.nodes:
            if node.op == "get_attr":
                self.added(node)

    def added(self, node: Node) -> None:
        """Index `node`, a get_attr node new to the graph (or one whose target now holds another tensor)."""
        self._by_target.setdefault(str(node.target), {})[node] = None
        value = self._fetch(node)
        if value is not None:
            self._by_tensor.setdefault(id(value), {})[node] = None

    def rebound(self, target: str) -> None:
        """The attribute at `target` now holds another tensor: re-index the nodes that fetch it."""
        for node in list(self._by_target.get(target, ())):
            self.added(node)

    def count(self, value: Any) -> int:
        """How many users the get_attr nodes fetching `value` have, together."""
        nodes = self._by_tensor.get(id(value), {})
        return sum(len(n.users) for n in nodes if _alive(n) and n.graph is self.gm.graph and self._fetch(n) is value)

    def _fetch(self, node: Node) -> Any:
        try:
            return fetch_attr(self.gm, str(node.target))
        except AttributeError:
            return None


def erase_if_unused(gm: GraphModule, nodes: list[Node]) -> int:
    """Erase those of `nodes` that have no users any more (pure nodes only). Returns how many."""
    erased = 0
    for node in reversed(list(dict.fromkeys(nodes))):
        if node.graph is gm.graph and not node.users and not node.is_impure() and _alive(node):
            gm.graph.erase_node(node)
            erased += 1
    return erased


def _alive(node: Node) -> bool:
    return not getattr(node, "_erased", False)


def prune_unused_attrs(gm: GraphModule) -> list[str]:
    """Drop submodules, parameters and buffers nothing in the graph refers to any more.

    Only removes names from gm's own containers (see `is_own_container`); a parameter of a
    leaf module that a `call_module` node still calls is in use by definition.
    Returns the qualified names removed.
    """
    used: set[str] = set()
    for node in gm.graph.nodes:
        if node.op in ("get_attr", "call_module"):
            used.add(node.target)
    # every ancestor (and self) of a used name: those names hold something in use
    holders = {".".join(name.split(".")[:i]) for name in used for i in range(1, name.count(".") + 2)}

    def in_use(qualname: str) -> bool:
        if qualname in holders:
            return True  # it is used, or something inside it is
        parts = qualname.split(".")
        return any(".".join(parts[:i]) in used for i in range(1, len(parts)))  # an ancestor is used whole

    removed: list[str] = []
    tensors = [n for n, _ in gm.named_parameters(remove_duplicate=False)]
    tensors += [n for n, _ in gm.named_buffers(remove_duplicate=False)]
    for qualname in tensors:
        if in_use(qualname):
            continue
        prefix, field = split_target(qualname)
        owner = gm.get_submodule(prefix) if prefix else gm
        if not is_own_container(gm, owner):
            continue
        owner._parameters.pop(field, None)
        owner._buffers.pop(field, None)
        owner._non_persistent_buffers_set.discard(field)
        removed.append(qualname)

    # Submodules nothing refers to (nor to anything inside them), deepest first.
    names = [n for n, _ in gm.named_modules(remove_duplicate=False) if n]
    for qualname in sorted(names, key=lambda n: -n.count(".")):
        if in_use(qualname):
            continue
        prefix, field = split_target(qualname)
        try:
            parent = gm.get_submodule(prefix) if prefix else gm
        except AttributeError:
            continue  # an ancestor was removed already
        if not is_own_container(gm, parent) or field not in parent._modules:
            continue
        del parent._modules[field]
        removed.append(qualname)
    return removed


def node_rank(node: Node) -> int | None:
    """Rank of a node's tensor result from its metadata (`val` from export, `tensor_meta` from ShapeProp)."""
    shape = node_shape(node)
    return len(shape) if shape is not None else None


def node_shape(node: Node) -> tuple[Any, ...] | None:
    """Shape of a node's tensor result from its metadata, None when unknown.

    From export (`val`) the sizes are symbolic (`torch.SymInt` for a dynamic dim) and hold for
    every input the program accepts; from ShapeProp (`tensor_meta`) they are the example's ints.
    """
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return tuple(val.shape)
    shape = getattr(node.meta.get("tensor_meta"), "shape", None)
    return tuple(shape) if shape is not None else None


def bind_op_args(node: Node) -> dict[str, Any] | None:
    """An aten OpOverload node's arguments by schema name, defaults filled. None if not an OpOverload."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return None
    out: dict[str, Any] = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(node.args):
            out[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            out[arg.name] = node.kwargs[arg.name]
        elif arg.has_default_value():
            out[arg.name] = arg.default_value
        else:
            out[arg.name] = None
    return out


def set_op_arg(node: Node, name: str, value: Any) -> None:
    """Set an aten node's argument `name` (by schema), positional if it already is, else as a kwarg."""
    names = [a.name for a in cast(Any, node.target)._schema.arguments]  # an OpOverload: FX types target broadly
    index = names.index(name)
    if index < len(node.args):
        args = list(node.args)
        args[index] = value
        node.args = tuple(args)
    elif index == len(node.args) and name not in node.kwargs:
        node.args = (*node.args, value)
    else:
        kwargs = dict(node.kwargs)
        kwargs[name] = value
        node.kwargs = kwargs
