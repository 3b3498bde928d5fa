"""TorchScript by scripting a GraphModule's generated code, so torch.export's symbolic sizes stay symbolic.

A trace of an aten-level graph runs `sym_size` once and records the example's sizes as
constants; scripting compiles the code itself, so `aten.sym_size(x, 0)` stays a call and the
archive runs at every batch size and sequence length. TorchScript cannot compile the code FX
generates for an export graph as it is; `scriptable_copy` rewrites the few constructs it
rejects (measured on torch 2.13 with transformers 5.24 models built from configs, dynamic batch,
and sequence length for the text models: BERT, GPT-2, ViT, ResNet, MobileNetV2, DistilBERT, RoBERTa, Llama, T5's
encoder, ALBERT and ELECTRA each script after the rewrite, and match eager exactly at sizes the
trace fixed). What stays out of reach is named: higher-order ops such as torch.cond.
"""

from __future__ import annotations

import math
import os
import re
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import CodeGen, Graph, GraphModule, Node
from torch.fx.node import map_aggregate
from torch.utils import _pytree as pytree

# torch.export's checks on the input sizes. A TorchScript archive carries no ranges (a trace
# evaluates these checks once, at the example, and drops them; the manifest's `outside_range`
# says the archive runs any size), so the scripted one drops them too.
_RUNTIME_ASSERTS = (
    torch.ops.aten._assert_scalar.default,
    torch.ops.aten.sym_constrain_range.default,
    torch.ops.aten.sym_constrain_range_for_size.default,
)
_GUARD_PREFIX = "Guard failed"  # the message of each check torch.export's `_guards_fn` makes
_GUARDS_MODULE = "_guards_fn"  # the submodule holding them, in `ep.module()` when it is not re-traced

# `x.size(d)` is TorchScript's own spelling of aten.sym_size, and the one its ONNX exporter knows.
_SIZE_METHODS = {torch.ops.aten.sym_size.int: "size", torch.ops.aten.sym_numel.default: "numel",
                 torch.ops.aten.sym_stride.int: "stride"}

# SymInt helpers torch.export writes, and the Python builtin TorchScript has for int/float.
_SYM_BUILTINS = {torch.sym_max: max, torch.sym_min: min, torch.sym_float: float, torch.sym_int: int,
                 torch.sym_sum: sum, torch.sym_sqrt: math.sqrt}


class ScriptingBlocked(Exception):
    """The graph has no TorchScript form: `op` and `line` (of the graph's code) say where, `reason` why.

    `source` is the model's own source line when the graph still knows it (nodes of an unretraced
    `ep.module()` keep torch.export's stack traces; a re-traced graph keeps the module path)."""

    def __init__(self, op: str, line: str, reason: str, source: str = "") -> None:
        self.op, self.line, self.reason, self.source = op, line, reason, source
        where = f" ({source})" if source else ""
        super().__init__(f"{op}{where} at `{line}`: {reason}" if line else f"{op}{where}: {reason}")


def script_graph_module(gm: GraphModule) -> torch.jit.ScriptModule:
    """torch.jit.script of a scriptable copy of `gm` (`gm` is not changed; the tensors are shared).

    Raises ScriptingBlocked naming the first op TorchScript cannot compile."""
    module = scriptable_copy(gm)
    with warnings.catch_warnings():
        # every torch.jit call warns that TorchScript is deprecated; that says nothing new here
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", message=".*TorchScript.*")
        try:
            return torch.jit.script(module)
        except Exception as exc:
            raise _blocked_by(exc, module) from exc


