"""Saving a model as a torch.package archive, as the tests' packaged models are saved: a model
from a source file of its own (tests/client/packaged.py), the NMS head (coverage3_nms_llama.py).

The NMS head's archive interns every module under tests/, this one with it: so nothing here
imports `sys`, which torch.package refuses to intern."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def save_package(path: Path, model: Any, *, intern: str | Sequence[str],
                 extern: Sequence[str] = ("torch.**",)) -> Path:
    """`model` saved at `path` as a torch.package ("model", "model.pkl"): the modules `intern`
    names with their code in the archive, those `extern` names imported where it is loaded."""
    from torch.package import PackageExporter

    with PackageExporter(str(path)) as exporter, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.package's own (TypedStorage is deprecated)
        exporter.extern(list(extern))
        exporter.intern(intern if isinstance(intern, str) else list(intern))
        exporter.save_pickle("model", "model.pkl", model)
    return path
