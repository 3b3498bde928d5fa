"""`.pt2` (torch.export archive) of the transformed GraphModule, keeping the spec's dynamic dims."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from torch.fx import GraphModule


class ExportedProgramFromGraphModule:
    def __init__(self, gm: GraphModule, example_inputs: tuple[Any, ...], dynamic_shapes: Any, *,
                 extra_files: dict[str, str] | None = None) -> None:
        self.gm, self.example_inputs, self.dynamic_shapes = gm, example_inputs, dynamic_shapes
        self.extra_files = dict(extra_files or {})

    def program(self) -> torch.export.ExportedProgram:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.export.export(self.gm, self.example_inputs, dynamic_shapes=self.dynamic_shapes, strict=False)

    def __call__(self, path: Path) -> Path:
        torch.export.save(self.program(), str(path), extra_files=self.extra_files or None)
        return path
