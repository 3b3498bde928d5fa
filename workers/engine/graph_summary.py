"""The graph as the manifest records it before and after the passes: its nodes (op, target, inputs)
and a count per op — enough for the report to draw it from the manifest alone.
"""

from __future__ import annotations

from typing import Any


def graph_summary(gm: Any) -> dict[str, Any]:
    """Node list of the graph (op, target, inputs) — enough to draw it later from the manifest alone."""
    nodes = []
    for n in gm.graph.nodes:
        nodes.append({
            "name": n.name, "op": n.op, "target": _target_name(n.target),
            "inputs": [a.name for a in n.all_input_nodes],
        })
    counts: dict[str, int] = {}
    for n in nodes:
        if n["op"] in ("call_module", "call_function", "call_method"):
            counts[n["target"]] = counts.get(n["target"], 0) + 1
    return {"node_count": len(nodes), "op_counts": counts, "nodes": nodes if len(nodes) <= 2000 else nodes[:2000]}


def _target_name(target: Any) -> str:
    if isinstance(target, str):
        return target
    name = getattr(target, "__name__", None) or str(target)
    module = getattr(target, "__module__", "") or ""
    if "aten" in str(target) or module.startswith("torch._ops"):
        return str(target)
    return f"{module}.{name}" if module and module != "builtins" else name

