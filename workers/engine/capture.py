"""The capture ladder: turn a loaded model into an FX GraphModule, recording every rung tried.

Rungs, in order (docs/architecture.md, "The engine"): torch.fx.symbolic_trace (torch level, readable) →
torch.export non-strict → torch.export strict, then FX on `ep.module()` (aten level).
Most third-party models fail the first rung and pass the second: aten level is the common case.

When every rung fails on an nn.Module (`capture: auto`, fp32), the pipeline builds what it can from
the eager model instead (exporters/eager.py) and records it here as capture method "eager".
"""

from __future__ import annotations

import os
import traceback
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._ops import HigherOrderOperator
from torch.fx import Graph, GraphModule, Node, Proxy
from torch.fx.proxy import GraphAppendingTracer

from fxport.errors import CaptureFailed, InvalidInput
from fxport.workers.engine.inputs import InputSignature
from fxport.workers.engine.load import SHAPES_HINT, hint_for

_TORCH_DIR = os.path.dirname(torch.__file__)
_ENGINE_DIR = os.path.dirname(os.path.abspath(__file__))


@dataclass
class Captured:
    graph_module: GraphModule
    level: str  # "torch" | "aten"
    method: str  # "fx" | "export"
    attempts: list[dict[str, Any]] = field(default_factory=list)


def user_source_line(exc: BaseException) -> str | None:
    """The innermost traceback frame in the user's code (not torch, not fxport), as 'file:line: code'."""
    frames = traceback.extract_tb(exc.__traceback__)
    for frame in reversed(frames):
        fname = os.path.abspath(frame.filename)
        if fname.startswith(_TORCH_DIR) or fname.startswith(_ENGINE_DIR):
            continue
        filename = frame.filename
        if filename.startswith("<torch_package_"):  # code imported from a torch.package archive
            filename = filename.split(">.", 1)[-1]
        elif filename.startswith("<"):  # <stdin>, fx-generated <eval_with_key>
            continue
        code = (frame.line or "").strip()
        return f"{filename}:{frame.lineno}: {code}" if code else f"{filename}:{frame.lineno}"
    # torch.export puts the user's frame in the message text
    for line in str(exc).splitlines():
        line = line.strip()
        if line.startswith("File ") and ", line " in line and "/torch/" not in line:
            return line
    return None


