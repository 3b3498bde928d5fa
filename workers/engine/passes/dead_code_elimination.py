"""dead_code_elimination: remove nodes whose results nobody uses, and what only they referenced."""

from __future__ import annotations

from collections import Counter

from torch.fx import GraphModule

from fxport.pass_catalog import NoOptions
from fxport.workers.engine.passes import PassContext, PassResult
from fxport.workers.engine.passes.graph_attrs import prune_unused_attrs
from fxport.workers.engine.passes.side_effects import has_side_effects


def dead_code_elimination(gm: GraphModule, opts: NoOptions, ctx: PassContext) -> PassResult:
    """Unused pure nodes ⇒ removed; then unreferenced parameters, buffers and submodules ⇒ removed.

    Mutates `gm` in place. Uses `Graph.eliminate_dead_code()`, which keeps placeholders,
    outputs, side-effecting and random ops, and impure modules (e.g. the `_guards_fn` that
    `ep.module()` calls with no users) — and, through `has_side_effects`, the torch-level
    in-place calls (`y.add_(1)`, `nn.ReLU(inplace=True)`) it would otherwise drop. Attributes are
    removed only from gm's own containers, never from the user's modules that a torch-level graph shares.
    """
    graph = gm.graph
    before = Counter(node.op for node in graph.nodes)
    graph.eliminate_dead_code(is_impure_node=lambda node: has_side_effects(gm, node))
    after = Counter(node.op for node in graph.nodes)
    removed_attrs = prune_unused_attrs(gm)
    removed_nodes = sum(before.values()) - sum(after.values())
    changed = removed_nodes > 0 or bool(removed_attrs)
    if changed:
        graph.lint()
        gm.recompile()
    return PassResult(gm, changed, _notes(before - after, removed_attrs))


def _notes(removed_nodes: Counter[str], removed_attrs: list[str]) -> str:
    if not removed_nodes and not removed_attrs:
        return "no dead code"
    parts = []
    if removed_nodes:
        total = sum(removed_nodes.values())
        detail = ", ".join(f"{n} {op}" for op, n in sorted(removed_nodes.items()))
        parts.append(f"removed {total} unused node{'s' if total != 1 else ''} ({detail})")
    if removed_attrs:
        shown = ", ".join(removed_attrs[:5]) + (f", … {len(removed_attrs) - 5} more" if len(removed_attrs) > 5 else "")
        plural = "s" if len(removed_attrs) != 1 else ""
        parts.append(f"dropped {len(removed_attrs)} unreferenced attribute{plural} ({shown})")
    return "; ".join(parts)
