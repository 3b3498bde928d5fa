"""Helpers for engine tests: write corpus models to disk in each input format, build specs."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.models import ModelCase


def spec_dict(case: ModelCase, *, targets: tuple[str, ...] | None = None, passes: list[Any] | None = None,
              batch: tuple[int, int, int] = (1, 2, 4), **extra: Any) -> dict[str, Any]:
    inputs = [{"name": n, "shape": list(s), "dtype": d}
              for n, s, d in zip(case.input_names, case.input_shapes, case.input_dtypes)]
    spec: dict[str, Any] = {"inputs": inputs, "targets": list(targets or case.targets),
                            "verify": {"atol": case.tolerance, "rtol": 1e-3, "samples": 2}}
    if any("batch" in s for s in case.input_shapes):
        spec["dynamic_dims"] = {"batch": dict(zip(("min", "opt", "max"), batch))}
    if passes is not None:
        spec["passes"] = passes
    spec.update(extra)
    return spec


def save_pt2(case: ModelCase, path: Path) -> Path:
    model = case.build()
    args = case.example_inputs(2)
    dyn = None
    if case.dynamic_batch:
        batch = torch.export.Dim("batch", min=1, max=64)
        dyn = tuple({0: batch} for _ in args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ep = torch.export.export(model, args, dynamic_shapes=dyn)
    torch.export.save(ep, str(path))
    return path


def save_torchscript(case: ModelCase, path: Path) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.jit.trace(case.build(), case.example_inputs(2), strict=False).save(str(path))
    return path


def save_package(case: ModelCase, path: Path) -> Path:
    from torch.package import PackageExporter

    with PackageExporter(str(path)) as exporter:
        exporter.extern(["torch.**", "transformers.**", "numpy.**"])
        exporter.intern("tests.**")
        exporter.save_pickle("model", "model.pkl", case.build())
    return path


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    return tmp_path
