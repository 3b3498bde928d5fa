"""The ONNX exporter's decomposition, skipped where it has nothing to do (issue 24).

torch.onnx.export (torch 2.13) hands every program to `ExportedProgram.run_decompositions`, with a
table of the ops ONNX has no translation for. That re-traces the whole program through
aot_autograd with fake tensors and a symbolic batch, whatever it finds: for the ResNet-18 fxport's
passes leave, 0.55-1.09 s warm on a 2-core AMD EPYC VM, most of the ONNX export, to change 18 of
its 48 operator nodes in two simple ways (`relu_` to `relu`, `adaptive_avg_pool2d` to `mean`).

`ready_for_onnx` makes such changes on a copy of the program's graph, and hands the exporter that
copy, in place of the re-trace, when every node then has a translation of its own:

- an in-place op (`relu_`, `add_`, `hardtanh_`...) becomes its out-of-place twin when no other
  node can see the write: the tensor written is one an op made fresh (not an input, a parameter, a
  view, or what a composite such as `dropout` or `contiguous` may hand back as it is), and nothing
  reads it after the write but through the in-place op's result (torch.export routes later reads
  that way); and it reads only tensors of the written one's dtype, which it keeps where the twin
  would promote;
- `dropout_` in eval writes its input's own values: it becomes `dropout`;
- `adaptive_avg_pool2d` to 1x1, a network's global pooling, becomes `mean` over the last two dims,
  as torch's own decomposition writes it;
- `__and__`, `__or__`, `__xor__` (`a & b`...) become the `bitwise_*` ops they call;
- `to(dtype)`/`to(device)` with nothing more asked becomes `_to_copy`, as torch's does (with no
  mutation left in the graph, a copy where `to` would hand back its input changes no value);
- the checks the exporter erases after its decomposition (`_assert_tensor_metadata`...) stay.

Anything else (an op ONNX lacks, another mutation, a control-flow subgraph, a mutated input or
buffer in the program's signature) leaves the program to the exporter's decomposition, unchanged.
Should the exporter fail on a readied program, `OnnxFromGraphModule` exports again the exporter's
own way. Every ONNX artifact is then checked against the original model by verification.

The replaced name is the exporter's `_fx_passes.decompose_with_registry` in the pinned torch
(pyproject: torch==2.13.0); the installer checks it is the function it was written against, and
leaves the exporter alone where it is not.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import operator
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import Graph, GraphModule, Node

_aten = torch.ops.aten
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Readiness:
    """What `ready_for_onnx` found: the program to hand the exporter, or why there is none."""

    program: torch.export.ExportedProgram | None
    nodes_changed: int = 0
    declined: str = ""


def ready_for_onnx(program: torch.export.ExportedProgram, registry: Any) -> Readiness:
    """A copy of `program` whose every node the ONNX exporter translates as it is, or the first
    node that only the exporter's decomposition can handle. `program` itself is never changed."""
    sig = program.graph_signature
    if sig.buffers_to_mutate or sig.user_inputs_to_mutate or getattr(sig, "parameters_to_mutate", None):
        return Readiness(None, declined="the program mutates an input or a buffer")
    graph = Graph()
    graph._codegen = program.graph._codegen
    copied: dict[Node, Node] = {}
    graph.output(graph.graph_copy(program.graph, copied))
    for node, copy_ in copied.items():
        copy_.name = node.name  # fx renames one that shadows a builtin (`input`); the signature names it
    order = {node: i for i, node in enumerate(graph.nodes)}
    origin = {node: node.target for node in graph.nodes}  # before any rewrite
    unshared: set[Node] = set()  # in-place results whose storage no other node reads
    changed = 0
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is _aten.adaptive_avg_pool2d.default and _global_pool(node):
            node.target, node.args, node.kwargs = _aten.mean.dim, (node.args[0], [-1, -2], True), {}
            changed += 1
        elif node.target in _TO and (conversion := _plain_conversion(node)) is not None:
            node.target, node.args, node.kwargs = _aten._to_copy.default, (node.args[0],), conversion
            changed += 1
        elif node.target in _SAME_OP:
            node.target = _SAME_OP[node.target]
            changed += 1
        elif node.target is _aten.dropout_.default and _eval_dropout(node):
            node.target = _aten.dropout.default  # the same values, written over themselves: nothing to see
            changed += 1
        elif _mutates_first_arg(node.target):
            twin = _out_of_place_twin(node.target)
            invisible = _write_is_invisible(node, order, origin, unshared)
            if twin is None or not registry.is_registered(twin) or not invisible:
                return Readiness(None, declined=f"{node.name} ({node.target}) writes a tensor other nodes may read")
            if not _one_dtype(node):
                return Readiness(None, declined=f"{node.name} ({node.target}) mixes dtypes: its twin would promote")
            node.target = twin
            unshared.add(node)
            changed += 1
        if node.target in _ASSERTIONS:
            continue  # the exporter removes them after its decomposition
        if not _translatable(node.target, registry):
            return Readiness(None, declined=f"{node.name} ({node.target}) has no ONNX translation of its own")
    gm = GraphModule(program.graph_module, graph)
    gm.meta.update(program.graph_module.meta)
    ready = copy.copy(program)
    ready._graph_module = gm  # as the exporter sets it after its own passes
    return Readiness(ready, nodes_changed=changed)


