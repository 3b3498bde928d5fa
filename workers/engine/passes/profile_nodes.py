"""profile_nodes: time every node of the graph through an Interpreter; the slowest go in the report."""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import torch
from torch.fx import GraphModule, Interpreter, Node

from fxport.pass_catalog import ProfileNodesOptions
from fxport.workers.engine.passes import PassContext, PassResult, target_name

_COMPUTE = ("call_function", "call_method", "call_module")


class NodeTimer(Interpreter):
    """An Interpreter that adds each compute node's `run_node` wall time to `seconds[node]`.

    Timing goes around `run_node` only, so interpretation overhead between nodes is left out;
    the per-node numbers are eager op cost plus a few µs of dispatch each.
    """

    def __init__(self, gm: GraphModule) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.seconds: dict[Node, float] = defaultdict(float)

    def run_node(self, n: Node) -> Any:
        if n.op not in _COMPUTE:
            return super().run_node(n)
        start = time.perf_counter()
        result = super().run_node(n)
        self.seconds[n] += time.perf_counter() - start
        return result


def profile_nodes(gm: GraphModule, opts: ProfileNodesOptions, ctx: PassContext) -> PassResult:
    """Per-node timing (no rewrite): one warm-up run, then `opts.runs` timed runs on ctx.example_inputs.

    Does not mutate `gm`. Writes `ctx.report["profile"]` = {"top_nodes": [{"node", "op", "kind",
    "ms", "share"}], "total_ms", "runs"}, the `opts.top` slowest compute nodes by mean ms, where
    share is the node's fraction of `total_ms` (the sum over all compute nodes).
    """
    if not ctx.example_inputs:
        return PassResult(gm, False, "not profiled: the job has no example inputs to run")
    with torch.no_grad():
        NodeTimer(gm).run(*ctx.example_inputs)  # warm-up: allocator, lazy init, caches
        timer = NodeTimer(gm)
        for _ in range(opts.runs):
            timer.run(*ctx.example_inputs)

    mean_ms = {node: s * 1000.0 / opts.runs for node, s in timer.seconds.items()}
    total_ms = sum(mean_ms.values())
    ranked = sorted(mean_ms.items(), key=lambda kv: kv[1], reverse=True)[: opts.top]
    top_nodes = [
        {
            "node": node.name,
            "op": _op(gm, node),
            "kind": node.op,
            "ms": round(ms, 4),
            "share": round(ms / total_ms, 4) if total_ms > 0 else 0.0,
        }
        for node, ms in ranked
    ]
    ctx.report["profile"] = {"top_nodes": top_nodes, "total_ms": round(total_ms, 4), "runs": opts.runs}
    if top_nodes:
        head = top_nodes[0]
        notes = (
            f"profiled {len(mean_ms)} nodes over {opts.runs} runs: {total_ms:.3f} ms per run; "
            f"slowest {head['node']} ({head['op']}) {head['ms']:.3f} ms, {head['share']:.0%}"
        )
    else:
        notes = "profiled: the graph has no compute nodes"
    return PassResult(gm, False, notes)


def _op(gm: GraphModule, node: Node) -> str:
    """What the node runs: the aten op / function, a method name, or a module's class and path."""
    if node.op == "call_module":
        return f"{type(gm.get_submodule(target_name(node))).__name__}({node.target})"
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    target = node.target
    if hasattr(target, "_schema"):  # aten OpOverload: "aten.conv2d.default"
        return str(target)
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__name__", str(target))
    return f"{module}.{name}" if module and module not in ("builtins", "_operator") else name
