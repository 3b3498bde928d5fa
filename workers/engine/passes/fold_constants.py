"""fold_constants: precompute subgraphs that read only parameters, buffers and literals.

Written by hand rather than with `torch.fx.experimental.const_fold.split_const_subgraphs`:
that returns a differently-structured `FoldedGraphModule` (a split into submodules that folds
lazily on first call) and rebuilds the graph without the pytree codegen `ep.module()` uses.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.nn.functional as F
from torch.fx import GraphModule, Node
from torch.fx.node import map_arg

from fxport.pass_catalog import FoldConstantsOptions
from fxport.workers.engine.passes import PassContext, PassResult, target_fn, target_name
from fxport.workers.engine.passes.graph_attrs import erase_if_unused, fetch_attr, prune_unused_attrs, unique_name
from fxport.workers.engine.passes.side_effects import has_side_effects

# Random at run time although `Node.is_impure()` does not say so (it knows torch.rand*, not these).
_RANDOM_FUNCTIONS = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout,
                     torch.dropout, torch.alpha_dropout, torch.feature_dropout, torch.feature_alpha_dropout}
_RANDOM_METHODS = {"bernoulli", "multinomial"}
_LITERALS = (int, float, bool)


def fold_constants(gm: GraphModule, opts: FoldConstantsOptions, ctx: PassContext) -> PassResult:
    """Subgraphs fed only by get_attr/literals ⇒ one get_attr buffer holding their result.

    Mutates `gm` in place: each folded result becomes a new buffer on gm's root (named after
    its one source attribute, `fc_weight_folded`, or `_folded_const_N`) (a copy, so it never
    aliases the user's tensors); the nodes that computed it and any attribute only they read are
    removed. Skipped, and noted: results with more than `opts.max_elements` elements, random or
    in-place ops and anything computed from an attribute the graph writes, module calls, and
    results that are neither tensors nor plain numbers (numbers and shapes are inlined into their
    users as literals).
    """
    graph = gm.graph
    mutated = _mutated_attrs(gm)
    constant: set[Node] = set()
    for node in graph.nodes:
        if _foldable(gm, node, constant, mutated):
            constant.add(node)

    values: dict[Node, Any] = {}
    folded: Counter[str] = Counter()
    skipped: Counter[str] = Counter()
    had_users = {n for n in constant if n.users}  # unused before the pass: not ours to delete
    for node in list(graph.nodes):
        if node not in constant or node.op == "get_attr":
            continue
        if all(user in constant for user in node.users):
            continue  # an inner node: it folds into a result further down
        try:
            value = _evaluate(gm, node, values)
        except Exception as exc:  # an op that cannot run on its constant inputs here stays in the graph
            skipped[f"could not evaluate ({type(exc).__name__})"] += 1
            continue
        what = _name(node)
        if isinstance(value, torch.Tensor):
            if value.numel() > opts.max_elements:
                skipped[f"{value.numel()} elements > max_elements {opts.max_elements}"] += 1
                continue
            name = unique_name(gm, _buffer_name(node))
            gm.register_buffer(name, value.detach().clone())
            with graph.inserting_before(node):
                new = graph.get_attr(name)
            new.meta.update(node.meta)
            node.replace_all_uses_with(new, delete_user_cb=lambda user: user not in constant)
        elif isinstance(value, _LITERALS) or _is_literal_sequence(value):
            value = tuple(value) if isinstance(value, (list, tuple)) else value  # torch.Size → tuple
            for user in [u for u in node.users if u not in constant]:
                # map_arg calls the lambdas right here, in this iteration: they see this node and value
                user.args = map_arg(user.args, lambda a: value if a is node else a)  # noqa: B023
                user.kwargs = map_arg(user.kwargs, lambda a: value if a is node else a)  # noqa: B023
        else:
            skipped[f"{type(value).__name__} result ({what})"] += 1
            continue
        folded[what] += 1

    changed = bool(folded)
    if changed:
        erase_if_unused(gm, [n for n in graph.nodes if n in had_users])
        prune_unused_attrs(gm)
        graph.lint()
        gm.recompile()
    return PassResult(gm, changed, _notes(folded, skipped))


def _mutated_attrs(gm: GraphModule) -> set[str]:
    """Attributes the graph may write in place (`self.count.add_(1)`, `buf[0] = v`, aten copy_).

    Anything computed from them changes from call to call, so it is not a constant. Walks back
    from each in-place op's first argument through whatever produced it — conservative: `(w * 2).add_(x)`
    marks `w` too, which costs a fold, never correctness.
    """
    mutated: set[str] = set()
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module") or not node.args:
            continue
        if not has_side_effects(gm, node):
            continue
        current = node.args[0]
        while isinstance(current, Node):
            if current.op == "get_attr":
                mutated.add(target_name(current))
                break
            if current.op not in ("call_function", "call_method") or not current.args:
                break
            current = current.args[0]
    return mutated


def _is_literal_sequence(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(v, _LITERALS) for v in value)


def _foldable(gm: GraphModule, node: Node, constant: set[Node], mutated: set[str]) -> bool:
    if node.op == "get_attr":
        return isinstance(_safe_fetch(gm, target_name(node)), torch.Tensor) and node.target not in mutated
    if node.op not in ("call_function", "call_method"):
        return False  # placeholders, outputs, and module calls (modules may hold state)
    if not all(inp in constant for inp in node.all_input_nodes):
        return False
    if has_side_effects(gm, node):  # random, or in place: evaluating it would write into a parameter
        return False
    if node.op == "call_method":
        return node.target not in _RANDOM_METHODS
    target = node.target
    if target in _RANDOM_FUNCTIONS:
        return False
    tags = getattr(target, "tags", ())
    if torch.Tag.nondeterministic_seeded in tags or "dropout" in str(target):
        return False
    return True


def _evaluate(gm: GraphModule, node: Node, values: dict[Node, Any]) -> Any:
    if node in values:
        return values[node]
    args = map_arg(node.args, lambda n: _evaluate(gm, n, values))
    kwargs = map_arg(node.kwargs, lambda n: _evaluate(gm, n, values))
    with torch.no_grad():
        if node.op == "get_attr":
            value = fetch_attr(gm, target_name(node))
        elif node.op == "call_method":
            self_obj, *rest = args
            value = getattr(self_obj, target_name(node))(*rest, **kwargs)
        else:
            value = target_fn(node)(*args, **kwargs)
    values[node] = value
    return value


def _buffer_name(node: Node) -> str:
    """`fc_weight_folded` when one attribute feeds the subgraph (readable FX source), else `_folded_const`."""
    sources: set[str] = set()
    stack, seen = [node], set()
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        if current.op == "get_attr":
            sources.add(target_name(current))
        stack.extend(current.all_input_nodes)
    if len(sources) == 1:
        return sources.pop().replace(".", "_") + "_folded"
    return "_folded_const"


def _safe_fetch(gm: GraphModule, target: str) -> Any:
    try:
        return fetch_attr(gm, target)
    except AttributeError:
        return None


def _name(node: Node) -> str:
    target = node.target
    if isinstance(target, str):
        return target
    return str(getattr(target, "__name__", target)).split(".")[0]


def _notes(folded: Counter[str], skipped: Counter[str]) -> str:
    if not folded and not skipped:
        return "no constant subgraphs"
    parts = []
    if folded:
        total = sum(folded.values())
        parts.append(
            f"folded {total} constant subgraph{'s' if total != 1 else ''} into buffers "
            f"(ending in {', '.join(f'{n} {op}' for op, n in folded.items())})"
        )
    if skipped:
        parts.append("skipped " + ", ".join(f"{n}: {why}" for why, n in skipped.items()))
    return "; ".join(parts)