def _reason(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {str(exc).strip()}"
    first = text.splitlines()[0] if text else type(exc).__name__
    return first[:500]


def probe_forward(module: Any, args: tuple[Any, ...], sig: InputSignature) -> None:
    """Run the eager model once so a shape the model can't take fails early, naming the input."""
    try:
        with torch.no_grad():
            module(*args)
    except Exception as exc:
        where = user_source_line(exc)
        shapes = ", ".join(f"{i.name}{list(a.shape)}" for i, a in zip(sig.inputs, args))
        raise InvalidInput(
            f"the model fails on inputs {shapes}: {_reason(exc)}" + (f" (at {where})" if where else ""),
            stage="capture",
            field="inputs",
            hint=hint_for(exc, SHAPES_HINT),
        ) from exc


def capture_ladder(loaded: Any, sig: InputSignature, mode: str = "auto") -> Captured:
    """Capture `loaded.module` as an FX graph. `mode`: auto (the ladder) | fx | export."""
    if loaded.format == "torch_export":
        # The archive already is an export graph: that rung ran on the user's machine.
        return Captured(
            graph_module=fx_from_exported(loaded.exported_program, loaded.module), level="aten", method="export",
            attempts=[{"method": "export", "ok": True,
                       "note": "input is a torch.export archive; graph used as exported"}],
        )
    module = loaded.module
    args = sig.make_inputs(sig.export_point(), seed=0)
    probe_forward(module, args, sig)
    attempts: list[dict[str, Any]] = []

    rungs: list[tuple[str, bool | None]] = []
    if mode in ("auto", "fx"):
        rungs.append(("fx", None))
    if mode in ("auto", "export"):
        rungs += [("export", False), ("export", True)]

    for method, strict in rungs:
        try:
            if method == "fx":
                gm = _symbolic_trace(module)
                _check_same(gm, module, args)
                attempts.append({"method": "fx", "ok": True})
                return Captured(gm, "torch", "fx", attempts)
            gm = _export(module, args, sig, strict=bool(strict))
            attempts.append({"method": "export", "strict": strict, "ok": True})
            return Captured(gm, "aten", "export", attempts)
        except Exception as exc:
            record: dict[str, Any] = {"method": method, "ok": False, "error": _reason(exc)}
            if strict is not None:
                record["strict"] = strict
            where = user_source_line(exc)
            if where:
                record["source_line"] = where
            attempts.append(record)

    summary = "; ".join(
        f"{a['method']}{' (strict)' if a.get('strict') else ''}: {a['error']}"
        + (f" at {a['source_line']}" if a.get("source_line") else "")
        for a in attempts
    )
    err = CaptureFailed(
        f"no capture method could turn the model into a graph — {summary}",
        stage="capture",
        hint="make the failing line traceable (torch.cond for data-dependent branches, no Python side effects "
        "in forward), or submit a .pt2 you exported yourself",
    )
    err.attempts = attempts  # type: ignore[attr-defined]
    raise err


def eager_fallback_blocker(loaded: Any, mode: str, precision: str, targets: Sequence[str]) -> str | None:
    """Why a model no rung could capture cannot be built from its eager form instead (None: it can).

    Only the ladder (`capture: auto`) falls back: a forced rung is a request for that graph. The
    eager path makes fp32 TorchScript and ONNX only: quantization works on a graph."""
    from fxport.workers.engine.exporters.registry import REGISTRY

    eager_targets = [name for name, target in REGISTRY.items() if target.from_eager is not None]

    if mode != "auto":
        return f"capture: {mode} asks for that graph; with capture: auto fxport would build from the eager model"
    if loaded.format == "torch_export" or not isinstance(loaded.module, torch.nn.Module):
        return "the model is not an eager nn.Module"
    if precision != "fp32":
        return (f"precision {precision} needs a graph to quantize; with precision fp32 fxport builds TorchScript "
                "and ONNX from the eager model")
    if not any(t in eager_targets for t in targets):
        return f"only {' and '.join(eager_targets)} can be built without a graph, and the spec asks for neither"
    return None


def short_capture_reason(failure: CaptureFailed) -> str:
    """The most telling rung's failure in one line: torch.export's (non-strict) when it ran, where it
    names the data-dependent expression and the user's line; every rung is in capture.attempts."""
    attempts = [a for a in getattr(failure, "attempts", []) if not a.get("ok")]
    if not attempts:
        return failure.message
    pick = next((a for a in attempts if a["method"] == "export"), attempts[0])
    where = f" at {pick['source_line']}" if pick.get("source_line") else ""
    label = "torch.export" if pick["method"] == "export" else "symbolic_trace"
    return f"{label}: {pick['error']}{where}"


def eager_capture_record(failure: CaptureFailed) -> dict[str, Any]:
    """The manifest's capture record when the artifacts come from the eager model: every rung
    tried (as the ladder recorded them) and why none gave a graph."""
    return {
        "method": "eager", "level": "eager", "attempts": list(getattr(failure, "attempts", [])),
        "reason": failure.message,
        "note": "no graph could be captured: TorchScript and ONNX were built from the eager model, the graph "
                "passes were skipped, and targets that need a graph were not built",
    }


def _symbolic_trace(module: Any) -> GraphModule:
    if isinstance(module, torch.jit.ScriptModule):
        raise TypeError("a TorchScript module cannot be symbolically traced")
    return torch.fx.symbolic_trace(module)


def _check_same(gm: GraphModule, module: Any, args: tuple[Any, ...]) -> None:
    # symbolic_trace can succeed yet bake in a branch or a shape; catch that at once.
    with torch.no_grad():
        ref, got = module(*args), gm(*args)
    ref_leaves = torch.utils._pytree.tree_leaves(ref)
    got_leaves = torch.utils._pytree.tree_leaves(got)
    if len(ref_leaves) != len(got_leaves) or any(
        isinstance(a, torch.Tensor) and (a.shape != b.shape or not torch.allclose(a, b, atol=1e-5, rtol=1e-4))
        for a, b in zip(ref_leaves, got_leaves)
    ):
        raise RuntimeError("the traced graph computes different outputs than the model (a baked-in branch?)")


def _export(module: Any, args: tuple[Any, ...], sig: InputSignature, *, strict: bool) -> GraphModule:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if isinstance(module, torch.jit.ScriptModule):
            from torch._export.converter import TS2EPConverter

            ep = TS2EPConverter(module, args).convert()
            module = ep.module()
        ep = torch.export.export(module, args, dynamic_shapes=sig.dynamic_shapes(), strict=strict)
    return fx_from_exported(ep)


def fx_from_exported(ep: Any, unlifted: Any = None) -> GraphModule:
    """A plain aten-level GraphModule of an exported program, its nodes' metadata kept.

    `ep.module()` itself carries pytree specs and a local guard function that can't be
    pickled (to_folder fails). The result is built from `ep.module()`'s own graph, copied
    node by node, so every node keeps what export recorded (`val` with its symbolic shapes,
    `tensor_meta`, `stack_trace`, `nn_module_stack`: the passes read them), with flat
    placeholders, the guards inlined as torch._assert nodes and the outputs in the
    program's structure — what `torch.fx.symbolic_trace(ep.module())` gives, minus the
    metadata it drops, in time linear in the graph's size.
    `unlifted`: an `ep.module()` the caller already has (the loader's), reused instead of
    unlifting again: copying does not change it, and the passes never write into its tensors
    (passes/graph_attrs.py).
    """
    module = unlifted if unlifted is not None else ep.module()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if not any(isinstance(n.target, HigherOrderOperator) for n in module.graph.nodes):
            try:
                return _copy_unlifted(module)
            except Exception:
                pass  # inputs or outputs in a structure the copy does not rebuild: re-trace as before
        try:
            return torch.fx.symbolic_trace(module)
        except Exception:
            # higher-order ops (torch.cond) refuse Proxy operands: keep the unlifted module as is
            return module


def _copy_unlifted(module: GraphModule) -> GraphModule:
    """`module`'s graph (an `ep.module()`) as a plain GraphModule: the node-for-node copy of
    what re-tracing it records, the nodes' metadata kept. Flat positional inputs only."""
    placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
    in_spec, out_spec = module._in_spec, module._out_spec
    if out_spec is None or pytree.tree_unflatten(list(range(in_spec.num_leaves)), in_spec) != (
            tuple(range(len(placeholders))), {}):
        raise ValueError("the program's inputs are not flat positional tensors")
    graph = Graph(tracer_cls=torch.fx.Tracer)
    tracer = GraphAppendingTracer(graph)
    env = {node: graph.node_copy(node) for node in placeholders}  # first, as a traced graph has them
    for node in module.graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "call_module" and node.target == "_guards_fn":
            # the input checks export recorded, run on proxies: torch._assert nodes, as re-tracing makes
            module.get_submodule("_guards_fn")(*(Proxy(env[a], tracer) if isinstance(a, Node) else a
                                                 for a in node.args))
        elif node.op == "output":
            flat = [Proxy(env[a], tracer) if isinstance(a, Node) else a for a in node.args[0]]
            graph.output(tracer.create_arg(pytree.tree_unflatten(flat, out_spec)))
        else:
            env[node] = graph.node_copy(node, env.__getitem__)
    for node in list(graph.nodes):
        if node.op == "get_attr" and not node.users:  # num_batches_tracked: fetched, never read
            graph.erase_node(node)
    return GraphModule(module, graph, class_name=type(module).__name__)
