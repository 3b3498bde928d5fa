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
import os
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
                # weights beside the model, always: one file is then written a tensor at a time (as_one_file),
                # where torch's own one-file save holds about three more copies of them in memory
                external_data=True,
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
        return check_onnx(path, self.opset, written_opset)

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


def as_one_file(path: Path, limit: int | None = None) -> int:
    """Keep `spec.onnx.single_file`: put weights the exporter wrote to external data files back into
    model.onnx, while they fit in one protobuf (`limit`); past it the export fails, naming the limit
    and the way out. Returns the bytes put back (0: the model was one file already).

    Streamed: the model without its weights, then each weight as a message of its own holding just
    that tensor, its bytes copied from the data file to model.onnx by the kernel. Protobuf merges
    such messages when it reads the file (an embedded message's repeated fields concatenate, in
    order), so the file reads back as the model `onnx.save` would write, while no weight is ever in
    this process's memory (a one-file save holds the model and its serialized bytes: about three
    times the weights, measured in bench/bench_model_bytes.py)."""
    import onnx
    from onnx.external_data_helper import ExternalDataInfo, uses_external_data

    model = onnx.load(str(path), load_external_data=False)
    initializers = list(model.graph.initializer)
    places = {id(t): ExternalDataInfo(t) for t in initializers if uses_external_data(t)}
    if not places:  # torch writes its data file even when every tensor stayed inside (then empty)
        path.with_name(path.name + ".data").unlink(missing_ok=True)
        return 0
    files = {info.location for info in places.values()}
    if any(Path(name).name != name or name in ("", ".", "..") for name in files) or _external_elsewhere(model):
        raise ConversionFailed(f"the ONNX exporter wrote its weights where fxport does not read them: {sorted(files)}",
                               stage="export", hint="set onnx.single_file: false")
    sizes = {name: (path.parent / name).stat().st_size for name in files}
    refuse_past_one_protobuf(sum(sizes.values()) + model.ByteSize(), limit)
    del model.graph.initializer[:]
    one_file = path.with_name(f".{path.name}.one")
    put_back = 0
    with open(one_file, "wb") as out:
        out.write(model.SerializeToString())
        for tensor in initializers:
            info = places.get(id(tensor))
            if info is None:
                out.write(_as_initializer(tensor.SerializeToString(), 0))
                continue
            offset = info.offset or 0
            length = info.length if info.length is not None else sizes[info.location] - offset
            meta = onnx.TensorProto()
            meta.CopyFrom(tensor)
            for name in ("external_data", "data_location", "raw_data"):
                meta.ClearField(name)
            out.write(_as_initializer(meta.SerializeToString() + _field(9, length), length))  # 9: raw_data
            out.flush()
            with open(path.parent / info.location, "rb") as data:
                _copy_range(data.fileno(), out.fileno(), offset, length)
            put_back += length
    os.replace(one_file, path)
    for name in files:
        (path.parent / name).unlink(missing_ok=True)
    return put_back


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, length: int) -> bytes:
    """The key and length of a length-delimited field (wire type 2) whose `length` bytes follow."""
    return _varint(number << 3 | 2) + _varint(length)


def _as_initializer(tensor_head: bytes, rest: int) -> bytes:
    """ModelProto.graph (7) → GraphProto.initializer (5) around one TensorProto of len(tensor_head) + `rest` bytes,
    `rest` of which the caller writes after this."""
    tensor = len(tensor_head) + rest
    initializer = _field(5, tensor)
    return _field(7, len(initializer) + tensor) + initializer + tensor_head


def _copy_range(src: int, dst: int, offset: int, length: int) -> None:
    """`length` bytes of the file `src` from `offset`, appended to `dst` (in the kernel where it can)."""
    while length > 0:
        try:
            done = os.copy_file_range(src, dst, length, offset)
        except OSError:  # a filesystem or kernel without it: through a buffer
            chunk = os.pread(src, min(length, 64 << 20), offset)
            with open(dst, "ab", closefd=False) as out:
                out.write(chunk)
            done = len(chunk)
        if done == 0:
            raise ConversionFailed("an ONNX external data file ended before its tensor did", stage="export")
        offset, length = offset + done, length - done


def _external_elsewhere(model: Any) -> bool:
    """Whether a tensor other than a top-level initializer (a node's attribute, a subgraph's) has
    external data: torch's exporter externalizes initializers only, and as_one_file writes those."""
    from onnx.external_data_helper import _get_all_tensors, uses_external_data

    top = {id(t) for t in model.graph.initializer}
    return any(uses_external_data(t) and id(t) not in top for t in _get_all_tensors(model))


def weight_bytes(module: Any) -> int:
    """The bytes of a module's parameters and buffers, each storage once: a lower bound of what its
    ONNX model's weights come to (tensor constants are left out; as_one_file counts them all)."""
    seen: dict[int, int] = {}
    for tensor in [*module.parameters(), *module.buffers()]:
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def refuse_past_one_protobuf(size: int, limit: int | None = None) -> None:
    limit = PROTOBUF_LIMIT if limit is None else limit
    if size >= limit:
        raise ConversionFailed(
            f"the ONNX model's weights are {size} bytes: one ONNX file holds at most {limit} bytes (protobuf's "
            "limit), and spec.onnx.single_file is true", stage="export",
            hint="set onnx.single_file: false to get model.onnx with its weights in an external data file beside it")


def check_onnx(path: Path, opset: int, written_opset: int | None = None) -> Path:
    """onnx.checker's full check, and the opset asked for (`written_opset`: the one the exporter
    says it wrote; read from the file when None). Raises ConversionFailed. (The weights may still be
    beside the model: publish.export_one puts them into it, as_one_file, once the model is final.)"""
    import onnx


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
