"""Graph passes: the runner over the one catalog in `fxport.pass_catalog.PASS_CATALOG`.

A pass is a plain function `(gm, options, ctx) -> PassResult`. It declares the IR levels
it works on in the catalog; on any other level the runner records `applied: false` with
the reason instead of calling it — never a silent no-op.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch.fx import GraphModule, Node

from fxport.errors import ConversionFailed
from fxport.pass_catalog import PASS_CATALOG
from fxport.spec import PassSpec

# Typed views of FX's broad `Node.target` / `Node.args` unions, for where the node's kind fixes the type.


def target_name(node: Node) -> str:
    """The name a get_attr / call_module / call_method node targets (FX types `target` as callable or str)."""
    return cast(str, node.target)


def target_fn(node: Node) -> Callable[..., Any]:
    """The callable a call_function node calls."""
    return cast("Callable[..., Any]", node.target)


def node_arg(node: Node, i: int) -> Node:
    """`node.args[i]` where the graph's form makes it a Node (an op's tensor input, a Q/DQ's source)."""
    return cast(Node, node.args[i])


@dataclass
class PassContext:
    """What a pass may know besides the graph: its IR level and sample inputs."""

    level: str  # "torch" (symbolic_trace) or "aten" (torch.export → ep.module())
    example_inputs: tuple[Any, ...] = ()
    # Shared scratch for passes that produce report data (e.g. profile_nodes → "profile").
    report: dict[str, Any] = field(default_factory=dict)


@dataclass
class PassResult:
    graph_module: GraphModule
    changed: bool
    notes: str = ""


def load_pass(name: str) -> Callable[..., PassResult]:
    module_name, func_name = PASS_CATALOG[name].function.split(":")
    return getattr(importlib.import_module(module_name), func_name)


def run_passes(gm: GraphModule, passes: list[PassSpec], ctx: PassContext) -> tuple[GraphModule, list[dict[str, Any]]]:
    """Apply `passes` in order. Returns the final module and one manifest record per pass."""
    records: list[dict[str, Any]] = []
    for spec in passes:
        info = PASS_CATALOG[spec.name]
        if ctx.level not in info.levels:
            records.append(
                {"name": spec.name, "applied": False, "changed": False,
                 "notes": f"not applied: works on {'/'.join(info.levels)} graphs, this graph is {ctx.level}-level"}
            )
            continue
        fn = load_pass(spec.name)
        opts = info.options.model_validate(spec.options)
        start = time.perf_counter()
        try:
            with torch.no_grad():
                result = fn(gm, opts, ctx)
        except Exception as exc:  # a pass bug must name the pass, not surface as a bare traceback
            raise ConversionFailed(
                f"pass {spec.name!r} failed: {type(exc).__name__}: {exc}",
                stage="passes",
                hint=f"drop {spec.name!r} from spec.passes to convert without it, and report the model",
            ) from exc
        gm = result.graph_module
        records.append(
            {"name": spec.name, "applied": True, "changed": bool(result.changed), "notes": result.notes,
             "seconds": round(time.perf_counter() - start, 4)}
        )
    return gm, records
