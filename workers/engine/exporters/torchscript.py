"""TorchScript archive from the transformed GraphModule (trace by default, script on request)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from torch.fx import GraphModule


class TorchScriptFromGraphModule:
    def __init__(self, gm: GraphModule, example_inputs: tuple[Any, ...], method: str = "trace") -> None:
        self.gm, self.example_inputs, self.method = gm, example_inputs, method

    def __call__(self, path: Path) -> Path:
        # every torch.jit call warns that TorchScript is deprecated; those warnings say nothing new here
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=DeprecationWarning)
            warnings.filterwarnings("ignore", message=".*TorchScript.*")
            warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
            with torch.no_grad():
                if self.method == "script":
                    scripted = torch.jit.script(self.gm)
                else:
                    scripted = torch.jit.trace(self.gm, self.example_inputs, check_trace=False, strict=False)
            scripted.save(str(path))
        return path
