"""TorchScript archive from the transformed GraphModule (trace by default, script on request)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from torch.fx import GraphModule

from fxport.errors import ConversionFailed


class TorchScriptFromGraphModule:
    """Trace (or script) `gm`; `check_inputs` are other shapes the archive must also run at.

    Tracing an aten-level graph bakes sizes that torch.export kept symbolic (sym_size ints
    become constants), so the archive only runs at the example's batch size. When that
    happens and `fallback` (the original eager module) is given, the archive is traced from
    it instead and `self.note` says so: same function, without the graph passes applied.
    """

    def __init__(self, gm: GraphModule, example_inputs: tuple[Any, ...], method: str = "trace", *,
                 check_inputs: list[tuple[Any, ...]] = (), fallback: Any = None,
                 extra_files: dict[str, str] | None = None) -> None:
        self.gm, self.example_inputs, self.method = gm, example_inputs, method
        self.check_inputs, self.fallback = list(check_inputs), fallback
        self.extra_files = dict(extra_files or {})
        self.note = ""

    def __call__(self, path: Path) -> Path:
        self.script_module().save(str(path), _extra_files=self.extra_files)
        return path

    def script_module(self) -> Any:
        """The ScriptModule the archive holds (raises ConversionFailed, as `__call__` does)."""
        scripted = self._build(self.gm)
        if not self._runs_everywhere(scripted):
            if self.fallback is not None and not isinstance(self.fallback, GraphModule):
                scripted = self._build(self.fallback)
                self.note = ("traced from the original model: a trace of the transformed aten-level graph "
                             "fixes the batch size, so this archive does not carry the graph passes")
            if self.note == "" or not self._runs_everywhere(scripted):
                raise ConversionFailed(
                    "TorchScript tracing fixes this model's dynamic dims to the example's sizes, so the "
                    "archive would fail at the spec's other shapes",
                    stage="export",
                    hint="drop 'torchscript' from targets (the .pt2 and ONNX keep the dynamic dims), "
                    "use static shapes, or submit the model as a torch.package so it can be traced eagerly",
                )
        return scripted

    def _runs_everywhere(self, scripted: Any) -> bool:
        reference = self.gm
        for args in self.check_inputs:
            try:
                with torch.no_grad():
                    got, want = scripted(*args), reference(*args)
            except Exception:
                return False
            leaves = zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want))
            if any(a.shape != b.shape for a, b in leaves):
                return False
        return True

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