def _translatable(target: Any, registry: Any) -> bool:
    if target is operator.getitem:
        return True
    if isinstance(target, torch._ops.HigherOrderOperator):
        return False  # a subgraph the decomposition would walk into
    if isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable:
        return False
    return bool(registry.is_registered(target))


# checks the exporter's `remove_assertion_nodes` erases, which need no translation
_ASSERTIONS = frozenset({
    _aten.sym_constrain_range_for_size.default, _aten._assert_async.default, _aten._assert_async.msg,
    _aten._assert_scalar.default, _aten._assert_tensor_metadata.default,
})


# composites that are another op under a second name (`a & b` is `bitwise_and`), same arguments
_SAME_OP = {
    _aten.__and__.Tensor: _aten.bitwise_and.Tensor, _aten.__and__.Scalar: _aten.bitwise_and.Scalar,
    _aten.__or__.Tensor: _aten.bitwise_or.Tensor, _aten.__or__.Scalar: _aten.bitwise_or.Scalar,
    _aten.__xor__.Tensor: _aten.bitwise_xor.Tensor, _aten.__xor__.Scalar: _aten.bitwise_xor.Scalar,
}
_TO = frozenset({_aten.to.dtype, _aten.to.device, _aten.to.dtype_layout})


def _plain_conversion(node: Node) -> dict[str, Any] | None:
    """`x.to(dtype/device)` as `_to_copy`'s keywords, as torch's decomposition writes it; None for
    anything more (a copy or a memory format asked for, a non-strided layout, pinned memory). The
    graph keeps no mutation, so a copy where `to` would have handed back `x` changes no value."""
    target: Any = node.target  # one of _TO
    bound = dict(node.kwargs)
    bound.update((a.name, v) for a, v in zip(target._schema.arguments, node.args))
    if any(bound.get(k) for k in ("non_blocking", "copy", "pin_memory")):
        return None
    if bound.get("memory_format") not in (None, torch.preserve_format):
        return None
    if bound.get("layout") not in (None, torch.strided):
        return None
    return {k: bound[k] for k in ("dtype", "device") if bound.get(k) is not None}


def _eval_dropout(node: Node) -> bool:
    train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train")
    return train is False


def _global_pool(node: Node) -> bool:
    size = node.args[1] if len(node.args) > 1 else node.kwargs.get("output_size")
    return isinstance(size, (list, tuple)) and len(size) == 2 and all(isinstance(s, int) and s == 1 for s in size)


def _mutates_first_arg(target: Any) -> bool:
    if not isinstance(target, torch._ops.OpOverload) or not target._schema.is_mutable:
        return False
    args = target._schema.arguments
    return bool(args) and args[0].alias_info is not None and args[0].alias_info.is_write


def _out_of_place_twin(target: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """`aten.relu_.default` -> `aten.relu.default`: the same arguments, none of them written, and
    one result; None where there is no such op."""
    schema = target._schema
    name = schema.name.split("::")[-1]
    if not name.endswith("_") or name.endswith("__") or len(schema.returns) != 1:
        return None
    if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments[1:]):
        return None
    packet = getattr(getattr(torch.ops, target.namespace), name[:-1], None)
    twin = getattr(packet, target._overloadname, None) if packet is not None else None
    if not isinstance(twin, torch._ops.OpOverload):
        return None
    tschema = twin._schema
    same_args = [(a.name, str(a.type)) for a in tschema.arguments] == [(a.name, str(a.type)) for a in schema.arguments]
    if tschema.is_mutable or not same_args or len(tschema.returns) != 1 or tschema.returns[0].alias_info is not None:
        return None
    return twin


