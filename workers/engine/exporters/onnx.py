"""ONNX from the transformed GraphModule: the torch.export-based exporter, full checker pass."""

from __future__ import annotations

import io
import logging
import contextlib
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.fx import GraphModule

from fxport.errors import ConversionFailed


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
    ) -> None:
        self.gm, self.example_inputs = gm, example_inputs
        self.input_names, self.dynamic_shapes = input_names, dynamic_shapes
        self.opset, self.single_file = opset, single_file

    def __call__(self, path: Path) -> Path:
        import onnx

        # the exporter logs a warning per missing torchvision op; not the user's concern
        logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
        log = io.StringIO()
        try:
            with warnings.catch_warnings(), contextlib.redirect_stdout(log):
                warnings.simplefilter("ignore")
                torch.onnx.export(
                    self.gm,
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
        except Exception as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConversionFailed(
                f"ONNX export failed: {type(exc).__name__}: {first}",
                stage="export",
                hint="drop 'onnx' from targets to get the other artifacts, or try another opset (spec.onnx.opset)",
                detail=log.getvalue()[-4000:] or None,
            ) from exc
        try:
            onnx.checker.check_model(str(path), full_check=True)
        except Exception as exc:
            raise ConversionFailed(f"the exported ONNX fails onnx.checker: {exc}", stage="export") from exc
        return path
