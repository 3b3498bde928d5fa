"""ONNX from the transformed GraphModule, full checker pass.

Opset 18 and up: the torch.export-based exporter. Below 18, which that exporter cannot write
(it falls back to onnx's version converter, whose downgrades are partial: measured on torch 2.13,
a ResNet's ReduceMean kept an opset-18 attribute and the file silently stayed at opset 18), the
TorchScript-based exporter writes the opset asked for from a trace of the graph, and names the
op that needs a newer opset when there is one."""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.fx import GraphModule

from fxport.errors import ConversionFailed

TORCH_EXPORT_MIN_OPSET = 18


class OnnxFromGraphModule:
    def __init__(
        self,
        gm: GraphModule,
        example_inputs: tuple[Any, ...],
        *,
        input_names: list[str],
        dynamic_shapes: Any,
        opset: int = 20,
        single_file: bool = True,
        dynamic_axes: dict[str, dict[int, str]] | None = None,
        trace_checks: Sequence[tuple[Any, ...]] = (),
        trace_fallback: Any = None,
        trace_reference: Callable[[tuple[Any, ...]], list[torch.Tensor]] | None = None,
        program: Callable[[], torch.export.ExportedProgram] | None = None,
    ) -> None:
        self.gm, self.example_inputs = gm, example_inputs
        self.input_names, self.dynamic_shapes = input_names, dynamic_shapes
        self.opset, self.single_file = opset, single_file
        # below opset 18 only: the dynamic dims by input, and what the trace must run at (see torchscript.py)
        self.dynamic_axes, self.trace_checks = dynamic_axes or {}, list(trace_checks)
        self.trace_fallback, self.trace_reference = trace_fallback, trace_reference
        # the graph's torch.export program when another exporter shares it (ExportJob.program)
        self.program = program
        self.note = ""

    def __call__(self, path: Path) -> Path:

        if self.opset < TORCH_EXPORT_MIN_OPSET:
            self._export_from_trace(path)
            return self._checked(path)

        from fxport.workers.engine.exporters import onnx_ready
        from fxport.workers.engine.warm_caches import cache_onnx_registry

        cache_onnx_registry()  # the exporter's op registry, built once per process and opset
        readied = onnx_ready.install()  # its decomposition, only where the program needs one
        # the exporter logs a warning per missing torchvision op; not the user's concern
        logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
        log = io.StringIO()
        model: Any = self.gm
        if self.program is not None:
            try:  # the .pt2's program, exported once; the exporter's own ways are left for when it fails
                model = self.program()
            except Exception:
                model = self.gm
        if readied is not None:
            readied.reset()
        try:
            program = self._export(model, path, log)
        except Exception as exc:
            if readied is None or not readied.handed_over:
                raise self._failed(exc, log) from exc
            # the program fxport readied did not translate: the exporter's own decomposition, as before
            logging.getLogger(__name__).warning("ONNX export: the readied program failed (%s: %s); decomposing it",
                                                type(exc).__name__, str(exc).strip()[:300])
            try:
                with readied.off():
                    program = self._export(model, path, log)
            except Exception as again:
                raise self._failed(again, log) from again
        # the opset the exporter wrote, from its own model: reading it from the file would parse
        # the whole file again, after the checker's own parse
        written = getattr(getattr(program, "model", None), "opset_imports", {}).get("")
        return self._checked(path, written if isinstance(written, int) else None)

    def _export(self, model: Any, path: Path, log: io.StringIO) -> Any:
        with warnings.catch_warnings(), contextlib.redirect_stdout(log):
            warnings.simplefilter("ignore")
            return torch.onnx.export(
                model,
                self.example_inputs,
                str(path),
                dynamo=True,
                input_names=self.input_names,
                dynamic_shapes=self.dynamic_shapes,
                opset_version=self.opset,
                external_data=not self.single_file,
                optimize=True,
                verbose=False,
            )

    @staticmethod
    def _failed(exc: Exception, log: io.StringIO) -> ConversionFailed:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return ConversionFailed(
            f"ONNX export failed: {type(exc).__name__}: {first}",
            stage="export",
            hint="drop 'onnx' from targets to get the other artifacts, or try another opset (spec.onnx.opset)",
            detail=log.getvalue()[-4000:] or None,
        )

    def _checked(self, path: Path, written_opset: int | None = None) -> Path:
        return check_onnx(path, self.opset, written_opset, single_file=self.single_file, notes=self._notes)

    def _notes(self, note: str) -> None:
        self.note = f"{self.note}; {note}" if self.note else note

    def _export_from_trace(self, path: Path) -> None:
        from fxport.workers.engine.exporters.torchscript import TorchScriptFromGraphModule

        tracer = TorchScriptFromGraphModule(self.gm, self.example_inputs, "trace", check_inputs=self.trace_checks,
                                            fallback=self.trace_fallback, reference=self.trace_reference)
        scripted = tracer.script_module()
        self.note = tracer.note
        log = io.StringIO()
        try:
            with warnings.catch_warnings(), contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
                warnings.simplefilter("ignore")
                torch.onnx.export(scripted, self.example_inputs, str(path), dynamo=False, opset_version=self.opset,
                                  input_names=self.input_names, dynamic_axes=self.dynamic_axes,
                                  external_data=not self.single_file)
        except Exception as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConversionFailed(
                f"ONNX export at opset {self.opset} failed: {first}", stage="export",
                hint=f"raise spec.onnx.opset (from {TORCH_EXPORT_MIN_OPSET} the torch.export-based exporter writes it)",
            ) from exc


