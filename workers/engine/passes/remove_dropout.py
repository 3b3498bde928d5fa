"""remove_dropout: drop dropout that is the identity because it runs in eval mode."""

from __future__ import annotations

import operator
from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import GraphModule, Node

from fxport.pass_catalog import NoOptions
from fxport.workers.engine.passes import PassContext, PassResult, target_fn, target_name
from fxport.workers.engine.passes.graph_attrs import bind_op_args, prune_unused_attrs

aten = torch.ops.aten

# Torch-level functions: where their `training` flag sits, under what name, and its default.
# F.alpha_dropout and F.feature_alpha_dropout default to training=False; the others to True,
# so F.dropout(x) with no flag is *active* dropout even in an eval model and must stay.
_FUNCTIONS: dict[object, tuple[int, str, bool | None]] = {
    F.dropout: (2, "training", True),
    F.dropout1d: (2, "training", True),
    F.dropout2d: (2, "training", True),
    F.dropout3d: (2, "training", True),
    F.alpha_dropout: (2, "training", False),
    F.feature_alpha_dropout: (2, "training", False),
    torch.dropout: (2, "train", None),
    torch.alpha_dropout: (2, "train", None),
    torch.feature_dropout: (2, "train", None),
    torch.feature_alpha_dropout: (2, "train", None),
}
# torch.export keeps eval dropout as aten.dropout.default(x, p, train=False);
# run_decompositions() turns that into aten.clone.default (recognized by its torch_fn meta).
_ATEN_OPS = {aten.dropout.default, aten.feature_dropout.default, aten.alpha_dropout.default,
             aten.feature_alpha_dropout.default}


def remove_dropout(gm: GraphModule, opts: NoOptions, ctx: PassContext) -> PassResult:
    """Dropout(eval) ⇒ removed (its users read its input directly).

    Mutates `gm` in place. Torch level: call_module nn.Dropout* in eval mode, and
    F.dropout*/torch.dropout* called with training=False. Aten level: aten.dropout-family
    ops with train=False, aten.native_dropout(train=False) read only through getitem 0, and the
    aten.clone that `run_decompositions()` leaves where an eval dropout was. Dropout that is
    active (a module in training mode, F.dropout without training=False) is kept and noted.
    """
    removed: Counter[str] = Counter()
    kept: Counter[str] = Counter()
    graph = gm.graph
    for node in list(graph.nodes):
        verdict = _classify(gm, node)
        if verdict is None:
            continue
        kind, active = verdict
        if active:
            kept[kind] += 1
            continue
        outputs = [node] if node.target != aten.native_dropout.default else list(node.users)
        if any(o is not node and not (o.target is operator.getitem and o.args[1] == 0) for o in outputs):
            kept[f"{kind} whose mask is used"] += 1
            continue
        source = node.args[0] if node.args else node.kwargs.get("input")
        for out in outputs:
            out.replace_all_uses_with(source)
        for out in outputs:
            if out is not node:
                graph.erase_node(out)
        graph.erase_node(node)
        removed[kind] += 1

    changed = bool(removed)
    if changed:
        prune_unused_attrs(gm)
        graph.lint()
        gm.recompile()
    return PassResult(gm, changed, _notes(removed, kept))


def _classify(gm: GraphModule, node: Node) -> tuple[str, bool] | None:
    """(what it is, whether it is active) for a dropout node; None for anything else."""
    if node.op == "call_module":
        mod = gm.get_submodule(target_name(node))
        if isinstance(mod, nn.modules.dropout._DropoutNd):
            return type(mod).__name__, mod.training
        return None
    if node.op != "call_function":
        return None
    if node.target in _FUNCTIONS:
        index, name, default = _FUNCTIONS[node.target]
        flag = node.args[index] if len(node.args) > index else node.kwargs.get(name, default)
        fn = target_fn(node)
        return f"{fn.__module__.split('.')[-1]}.{fn.__name__}", flag is not False
    if node.target in _ATEN_OPS:
        bound = bind_op_args(node)
        assert bound is not None  # an aten OpOverload: it has a schema
        return str(node.target.overloadpacket), bound["train"] is not False
    if node.target == aten.native_dropout.default:
        bound = bind_op_args(node)
        assert bound is not None  # an aten OpOverload: it has a schema
        return "aten.native_dropout", bound["train"] is not False
    if node.target == aten.clone.default and _from_dropout(node):
        return "aten.clone left by an eval dropout", False
    return None


def _from_dropout(node: Node) -> bool:
    """Whether export recorded this clone as the decomposition of an eval dropout."""
    torch_fn = node.meta.get("torch_fn")
    if not (isinstance(torch_fn, tuple) and len(torch_fn) == 2 and "dropout" in str(torch_fn[1])):
        return False
    # a clone asking for a memory format is a real layout change, not dropout's identity copy
    return node.kwargs.get("memory_format") in (None, torch.preserve_format)


def _notes(removed: Counter[str], kept: Counter[str]) -> str:
    if not removed and not kept:
        return "no dropout nodes"
    parts = []
    if removed:
        parts.append("removed " + ", ".join(f"{n} {kind}" for kind, n in removed.items()))
    if kept:
        parts.append("kept active dropout: " + ", ".join(f"{n} {kind}" for kind, n in kept.items()))
    return "; ".join(parts)
