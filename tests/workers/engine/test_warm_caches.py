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


def test_torchlib_ops_read_without_their_ir_are_what_onnxscript_lists() -> None:
    """Every torchlib function, with the domain its compiled IR gives; and the function the
    exporter calls is the one that compiles none."""
    from onnxscript._framework_apis import torch_2_5
    from torch.onnx._internal._lazy_import import onnxscript_apis

    warm_caches.cache_onnx_registry()
    assert onnxscript_apis.get_torchlib_ops is warm_caches.torchlib_ops_without_ir
    fast = warm_caches.torchlib_ops_without_ir()
    slow = torch_2_5.get_torchlib_ops()  # onnxscript's own: the IR of every function
    key = lambda m: (m.qualified_name, m.function, m.domain, m.name, m.is_complex)  # noqa: E731
    assert len(fast) > 500 and [key(m) for m in fast] == [key(m) for m in slow]


def test_a_fresh_process_builds_the_onnx_registry_without_compiling_every_function() -> None:
    """The IR of a torchlib function is built from its Python source (`get_src_and_ast`): the
    first registry build of a fresh process parses none."""
    import subprocess
    import sys

    script = (
        "import onnxscript._internal.ast_utils as a, onnxscript._internal.values as v\n"
        "n = [0]\n"
        "real = a.get_src_and_ast\n"
        "def counted(f):\n"
        "    n[0] += 1\n"
        "    return real(f)\n"
        "a.get_src_and_ast = v.ast_utils.get_src_and_ast = counted\n"
        "from fxport.workers.engine import warm_caches\n"
        "warm_caches.cache_onnx_registry()\n"
        "from torch.onnx._internal.exporter import _registration\n"
        "import onnxscript.function_libs.torch_lib.ops\n"  # its import compiles the scripted ones
        "n[0] = 0\n"
        "registry = _registration.ONNXRegistry.from_torchlib()\n"
        "print(n[0], len(registry.functions))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    parsed, registered = map(int, out.split()[-2:])
    assert registered > 400 and parsed == 0


def test_a_registry_built_before_an_op_library_is_loaded_knows_its_ops_after() -> None:
    """Issue 39: the registry a warm parent built before the int8 stage loaded its Q/DQ op library
    (`torch.ops.quantized_decomposed`) was handed to every later export, so each int8 ONNX export
    failed with "No ONNX function found for quantized_decomposed.quantize_per_tensor". The cache
    is keyed on the ops torch knows: loading the library makes the next registry a new build that
    has them; one more call finds that build. In a fresh process, where the library is not loaded."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "assert 'torch.ao.quantization.fx._decomposed' not in sys.modules\n"
        "from fxport.workers.engine import warm_caches\n"
        "warm_caches.cache_onnx_registry()\n"
        "from torch.onnx._internal.exporter import _registration\n"
        "def has_qdq(r): return any('quantized_decomposed' in str(t) for t in r.functions)\n"
        "cache = warm_caches.registry_cache()\n"
        "print(has_qdq(_registration.ONNXRegistry.from_torchlib()), cache.builds)\n"
        "import torch.ao.quantization.fx._decomposed\n"
        "print(has_qdq(_registration.ONNXRegistry.from_torchlib()), cache.builds)\n"
        "print(has_qdq(_registration.ONNXRegistry.from_torchlib()), cache.builds)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.split()[-6:] == ["False", "1", "True", "2", "True", "2"], out
