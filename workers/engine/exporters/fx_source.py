"""Readable, editable FX Python source of the transformed graph (GraphModule.to_folder)."""

from __future__ import annotations

from pathlib import Path

from torch.fx import GraphModule

MODULE_CLASS = "FxportModule"


class FxSourceFromGraphModule:
    """`imports`: extra import lines module.py needs (an int8 graph's Q/DQ op library)."""

    def __init__(self, gm: GraphModule, imports: tuple[str, ...] = ()) -> None:
        self.gm, self.imports = gm, imports

    def __call__(self, folder: Path) -> Path:
        # to_folder writes module.py (the code), __init__.py and the weights beside them.
        # It emits type annotations (x : _torch_Tensor_) without importing their names, so the
        # source would not import: drop the annotations, they carry no semantics here.
        for node in self.gm.graph.nodes:
            node.type = None
        self.gm.recompile()
        self.gm.to_folder(str(folder), module_name=MODULE_CLASS)
        if self.imports:
            source = folder / "module.py"
            source.write_text("\n".join(self.imports) + "\n" + source.read_text())
        return folder