# What one ONNX file can hold: a protobuf message is limited to 2 GiB.
PROTOBUF_LIMIT = 2 << 30


def as_one_file(path: Path, limit: int = PROTOBUF_LIMIT) -> str | None:
    """Keep `spec.onnx.single_file`: torch's exporter moves the weights to an external data file
    past about 1.5 GB whatever it is asked. Such weights are put back into the model file while
    they fit in one protobuf (`limit`); past it the export fails, naming the limit and the way out.
    Returns a note for the manifest when the file was rewritten, else None."""
    import onnx
    from onnx.external_data_helper import uses_external_data

    model = onnx.load(str(path), load_external_data=False)
    external = [t for t in model.graph.initializer if uses_external_data(t)]
    if not external:
        return None
    files = {path.parent / e.value for t in external for e in t.external_data if e.key == "location"}
    size = sum(f.stat().st_size for f in files if f.is_file())
    if size + model.ByteSize() >= limit:
        raise ConversionFailed(
            f"the ONNX model's weights are {size} bytes: one ONNX file holds at most {limit} bytes (protobuf's "
            "limit), and spec.onnx.single_file is true", stage="export",
            hint="set onnx.single_file: false to get model.onnx with its weights in an external data file beside it")
    onnx.load_external_data_for_model(model, str(path.parent))
    onnx.save_model(model, str(path), save_as_external_data=False)
    for f in files:
        f.unlink(missing_ok=True)
    return (f"the exporter wrote {size} bytes of weights to an external data file; they were put back into "
            "model.onnx (spec.onnx.single_file)")


def check_onnx(path: Path, opset: int, written_opset: int | None = None, *, single_file: bool = False,
               notes: Callable[[str], None] | None = None) -> Path:
    """onnx.checker's full check, and the opset asked for (`written_opset`: the one the exporter
    says it wrote; read from the file when None). `single_file`: the weights in model.onnx itself
    (as_one_file; what it did goes to `notes`). Raises ConversionFailed."""
    import onnx

    if single_file:
        note = as_one_file(path)
        if note is not None and notes is not None:
            notes(note)

    try:
        onnx.checker.check_model(str(path), full_check=True)
    except Exception as exc:
        raise ConversionFailed(f"the exported ONNX fails onnx.checker: {exc}", stage="export") from exc
    got = written_opset if written_opset is not None else next(
        (o.version for o in onnx.load(str(path), load_external_data=False).opset_import
         if o.domain in ("", "ai.onnx")), None)
    if got != opset:
        raise ConversionFailed(f"the ONNX model came out at opset {got}, not the {opset} asked for",
                               stage="export", hint=f"use spec.onnx.opset {got}")
    return path
