"""Artifacts made from the eager model itself, for a model no capture rung turns into a graph.

Detection models (torchvision's Faster R-CNN and the like) fail symbolic_trace (Python control
flow on tensors) and torch.export (a data-dependent number of boxes), yet TorchScript's scripter
compiles their control flow and the TorchScript-based ONNX exporter (`dynamo=False`) exports them,
as their authors intend. Only TorchScript and ONNX can be made this way; a .pt2, FX source or a
TensorRT engine needs the graph. Every artifact made here is verified like any other: a trace
that recorded one path through the model's Python control flow fails that verification.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from fxport.errors import ConversionFailed
from fxport.workers.engine.exporters.onnx import check_onnx

LEGACY_ONNX_MAX_OPSET = 20  # torch.onnx's TorchScript-based exporter writes opsets up to this (torch 2.13)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:300]}" if text else type(exc).__name__


@contextlib.contextmanager
def _quiet_torchscript() -> Iterator[None]:
    """Every torch.jit call warns that TorchScript is deprecated; those warnings say nothing new here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", message=".*TorchScript.*")
        warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
        yield


class TorchScriptFromEagerModule:
    """`torch.jit.script` of the eager model (its control flow kept), else `torch.jit.trace`.

    The scripted module must also run on `check_inputs` (a model scripts but then fails on a
    type its annotations did not foresee); `note` says which way the archive was made."""

    def __init__(self, module: Any, example_inputs: tuple[Any, ...], *, check_inputs: Sequence[tuple[Any, ...]] = (),
                 extra_files: dict[str, str] | None = None) -> None:
        self.module, self.example_inputs = module, example_inputs
        self.check_inputs = list(check_inputs)
        self.extra_files = dict(extra_files or {})
        self.note = ""

    def __call__(self, path: Path) -> Path:
        scripted = self.script_module()
        with _quiet_torchscript():
            scripted.save(str(path), _extra_files=self.extra_files)
        return path

    def script_module(self) -> Any:
        try:
            scripted = self._script()
            self.note = "scripted from the eager model (torch.jit.script): its Python control flow is kept"
            return scripted
        except Exception as exc:
            script_error = _first_line(exc)
        try:
            with _quiet_torchscript(), torch.no_grad():
                traced = torch.jit.trace(self.module, self.example_inputs, check_trace=False, strict=False)
        except Exception as exc:
            raise ConversionFailed(
                f"TorchScript from the eager model failed: torch.jit.script: {script_error}; torch.jit.trace: "
                f"{_first_line(exc)}", stage="export",
                hint="make forward() scriptable (type annotations, no unsupported Python), or drop 'torchscript' "
                "from targets") from exc
        self.note = (f"traced from the eager model (torch.jit.script failed: {script_error}); a trace keeps "
                     "only the path the example took through Python control flow")
        return traced

    def _script(self) -> Any:
        with _quiet_torchscript(), torch.no_grad():
            scripted = torch.jit.script(self.module)
            for args in [self.example_inputs, *self.check_inputs]:
                scripted(*args)
        return scripted


class OnnxFromEagerModule:
    """The TorchScript-based ONNX exporter (`dynamo=False`) on the eager model, full checker pass.

    It traces the model as torchvision's detection models expect (their data-dependent parts use
    ops with ONNX symbolics, e.g. NonZero, TopK), with the spec's dynamic dims as dynamic axes."""

    def __init__(self, module: Any, example_inputs: tuple[Any, ...], *, input_names: list[str],
                 dynamic_axes: dict[str, dict[int, str]] | None = None, opset: int = 20,
                 single_file: bool = True) -> None:
        self.module, self.example_inputs = module, example_inputs
        self.input_names, self.dynamic_axes = input_names, dynamic_axes or {}
        self.opset, self.single_file = opset, single_file
        self.note = ""

    def __call__(self, path: Path) -> Path:
        if self.opset > LEGACY_ONNX_MAX_OPSET:
            raise ConversionFailed(
                f"ONNX from the eager model needs the TorchScript-based exporter, which writes opsets up to "
                f"{LEGACY_ONNX_MAX_OPSET}, not the {self.opset} asked for", stage="export",
                hint=f"set spec.onnx.opset to {LEGACY_ONNX_MAX_OPSET} or lower")
        log = io.StringIO()
        try:
            with warnings.catch_warnings(), contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
                warnings.simplefilter("ignore")
                torch.onnx.export(self.module, self.example_inputs, str(path), dynamo=False,
                                  opset_version=self.opset, input_names=self.input_names,
                                  dynamic_axes=self.dynamic_axes, external_data=not self.single_file)
        except Exception as exc:
            raise ConversionFailed(
                f"ONNX from the eager model (TorchScript-based exporter) failed: {_first_line(exc)}", stage="export",
                hint="drop 'onnx' from targets to get the other artifacts", detail=log.getvalue()[-4000:] or None,
            ) from exc
        self.note = ("exported from the eager model by the TorchScript-based exporter (dynamo=False), which "
                     "traces it: Python control flow keeps the example's path")
        return check_onnx(path, self.opset)
