"""Models written as source files on no sys.path and packaged with torch.package (their code
interned): what a user uploads when the model's code is their own. Its module is then
`<torch_package_N>.NAME`, which no other process can import by name."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
import warnings
from pathlib import Path

TRACEABLE = textwrap.dedent('''
    """Conv, BatchNorm, Linear: every capture method follows it."""
    import torch
    from torch import nn


    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3, padding=1)
            self.bn = nn.BatchNorm2d(4)
            self.fc = nn.Linear(4, 2)

        def forward(self, x):
            return self.fc(torch.relu(self.bn(self.conv(x))).mean(dim=(2, 3)))
''')

UNTRACEABLE = textwrap.dedent('''
    """A Python branch on a tensor's value: no capture method can follow it."""
    import torch
    from torch import nn


    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            y = self.fc(x)
            if y.sum() > 0:  # decided by the values, in Python
                return y * 2
            return y - 1
''')


def package_model(source: str, name: str, folder: Path) -> Path:
    """folder/NAME.pkg: an eval() instance of `Model` from `source`, its code interned as module NAME."""
    import torch
    from torch.package import PackageExporter

    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.py").write_text(source)
    spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # for the exporter to find the class it pickles; gone again below
    try:
        spec.loader.exec_module(module)
        torch.manual_seed(0)
        with PackageExporter(str(folder / f"{name}.pkg")) as exporter, warnings.catch_warnings():
            warnings.filterwarnings("ignore", "TypedStorage is deprecated")  # torch.package's own call
            exporter.extern(["torch.**"])
            exporter.intern(name)
            exporter.save_pickle("model", "model.pkl", module.Model().eval())
    finally:
        sys.modules.pop(name, None)
    return folder / f"{name}.pkg"