def _write_is_invisible(node: Node, order: dict[Node, int], origin: dict[Node, Any], unshared: set[Node]) -> bool:
    """The in-place op at `node` writes a tensor nobody else holds: one an op made fresh (or one an
    in-place op before it was found to write so), which no node reads after the write."""
    written = node.args[0] if node.args else None
    if not isinstance(written, Node) or written.op != "call_function":
        return False  # an input, parameter or buffer: the caller would see the write
    if written not in unshared and not _returns_fresh(origin[written]):
        return False
    return all(order[user] < order[node] for user in written.users if user is not node)


def _one_dtype(node: Node) -> bool:
    """Every tensor the in-place op reads has the dtype of the one it writes. An in-place op keeps
    that dtype (`h16.mul_(s32)` stays float16); its twin would promote (`mul(h16, s32)` is float32)."""
    dtypes = {getattr(a.meta.get("val"), "dtype", None) for a in node.all_input_nodes}
    return len(dtypes) == 1 and None not in dtypes


# Composite ops keep their own schema, and some return their input as it is: `dropout` in eval,
# `contiguous` of a contiguous tensor, `type_as` to the same dtype. Of those, only these always
# make a new tensor.
_FRESH_COMPOSITES = frozenset({
    _aten.conv1d.default, _aten.conv2d.default, _aten.conv3d.default, _aten.linear.default,
    _aten.batch_norm.default, _aten.layer_norm.default, _aten.group_norm.default,
})


def _returns_fresh(target: Any) -> bool:
    """The op always returns a tensor of its own: no view, no input handed back."""
    if not isinstance(target, torch._ops.OpOverload) or target._schema.is_mutable:
        return False
    if any(r.alias_info is not None for r in target._schema.returns):
        return False  # a view: a write would reach the tensor it views
    if target in _FRESH_COMPOSITES:
        return True
    return not torch._C._dispatch_has_kernel_for_dispatch_key(target.name(), "CompositeImplicitAutograd")


def install() -> DecomposeWhereNeeded | None:
    """Put `ready_for_onnx` in front of the exporter's decomposition in this process (once), and
    return it; None where this torch's exporter is not the one it was written against."""
    from torch.onnx._internal.exporter import _core, _fx_passes

    current = getattr(_fx_passes, "decompose_with_registry", None)
    if isinstance(current, DecomposeWhereNeeded):
        return current
    if not callable(current) or getattr(_core, "_fx_passes", None) is not _fx_passes:
        return None
    installed = DecomposeWhereNeeded(current)
    patched: Any = _fx_passes  # a private name of torch's, replaced
    patched.decompose_with_registry = installed
    return installed


class DecomposeWhereNeeded:
    """The exporter's `decompose_with_registry`, which tries `ready_for_onnx` first. What it found
    and whether it is on are kept per thread, as an export runs in one."""

    def __init__(self, decompose: Any) -> None:
        self.decompose = decompose
        self._thread = threading.local()

    @property
    def enabled(self) -> bool:
        """Off, exports take the exporter's own way (benchmarks and tests compare the two)."""
        return bool(getattr(self._thread, "enabled", True))

    @enabled.setter
    def enabled(self, value: bool) -> None:
        self._thread.enabled = value

    @property
    def last(self) -> Readiness:
        """What this thread's last export found."""
        found = getattr(self._thread, "last", None)
        return found if isinstance(found, Readiness) else _NOT_YET

    def __call__(self, program: torch.export.ExportedProgram, registry: Any) -> torch.export.ExportedProgram:
        found = ready_for_onnx(program, registry) if self.enabled else Readiness(None, declined="turned off")
        self._thread.last = found
        if found.program is not None:
            return found.program
        log.debug("ONNX export: the exporter decomposes the program: %s", found.declined)
        return self.decompose(program, registry)

    def reset(self) -> None:
        """Before an export: `handed_over` then tells of that export alone."""
        self._thread.last = _NOT_YET

    @property
    def handed_over(self) -> bool:
        """Whether this thread's export since `reset` was given a program `ready_for_onnx` readied."""
        return self.last.program is not None

    @contextlib.contextmanager
    def off(self) -> Iterator[None]:
        """Exports within (on this thread) take the exporter's own way, whatever the program."""
        enabled, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = enabled


_NOT_YET = Readiness(None, declined="no export yet")
