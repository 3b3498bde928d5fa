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
        source = folder / "module.py"
        text = source.read_text()
        # to_folder writes absolute paths to the weight files beside module.py; the artifact is
        # downloaded elsewhere, so load them from the folder module.py is imported from.
        for prefix in {str(folder), str(folder.resolve())}:
            text = text.replace(f"torch.load(r'{prefix}/", "torch.load(_HERE + r'/")
        header = ["import os", "_HERE = os.path.dirname(os.path.abspath(__file__))", *self.imports]
        source.write_text("\n".join(header) + "\n" + text)
        return folder