def scriptable_copy(gm: GraphModule) -> GraphModule:
    """A GraphModule computing what `gm` computes, in code TorchScript compiles. Rewrites, in a copy:

    - `aten.sym_size.int(x, d)` becomes `x.size(d)` (and numel, stride likewise);
    - op overloads (`aten.add.Tensor`) become their packet (`aten.add`): TorchScript has no syntax
      to name an overload and picks it from the argument types, as Python does;
    - `torch.device` arguments become strings: TorchScript cannot build `device(type='cpu')`;
    - `torch.sym_max` and its kin become the builtins TorchScript has for ints and floats;
    - type annotations go: FX writes them under aliases (`_torch_Tensor_`) TorchScript cannot
      resolve, and every input is a tensor, TorchScript's default;
    - torch.export's range checks (`_guards_fn`, its inlined `torch._assert` lines, runtime
      `_assert_scalar`s) are dropped, as a trace drops them;
    - an unretraced `ep.module()`'s pytree code becomes plain positional inputs and an output
      built in the graph (tuple, list or dict), the call form the runners use.
    Raises ScriptingBlocked for what none of this covers: higher-order ops (torch.cond, ...) and
    inputs or outputs of other types."""
    graph = Graph()  # plain codegen: positional inputs, the output as the graph builds it
    graph.output(_structured_output(graph.graph_copy(gm.graph, {}), gm.graph._codegen))
    _refuse_higher_order_ops(graph)
    _drop_range_checks(graph)
    for node in graph.nodes:
        if node.target in _SIZE_METHODS:
            node.op, node.target = "call_method", _SIZE_METHODS[node.target]
        elif isinstance(node.target, torch._ops.OpOverload):
            node.target = node.target.overloadpacket
        elif node.op == "call_function" and node.target in _SYM_BUILTINS:
            node.target = _SYM_BUILTINS[node.target]
        node.args = map_aggregate(node.args, _device_as_str)
        node.kwargs = map_aggregate(node.kwargs, _device_as_str)
        node.type = None
    graph.lint()
    return GraphModule(gm, graph)


def _device_as_str(value: Any) -> Any:
    return str(value) if isinstance(value, torch.device) else value


def _refuse_higher_order_ops(graph: Graph) -> None:
    for node in graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator):
            name = f"torch.ops.higher_order.{node.target.name()}"
            raise ScriptingBlocked(name, _node_line(node), "higher-order ops (torch.cond, torch.while_loop, "
                                   "torch.map, ...) take graphs as operands and have no TorchScript form",
                                   _source_of(node))


def _drop_range_checks(graph: Graph) -> None:
    dropped = [n for n in graph.nodes if _is_range_check(n)]
    feeding = {i for n in dropped for i in n.all_input_nodes}
    for node in reversed(dropped):
        graph.erase_node(node)
    # the sizes and comparisons that only fed the checks: pure, now unused
    while feeding:
        node = feeding.pop()
        if node.op in ("call_function", "call_method") and not node.users and not node.is_impure():
            feeding.update(node.all_input_nodes)
            graph.erase_node(node)


def _is_range_check(node: Node) -> bool:
    if node.op == "call_module":
        return node.target == _GUARDS_MODULE
    if node.op != "call_function":
        return False
    if node.target is torch._assert:
        message = node.args[1] if len(node.args) > 1 else node.kwargs.get("message", "")
        return isinstance(message, str) and message.startswith(_GUARD_PREFIX)
    return node.target in _RUNTIME_ASSERTS


def _structured_output(flat: Any, codegen: CodeGen) -> Any:
    """An unretraced `ep.module()` takes and returns pytrees through code TorchScript can't compile
    (`tree_flatten_spec`). Its inputs are the flat tensors anyway; its output structure is rebuilt
    from the spec, in the graph, so the scripted module returns what the model returns."""
    info = getattr(codegen, "pytree_info", None)
    if info is None:
        return flat
    if info.in_spec is not None and not all(child.is_leaf() for child in _input_children(info.in_spec)):
        raise ScriptingBlocked("inputs", "", f"the model takes nested inputs ({info.in_spec}); TorchScript takes "
                               "the flat tensors the job's spec lists")
    if info.out_spec is None:
        return flat
    _check_output_spec(info.out_spec)
    return pytree.tree_unflatten(list(flat) if isinstance(flat, (list, tuple)) else [flat], info.out_spec)


def _input_children(spec: pytree.TreeSpec) -> list[pytree.TreeSpec]:
    """Each input of an (args, kwargs) input spec: all must be leaves (tensors) to be positional inputs."""
    if spec.type is tuple and spec.num_children == 2 and spec.child(1).type is dict:
        return [spec.child(0).child(i) for i in range(spec.child(0).num_children)] + \
               [spec.child(1).child(i) for i in range(spec.child(1).num_children)]
    return [spec.child(i) for i in range(spec.num_children)]


