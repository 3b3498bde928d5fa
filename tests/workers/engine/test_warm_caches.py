"""The per-process caches of workers/engine/warm_caches.py: each does its work once, and what it
returns is what torch would have built without it."""

from __future__ import annotations

import functools
import typing
from pathlib import Path

import pytest
import torch

from fxport.spec import parse_spec
from fxport.workers.engine import warm_caches
from fxport.workers.engine.exporters import onnx_ready
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
    readied = onnx_ready.install()
    assert readied is not None
    with readied.off():  # the exporter's own decomposition, which reads the table (onnx_ready skips it)
        convert(tiny_pt2, spec, tmp_path / "c", report=False)
        table = warm_caches.decomposition_cache()
        assert table is not None and table.builds >= 1, "the ONNX exporter ran without the decomposition-table cache"
        tables = table.builds
        convert(tiny_pt2, spec, tmp_path / "d", report=False)
    assert table.builds == tables, "the fourth export built the decomposition table again"
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


def test_each_decomposition_table_is_its_own_copy_and_what_torch_builds() -> None:
    from torch.onnx._internal.exporter import _decomp, _registration

    warm_caches.cache_onnx_registry()
    cache = warm_caches.decomposition_cache()
    assert cache is not None
    ops = set(_decomp.get_onnx_implemented_overloads(_registration.ONNXRegistry.from_torchlib(opset_version=20)))
    a = _decomp.create_onnx_friendly_decomposition_table(ops)
    builds = cache.builds
    b = _decomp.create_onnx_friendly_decomposition_table(set(ops))
    assert cache.builds == builds and a is not b and a == b
    # what torch builds without the cache: the same ops, each with the same decomposition (torch makes
    # a new functools.partial per build for some ops; same function, same kernel)
    assert _same_table(a, cache.build(ops))
    a.clear()  # what an export may do to the table it is given
    assert _decomp.create_onnx_friendly_decomposition_table(ops) == b
    fewer = set(list(ops)[1:])
    assert _same_table(_decomp.create_onnx_friendly_decomposition_table(fewer), cache.build(fewer))
    # a model that loads an op library gets a table that knows its ops
    builds = cache.builds
    torch.library.define("fxport_test::twice", "(Tensor x) -> Tensor")
    _decomp.create_onnx_friendly_decomposition_table(ops)
    assert cache.builds == builds + 1


def _same_table(a: dict, b: dict) -> bool:
    def same(f, g) -> bool:
        if isinstance(f, functools.partial) and isinstance(g, functools.partial):
            return f.func.__qualname__ == g.func.__qualname__ and f.args == g.args and f.keywords == g.keywords
        return f is g
    return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)


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
