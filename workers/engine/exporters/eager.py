"""Artifacts made from the eager model itself, for a model no capture rung turns into a graph.

Detection models (torchvision's Faster R-CNN and the like) fail symbolic_trace (Python control
flow on tensors) and torch.export (a data-dependent number of boxes), yet TorchScript's scripter
compiles their control flow, and the TorchScript-based ONNX exporter (`dynamo=False`) writes the
scripted model's loops and branches as ONNX Loop and If nodes (a trace of the model where scripting
or that export fails). Only TorchScript and ONNX can be made this way; a .pt2, FX source or a
TensorRT engine needs the graph. Every artifact made here is verified like any other: a trace
that recorded one path through the model's Python control flow fails that verification.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fxport.errors import ConversionFailed
from fxport.spec import VerifyOptions
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


def script_eager(module: Any, example_inputs: tuple[Any, ...], check_inputs: Sequence[tuple[Any, ...]] = ()) -> Any:
    """`torch.jit.script` of the eager model, run once on the example and on each of `check_inputs`
    (a model may script and then fail on a type its annotations did not foresee). Raises what they raise."""
    with _quiet_torchscript(), torch.no_grad():
        scripted = torch.jit.script(module)
        for args in [example_inputs, *check_inputs]:
            scripted(*args)
    return scripted


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
            scripted = script_eager(self.module, self.example_inputs, self.check_inputs)
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



class OnnxFromEagerModule:
    """ONNX by the TorchScript-based exporter (`dynamo=False`), full checker pass: from the model
    scripted, else from a trace of it.

    The scripted model keeps its Python control flow, and the exporter writes it as ONNX `Loop`
    and `If` nodes: a greedy NMS `while` loop runs as many times as each input needs. A trace keeps
    the example's path (its number of loop iterations, its side of a branch), though torchvision's
    detection models are written to be traced (their data-dependent parts use ops with ONNX
    symbolics, e.g. NonZero, TopK). So the scripted model goes first, and its ONNX must run in
    onnxruntime on the example and on `check_inputs` and, given `reference` (the eager model's
    outputs) and `verify` (the tolerances), match there as verification compares (detections as
    sets). Where scripting, exporting, running or matching fails, the trace is exported instead
    and `note` says why (the manifest's warnings). Either way the verify stage checks the model
    against the eager one at every sample: a trace that kept one path fails there, never ships."""

    def __init__(self, module: Any, example_inputs: tuple[Any, ...], *, input_names: list[str],
                 dynamic_axes: dict[str, dict[int, str]] | None = None, opset: int = 20,
                 single_file: bool = True, check_inputs: Sequence[tuple[Any, ...]] = (),
                 reference: Callable[[tuple[Any, ...]], list[torch.Tensor]] | None = None,
                 verify: VerifyOptions | None = None) -> None:
        self.module, self.example_inputs = module, example_inputs
        self.input_names, self.dynamic_axes = input_names, dynamic_axes or {}
        self.opset, self.single_file = opset, single_file
        self.check_inputs = list(check_inputs)
        self.reference, self.verify = reference, verify
        self.note = ""

    def __call__(self, path: Path) -> Path:
        if self.opset > LEGACY_ONNX_MAX_OPSET:
            raise ConversionFailed(
                f"ONNX from the eager model needs the TorchScript-based exporter, which writes opsets up to "
                f"{LEGACY_ONNX_MAX_OPSET}, not the {self.opset} asked for", stage="export",
                hint=f"set spec.onnx.opset to {LEGACY_ONNX_MAX_OPSET} or lower")
        why_traced = self._from_scripted(path)
        if why_traced is None:
            return check_onnx(path, self.opset)
        log = io.StringIO()
        try:
            self._export(self.module, path, log)
        except Exception as exc:
            raise ConversionFailed(
                f"ONNX from the eager model (TorchScript-based exporter) failed: {why_traced}; the trace: "
                f"{_first_line(exc)}", stage="export",
                hint="drop 'onnx' from targets to get the other artifacts", detail=log.getvalue()[-4000:] or None,
            ) from exc
        self.note = (f"traced from the eager model by the TorchScript-based exporter (dynamo=False), as {why_traced}: "
                     "a trace keeps the example's path through Python control flow (its loop counts, its branches)")
        return check_onnx(path, self.opset)

    def _from_scripted(self, path: Path) -> str | None:
        """The ONNX model of the scripted model at `path`, run and matched; None when it is there, else why not."""
        try:
            scripted = script_eager(self.module, self.example_inputs, self.check_inputs)
        except Exception as exc:
            return f"torch.jit.script failed: {_first_line(exc)}"
        try:
            self._export(scripted, path, io.StringIO())
        except Exception as exc:
            return f"exporting the scripted model failed: {_first_line(exc)}"
        inputs = [self.example_inputs, *self.check_inputs]
        try:
            outputs = _run_in_onnxruntime(path, inputs)
        except Exception as exc:
            return f"the ONNX model of the scripted model does not run in onnxruntime: {_first_line(exc)}"
        mismatch = self._mismatch(inputs, outputs)
        if mismatch:
            return f"the ONNX model of the scripted model does not match the eager model: {mismatch}"
        kept = _control_flow(path)
        self.note = ("exported from the eager model scripted (torch.jit.script, then the TorchScript-based exporter): "
                     f"its Python control flow is kept{f' ({kept})' if kept else ''}")
        return None

    def _mismatch(self, inputs: list[tuple[Any, ...]], outputs: list[list[np.ndarray]]) -> str:
        """How the outputs differ from the eager model's at the first input where they do ('' when
        they match everywhere, or without a reference), compared as the verify stage compares them."""
        if self.reference is None or self.verify is None:
            return ""
        from fxport.workers.engine.verify.comparator import compare_outputs, plan_outputs

        expected = [[np.asarray(t.detach().cpu()) for t in self.reference(args)] for args in inputs]
        layout = plan_outputs(expected, None)
        for want, got in zip(expected, outputs):
            found = compare_outputs(want, got, self.verify, layout)
            if not found["passed"]:
                return str(found.get("error") or found.get("mismatch") or "outputs differ")[:300]
        return ""

    def _export(self, model: Any, path: Path, log: io.StringIO) -> None:
        with warnings.catch_warnings(), contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            warnings.simplefilter("ignore")
            torch.onnx.export(model, self.example_inputs, str(path), dynamo=False,
                              opset_version=self.opset, input_names=self.input_names,
                              dynamic_axes=self.dynamic_axes, external_data=not self.single_file)


def _run_in_onnxruntime(path: Path, inputs: Sequence[tuple[Any, ...]]) -> list[list[np.ndarray]]:
    """The ONNX model at `path` run on every input, its outputs as verification reads them."""
    from fxport.workers.engine.verify.runners import OnnxRuntimeRunner

    with OnnxRuntimeRunner(path) as runner:
        return [runner.infer(args) for args in inputs]


def _control_flow(path: Path) -> str:
    """The ONNX model's control flow in words ("1 Loop node and 2 If nodes"), '' when it has none."""
    import onnx

    counts: dict[str, int] = {}
    for node in _all_nodes(onnx.load(str(path), load_external_data=False).graph):
        if node.op_type in ("Loop", "If", "Scan"):
            counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return " and ".join(f"{n} {op} node{'s' if n > 1 else ''}" for op, n in sorted(counts.items()))


def _all_nodes(graph: Any) -> Iterator[Any]:
    """Every node of an ONNX graph, those of its Loop and If bodies included."""
    for node in graph.node:
        yield node
        for attr in node.attribute:
            for sub in [attr.g] if attr.HasField("g") else list(attr.graphs):
                yield from _all_nodes(sub)
