"""`.pt2` (torch.export archive) of the transformed GraphModule, keeping the spec's dynamic dims."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.fx import GraphModule


def export_graph(gm: GraphModule, example_inputs: tuple[Any, ...], dynamic_shapes: Any) -> torch.export.ExportedProgram:
    """torch.export (non-strict) of a transformed graph, keeping the spec's dynamic dims."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.export.export(gm, example_inputs, dynamic_shapes=dynamic_shapes, strict=False)


class ExportedProgramFromGraphModule:
    """`program`: where the program comes from when another exporter of the same graph made it
    already (ExportJob.program); by default it is exported here."""

    def __init__(self, gm: GraphModule, example_inputs: tuple[Any, ...], dynamic_shapes: Any, *,
                 extra_files: dict[str, str] | None = None,
                 program: Callable[[], torch.export.ExportedProgram] | None = None) -> None:
        self.gm, self.example_inputs, self.dynamic_shapes = gm, example_inputs, dynamic_shapes
        self.extra_files = dict(extra_files or {})
        self._program = program

    def program(self) -> torch.export.ExportedProgram:
        if self._program is not None:
            return self._program()
        return export_graph(self.gm, self.example_inputs, self.dynamic_shapes)

    def __call__(self, path: Path) -> Path:
        torch.export.save(self.program(), str(path), extra_files=self.extra_files or None)
        return path