def _check_output_spec(spec: pytree.TreeSpec) -> None:
    if spec.is_leaf():
        return
    if spec.type not in (tuple, list, dict):
        name = getattr(spec.type, "__qualname__", str(spec.type))
        raise ScriptingBlocked("outputs", "", f"the model returns a {name}; the graph can only build "
                               "tensors, tuples, lists and dicts for TorchScript")
    for i in range(spec.num_children):
        _check_output_spec(spec.child(i))


# ---------------------------------------------------------------------------------------
# Naming where TorchScript stopped
# ---------------------------------------------------------------------------------------

_ASSIGNED = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*=")
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in [^\n]*\n([^\n]*)')
_TORCH_DIR = os.path.dirname(torch.__file__)


@dataclass
class _Highlight:
    where: str  # 'file:line' of the code TorchScript was compiling
    code: str  # the statement its `<--- HERE` marks, without FX's `;  x = None` cleanup


def _blocked_by(exc: Exception, module: GraphModule) -> ScriptingBlocked:
    """TorchScript's error as op + line. Its `<--- HERE` marks run from the failing statement out to
    the graph line that called it (when the failure is in a function the graph calls): the graph
    line names the node, hence the op and the model's source; the innermost mark says what failed."""
    text = str(exc).strip()
    reason = next((ln.strip().rstrip(":") for ln in text.splitlines() if ln.strip()), type(exc).__name__)
    marks = _highlights(text)
    if not marks:
        return ScriptingBlocked(type(exc).__name__, "", reason)
    names = {n.name: n for n in module.graph.nodes}
    for mark in marks:
        match = _ASSIGNED.match(mark.code)
        node = names.get(match.group(1)) if match else None
        if node is not None:
            if mark is not marks[0]:
                reason += f" (at {marks[0].where}: `{marks[0].code}`)"
            return ScriptingBlocked(_op_name(node), mark.code, reason, _source_of(node))
    return ScriptingBlocked(f"`{marks[0].code}`", "", reason, marks[0].where)


def _highlights(text: str) -> list[_Highlight]:
    """Every `<--- HERE` of a TorchScript error, innermost first, with the file/line above it."""
    lines = text.splitlines()
    out = []
    for i, line in enumerate(lines):
        if "<--- HERE" not in line or i == 0:
            continue
        where = ""
        for above in reversed(lines[:i]):
            found = re.match(r'\s*File "([^"]+)", line (\d+)', above)
            if found:
                where = f"{found.group(1)}:{found.group(2)}"
                break
        out.append(_Highlight(where=where, code=lines[i - 1].split(";")[0].strip()))
    return out


def _op_name(node: Node) -> str:
    target = node.target
    if isinstance(target, torch._ops.OpOverloadPacket):
        return f"torch.ops.{target._qualified_op_name.replace('::', '.')}"
    if callable(target):
        module = getattr(target, "__module__", "") or ""
        name = getattr(target, "__name__", str(target))
        return f"{module}.{name}" if module and module != "builtins" else name
    return f"{node.op} {target}"


def _node_line(node: Node) -> str:
    """The node as one line of the graph's code (what TorchScript would have shown)."""
    args = ", ".join(str(a) for a in node.args)
    return f"{node.name} = {_op_name(node)}({args})"


def _source_of(node: Node) -> str:
    """The model's source line for `node` as 'file:line: code' (the innermost frame of torch.export's
    stack trace that is neither torch's nor generated code), else the module path it sits in."""
    frames = _FRAME.findall(node.meta.get("stack_trace") or "")
    for file, line, code in reversed(frames):
        if not file.startswith("<") and not os.path.abspath(file).startswith(_TORCH_DIR):
            return f"{file}:{line}: {code.strip()}"
    stack = node.meta.get("nn_module_stack") or {}
    path = list(stack.values())[-1][0] if stack else ""
    return f"in module {path}" if path else ""
