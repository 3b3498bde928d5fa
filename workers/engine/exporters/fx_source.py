"""Readable, editable FX Python source of the transformed graph (GraphModule.to_folder)."""

from __future__ import annotations

from pathlib import Path

from torch.fx import GraphModule

MODULE_CLASS = "FxportModule"


class FxSourceFromGraphModule:
    def __init__(self, gm: GraphModule) -> None:
        self.gm = gm

    def __call__(self, folder: Path) -> Path:
        # to_folder writes module.py (the code), __init__.py and the weights beside them.
        # It emits type annotations (x : _torch_Tensor_) without importing their names, so the
        # source would not import: drop the annotations, they carry no semantics here.
        for node in self.gm.graph.nodes:
            node.type = None
        self.gm.recompile()
        self.gm.to_folder(str(folder), module_name=MODULE_CLASS)
        return folder
