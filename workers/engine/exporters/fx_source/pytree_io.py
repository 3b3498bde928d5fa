"""Graphs whose inputs and outputs go through pytrees: torch.export's own module (`ep.module()`).

Its graph takes flat tensors, but its code does not: FX's `_PyTreeCodeGen` writes a forward() that
flattens the caller's arguments by the program's `in_spec` and builds its result from the graph's
outputs by `out_spec` (tuples, dicts, nested containers, a registered class), and the module calls
a `_guards_fn` submodule torch.export made from generated code, to check the input sizes.

`plain_io` makes that writable:
- the `_guards_fn` call goes (its code exists only as a function object; the artifact carries no
  ranges, as a re-traced graph's or a TorchScript archive's does not: the manifest says so);
- where every input is a tensor (positional or keyword) and the outputs nest only tuples, lists,
  dicts and None, the graph becomes a plain one: forward() takes the tensors positionally, as the
  exported module does, and returns the structure built in the graph (`return {'logits': x, ...}`);
- otherwise the pytree codegen stays, and module.py gets the two specs written out as Python
  (`spec_source`): forward() flattens and unflattens exactly as torch.export's module does.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import CodeGen, Graph, GraphModule
from torch.utils import _pytree as pytree

from fxport.errors import ConversionFailed
from fxport.workers.engine.exporters.fx_source.common import _HINT, _describe, _literal, _NotLiteral

_GUARDS_MODULE = "_guards_fn"  # torch.export's input checks, in an `ep.module()` not traced again
_PLAIN_CONTAINERS = (tuple, list, dict, type(None))  # outputs FX writes as Python displays
_SPEC_LINE = 100  # a spec's source longer than this is written one child per line


@dataclass(frozen=True)
class PytreeIO:
    """The specs module.py writes out, for a graph that keeps its pytree codegen."""

    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec


def plain_io(gm: GraphModule) -> tuple[GraphModule, PytreeIO | None]:
    """`gm` itself when its code is plain; else a copy without torch.export's guard call, in plain
    code where its inputs and outputs allow (None), else keeping the pytree code (its specs).
    Raises ConversionFailed for another code generator."""
    codegen = gm.graph._codegen
    if type(codegen) is CodeGen:
        return gm, None
    info = getattr(codegen, "pytree_info", None)
    if not isinstance(codegen, torch.fx.graph._PyTreeCodeGen) or info is None:
        raise ConversionFailed(
            f"fx_source: the graph's code is written by {_describe(type(codegen))}, which fxport cannot write as "
            "module source (it handles FX's plain and pytree code generators)", stage="export",
            hint=f"capture the model again (spec `capture: export`), or upload the .pt2 torch.export wrote; or {_HINT}")
    graph = Graph()
    flat = graph.graph_copy(gm.graph, {})
    for node in [n for n in graph.nodes if n.op == "call_module" and n.target == _GUARDS_MODULE]:
        graph.erase_node(node)
    leaves = list(flat) if isinstance(flat, (list, tuple)) else [flat]
    if _flat_inputs(info.in_spec) and (info.out_spec is None or _plain_structure(info.out_spec)):
        graph.output(flat if info.out_spec is None else pytree.tree_unflatten(leaves, info.out_spec))
        graph.lint()
        return GraphModule(gm, graph, gm.__class__.__name__), None
    graph.output(flat)
    graph._codegen = codegen  # keeps writing forward() by the specs
    graph.lint()
    out_spec = info.out_spec if info.out_spec is not None else pytree.tree_structure(leaves)
    copy = GraphModule(gm, graph, gm.__class__.__name__)
    copy._in_spec, copy._out_spec = info.in_spec, out_spec  # what its code reads, as ep.module() has them
    return copy, PytreeIO(info.in_spec, out_spec)


def _flat_inputs(in_spec: pytree.TreeSpec | None) -> bool:
    """Every input a leaf: the (args, kwargs) spec of tensors passed by position or by keyword."""
    if in_spec is None:
        return True
    if in_spec.type is tuple and in_spec.num_children == 2 and in_spec.child(1).type is dict:
        children = [*in_spec.child(0).children(), *in_spec.child(1).children()]
        return in_spec.child(0).type is tuple and all(c.is_leaf() for c in children)
    return all(c.is_leaf() for c in in_spec.children())


def _plain_structure(spec: pytree.TreeSpec) -> bool:
    """Only tuples, lists, dicts with str or int keys, and None: what a Python display writes."""
    if spec.is_leaf():
        return True
    if spec.type not in _PLAIN_CONTAINERS:
        return False
    if spec.type is dict and not all(isinstance(k, (str, int)) for k in spec.context):
        return False
    return all(_plain_structure(c) for c in spec.children())


class SpecWriter:
    """The Python source of TreeSpecs, for module.py: `TreeSpec(dict, ['logits', 'cache'], [LEAF, ...])`.

    `bind(name, obj, user)` binds a name module.py must define (an import line, by _ModuleGlobals'
    rules): the pytree names themselves and every class a spec holds (a namedtuple, a registered
    container). A context that is neither a class nor a literal fails the export naming where."""

    def __init__(self, bind: Any) -> None:
        self.bind = bind
        self.registered: dict[str, type] = {}  # name -> a class pytree knows only by registration

    def source(self, spec: pytree.TreeSpec, what: str) -> str:
        self.bind("TreeSpec", pytree.TreeSpec, f"the {what}")
        self.bind("treespec_leaf", pytree.treespec_leaf, f"the {what}")
        return self._node(spec, what, "", 0)

    def _node(self, spec: pytree.TreeSpec, what: str, path: str, depth: int) -> str:
        if spec.is_leaf():
            return "LEAF"
        kind = self._type(spec.type, what, path)
        context = self._context(spec, what, path)
        children = [self._node(c, what, f"{path}[{i}]", depth + 1) for i, c in enumerate(spec.children())]
        flat = f"TreeSpec({kind}, {context}, [{', '.join(children)}])"
        if len(flat) + 4 * depth <= _SPEC_LINE:
            return flat
        pad = "    " * (depth + 1)
        inner = "".join(f"\n{pad}{child}," for child in children)
        return f"TreeSpec({kind}, {context}, [{inner}\n{'    ' * depth}])"

    def _type(self, cls: Any, what: str, path: str) -> str:
        """The name module.py calls `cls` by (`collections.namedtuple`, the node type of every
        namedtuple, is a function), bound; a class pytree knows by registration only is remembered."""
        if cls in (tuple, list, dict):
            return str(cls.__name__)
        if cls is type(None):
            return "type(None)"
        name = str(getattr(cls, "__name__", type(cls).__name__))
        self.bind(name, cls, f"the {what} (at {path or 'its root'})")
        if isinstance(cls, type) and not _is_namedtuple(cls) and cls.__module__ != "collections":
            self.registered[name] = cls
        return name

    def _context(self, spec: pytree.TreeSpec, what: str, path: str) -> str:
        context = spec.context
        if isinstance(context, type):  # a namedtuple's class
            return self._type(context, what, path)
        if spec.type is collections.defaultdict:  # [default_factory, keys]
            return f"[{self._type(context[0], what, path)}, {self._literal(context[1], spec, what, path)}]"
        return self._literal(context, spec, what, path)

    @staticmethod
    def _literal(value: Any, spec: pytree.TreeSpec, what: str, path: str) -> str:
        try:
            return _literal(value)
        except _NotLiteral:
            raise ConversionFailed(
                f"fx_source: the {what} holds a {_describe(spec.type)} (at {path or 'its root'}) whose pytree "
                f"context, a {_describe(type(value))}, has no Python literal form, so module.py cannot rebuild "
                "the structure torch.export recorded", stage="export",
                hint="take and return tensors in tuples, lists or dicts (flatten the container in a wrapper "
                     f"around the model before torch.export); or {_HINT}") from None


def _is_namedtuple(cls: type) -> bool:
    return issubclass(cls, tuple) and hasattr(cls, "_fields")


def registration_check(registered: dict[str, type]) -> str:
    """module.py's check, at import, that each class its specs hold is a pytree node where it loads
    (registered by importing its module, or by the caller before): else torch's own error would come
    at the first call, saying less. '' when the specs hold none."""
    if not registered:
        return ""
    names = "".join(f"{name}," if len(registered) == 1 else f"{name}, " for name in registered).rstrip()
    return ("# classes the specs hold, which pytree knows by registration only: the process loading this module\n"
            "# registers each (as the exporting process did) before importing it\n"
            f"_UNREGISTERED = [c for c in ({names}) if c not in torch.utils._pytree.SUPPORTED_NODES]\n"
            "if _UNREGISTERED:\n"
            "    raise ImportError(f\"{_UNREGISTERED[0].__module__}.{_UNREGISTERED[0].__qualname__} is not a "
            "registered pytree node in this process: register it (torch.utils._pytree.register_pytree_node) "
            "before importing this module\")\n")
