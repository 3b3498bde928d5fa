"""The per-process caches of workers/engine/warm_caches.py: each does its work once, and what it
returns is what torch would have built without it."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest
import torch

from fxport.spec import parse_spec
from fxport.workers.engine import warm_caches
from fxport.workers.engine.pipeline import convert


def test_two_onnx_exports_build_the_op_registry_once(tmp_path: Path, tiny_pt2: Path) -> None:
    spec = parse_spec({"inputs": [{"name": "x", "shape": ["batch", 8]}], "targets": ["onnx"],
                       "dynamic_dims": {"batch": {"min": 1, "opt": 2, "max": 8}}, "passes": []})
    first = convert(tiny_pt2, spec, tmp_path / "a", report=False)
    cache = warm_caches.registry_cache()
    assert cache is not None, "the ONNX exporter ran without the registry cache"
    builds = cache.builds
    second = convert(tiny_pt2, spec, tmp_path / "b", report=False)
    assert cache.builds == builds, "the second export built the torchlib registry again"
    assert first["verification"][0]["passed"] and second["verification"][0]["passed"]
    assert (tmp_path / "a" / "model.onnx").read_bytes() == (tmp_path / "b" / "model.onnx").read_bytes()


def test_each_registry_is_its_own_copy() -> None:
    from torch.onnx._internal.exporter import _registration

    warm_caches.cache_onnx_registry()
    a = _registration.ONNXRegistry.from_torchlib(opset_version=20)
    b = _registration.ONNXRegistry.from_torchlib(opset_version=20)
    assert a is not b and a.functions is not b.functions
    assert a.functions.keys() == b.functions.keys() and a.opset_version == b.opset_version == 20
    target = next(iter(a.functions))
    a.functions[target].insert(0, "custom")  # what an export's custom_translation_table does to its registry
    assert "custom" not in b.functions[target]
    assert "custom" not in _registration.ONNXRegistry.from_torchlib(opset_version=20).functions[target]


def test_reading_a_pt2_again_resolves_no_type_hints(tmp_path: Path, tiny_pt2: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from torch._export.serde import serialize

    warm_caches.cache_pt2_type_hints()
    assert serialize.typing is not typing, "the pt2 type-hint cache is not installed"
    cached = torch.export.load(str(tiny_pt2))
    resolved: list[object] = []
    real = typing.get_type_hints
    monkeypatch.setattr(typing, "get_type_hints", lambda obj, *a, **k: resolved.append(obj) or real(obj, *a, **k))
    again = torch.export.load(str(tiny_pt2))
    assert resolved == [], f"{len(resolved)} type hints resolved again"
    monkeypatch.setattr(serialize, "typing", typing)  # torch as shipped
    plain = torch.export.load(str(tiny_pt2))
    assert resolved, "the uncached load resolves type hints: this test would not see the cache missing"
    assert str(cached.graph) == str(again.graph) == str(plain.graph)
    assert cached.graph_signature == plain.graph_signature
    x = torch.randn(3, 8)
    assert torch.equal(cached.module()(x), plain.module()(x))
