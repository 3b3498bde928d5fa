"""TorchScript archive from the transformed GraphModule (trace by default, script on request)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.fx import GraphModule

from fxport.errors import ConversionFailed
from fxport.workers.engine.exporters.torchscript_script import ScriptingBlocked, script_graph_module


class TorchScriptFromGraphModule:
    """Trace (or script) `gm`; `check_inputs` are other shapes the archive must also run at.

    Tracing an aten-level graph bakes sizes that torch.export kept symbolic (sym_size ints
    become constants), so the archive only runs at the example's sizes. When that happens the
    graph's code is scripted instead (torchscript_script.py), which keeps `sym_size` a call and
    the graph passes applied. Where that fails too and `fallback` (the original eager model) is
    given, the archive is traced from it and `self.note` says so: same function, without the
    graph passes. Each candidate must run at every check input and agree there with `reference`
    (the original model's outputs, shared with verification) or, without one, with `gm`.
    """

    def __init__(self, gm: GraphModule, example_inputs: tuple[Any, ...], method: str = "trace", *,
                 check_inputs: Sequence[tuple[Any, ...]] = (), fallback: Any = None,
                 extra_files: dict[str, str] | None = None,
                 reference: Callable[[tuple[Any, ...]], list[torch.Tensor]] | None = None) -> None:
        self.gm, self.example_inputs, self.method = gm, example_inputs, method
        self.check_inputs, self.fallback = list(check_inputs), fallback
        # the original model's outputs at the check inputs, shared with verification (computed once);
        # without it the graph's own outputs are computed here
        self.reference = reference
        self.extra_files = dict(extra_files or {})
        self.note = ""
        self._expected: list[list[Any]] | None = None

    def __call__(self, path: Path) -> Path:
        self.script_module().save(str(path), _extra_files=self.extra_files)
        return path

    def script_module(self) -> Any:
        """The ScriptModule the archive holds (raises ConversionFailed, as `__call__` does)."""
        failures: list[str] = []
        for how, build, note in self._candidates():
            try:
                scripted = build()
            except ScriptingBlocked as exc:
                failures.append(f"{how} stops at {exc}")
                continue
            except Exception as exc:
                failures.append(f"{how} fails: {_first_line(exc)}")
                continue
            problem = self._mismatch(scripted)
            if problem is None:
                self.note = note
                return scripted
            failures.append(f"{how} {problem}")
        raise ConversionFailed(
            "no TorchScript form of this model runs at every shape the spec lists: " + "; ".join(failures),
            stage="export",
            hint="drop 'torchscript' from targets (the .pt2 and ONNX keep the dynamic dims), use static shapes, "
            "or submit the model as a torch.package so it can be traced eagerly",
        )

    def _candidates(self) -> list[tuple[str, Callable[[], Any], str]]:
        """(what it is, how to build it, the note it leaves), in the order tried."""
        out: list[tuple[str, Callable[[], Any], str]] = []
        if isinstance(self.gm, torch.jit.ScriptModule):
            out.append(("the TorchScript model", lambda: self.gm, ""))
        elif self.method == "script":
            out.append(("scripting the graph", lambda: script_graph_module(self.gm), ""))
        else:
            out.append(("tracing the graph", lambda: self._build(self.gm), ""))
            out.append(("scripting the graph", lambda: script_graph_module(self.gm),
                        "scripted from the graph: a trace of it fixes the dynamic dims to the example's sizes"))
        if self.fallback is not None and not isinstance(self.fallback, GraphModule):
            doing, done = ("scripting", "scripted") if self.method == "script" else ("tracing", "traced")
            out.append((f"{doing} the original model", lambda: self._build(self.fallback),
                        f"{done} from the original model: the transformed graph has no TorchScript form that runs "
                        "at every shape, so this archive does not carry the graph passes"))
        return out

    def _mismatch(self, scripted: Any) -> str | None:
        """What goes wrong running `scripted` at the check inputs: an error, or outputs that do not
        match the graph's (a size or a value baked in). None when it runs and agrees everywhere.
        A loose check of gross errors only: verification compares against eager precisely."""
        for args, want in zip(self.check_inputs, self._expected_outputs()):
            shapes = ", ".join(str(list(a.shape)) for a in args if isinstance(a, torch.Tensor))
            try:
                with torch.no_grad(), warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    got = torch.utils._pytree.tree_leaves(scripted(*args))
            except Exception as exc:
                return f"fails at inputs {shapes}: {_first_line(exc)}"
            if len(got) != len(want):
                return f"returns {len(got)} outputs at inputs {shapes}, the graph {len(want)}"
            for i, (a, b) in enumerate(zip(got, want)):
                if isinstance(b, torch.Tensor) and (not isinstance(a, torch.Tensor) or a.shape != b.shape):
                    got_shape = list(a.shape) if isinstance(a, torch.Tensor) else type(a).__name__
                    return f"gives output {i} shape {got_shape} at inputs {shapes}, the graph {list(b.shape)}"
                if isinstance(b, torch.Tensor) and not _close(a, b):
                    return f"gives output {i} other values than the graph at inputs {shapes} (a size baked in?)"
        return None

    def _expected_outputs(self) -> list[list[Any]]:
        """The reference's (or the graph's) outputs at the check inputs, computed once for every candidate."""
        if self._expected is None and self.reference is not None:
            self._expected = [self.reference(args) for args in self.check_inputs]
        if self._expected is None:
            self._expected = []
            for args in self.check_inputs:
                try:
                    with torch.no_grad(), warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        self._expected.append(torch.utils._pytree.tree_leaves(self.gm(*args)))
                except Exception as exc:
                    shapes = ", ".join(str(list(a.shape)) for a in args if isinstance(a, torch.Tensor))
                    raise ConversionFailed(
                        f"the graph itself fails at inputs {shapes}: {_first_line(exc)}", stage="export",
                        hint="check spec.dynamic_dims against the ranges the model was exported with",
                    ) from exc
        return self._expected

    def _build(self, module: Any) -> Any:
        # every torch.jit call warns that TorchScript is deprecated; those warnings say nothing new here
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=DeprecationWarning)
            warnings.filterwarnings("ignore", message=".*TorchScript.*")
            warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
            with torch.no_grad():
                if self.method == "script" or isinstance(module, torch.jit.ScriptModule):
                    return module if isinstance(module, torch.jit.ScriptModule) else torch.jit.script(module)
                return torch.jit.trace(module, self.example_inputs, check_trace=False, strict=False)


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Same values up to float noise: a baked size or branch differs grossly, a fused kernel does not.
    Integer and bool outputs (argmax, masks) are not compared: float noise can flip a near tie, and the
    eager model stands in for the transformed graph in the fallback."""
    if not want.is_floating_point():
        return True
    got, want = got.double(), want.double()
    scale = float(want.abs().nan_to_num(0.0, 0.0, 0.0).max()) if want.numel() else 0.0
    return torch.allclose(got, want, rtol=1e-2, atol=1e-2 * max(scale, 1.0), equal_nan=True)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")[:300]
