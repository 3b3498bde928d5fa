"""Per-process caches that torch 2.13 does not keep, kept here (issue 24: no work twice).

- The ONNX exporter builds its op registry from onnxscript's torchlib on every export
  (`ONNXRegistry.from_torchlib`: 505 ops, about 0.5 s each time on a 2-core AMD EPYC VM, 1.0 s
  the first time). Built once per opset and copied per export (the copy is the exporter's to add
  custom ops to), it costs a fraction of a millisecond; the warm zygote builds it before it
  forks, so a job's child never does.
- From that registry it then builds the table of decompositions for the ops ONNX lacks
  (`_decomp.create_onnx_friendly_decomposition_table`: 1,205 entries, 65 ms each export on the
  same VM, 170 ms the first time). It depends on the set of ops the registry implements and on
  torch's own decompositions, which grow only when an op library is loaded (a model's custom
  ops). It is built once per (set, number of ops torch knows, number of decompositions) and
  copied per export.
- Building that registry the first time, onnxscript compiles every torchlib function's ONNX IR
  from its Python source only to read its domain, which the registry never uses: 557 functions,
  0.43-0.52 s of a fresh process's first ONNX export on a 2-core AMD EPYC VM. The domain is read
  from the function's opset instead (`torchlib_ops_without_ir`); the IR of the ops an export uses
  is built when it is used.
- Reading a `.pt2` (`torch.export.load`) resolves the type hints of the serialized schema's
  dataclasses once per node: ~6,000 `typing.get_type_hints` calls for a ResNet-18, a third of
  the load. They depend only on the class, so they are resolved once per class.

What each cache depends on, and how that is checked (issue 39: a job's result never depends on
what ran before it in the same process). Each cache is looked up with a key that holds everything
its value is built from, read afresh at every call; a change makes a new entry, never a stale hit:

- ONNX op registry. Built from: the opset; torch's and onnxscript's torchlib function lists; which
  of those ops exist in torch (an op library adds some: the int8 stage's `quantized_decomposed`, a
  model's custom ops). Key: the opset, `ops_known()` (every op the dispatcher knows, as a set) and
  the sizes of both torchlib lists.
- Decomposition table. Built from: the ONNX-implemented op set it is given; torch's decompositions
  and default export decompositions, which follow the ops torch knows. Key: that set, `ops_known()`
  and torch's decomposition table (each op with its function, as a set).
- torchlib list without IR: not cached; read from onnxscript's registry at every registry build.
- pt2 type hints. Built from: a serialized-schema dataclass and the namespace its hints resolve in.
  Key: the class, the namespace (held, so that its id stays its own) and `include_extras`.

The installed packages and torch's own build are fixed for a process's life, so no key holds
them. The zygote builds these entries before it forks; a job that loads another op library
gets entries of its own, built in its own child, and the zygote's stay as they were. Each cache
keeps at most a few entries (`_Entries`), so a long-lived process that sees many op sets does not
grow.

Each replaces a private name: of the pinned torch (pyproject: torch==2.13.0), or, for the
torchlib list, of onnxscript, whose version is not pinned. Each installer checks that its name is
what it was written against and leaves the library alone where it is not: then only the speed is
lost, never a result.
"""

from __future__ import annotations

import logging
import typing
from typing import Any

log = logging.getLogger(__name__)


def cache_onnx_registry() -> None:
    """Install the ONNX op registry and decomposition-table caches, and the torchlib list read
    without the IR, in this process (once; before an ONNX export)."""
    _install("torchlib ops without their IR", _torchlib_ops_without_ir)
    _install("ONNX op registry", _cache_onnx_registry)
    _install("ONNX decomposition table", _cache_onnx_decompositions)


def cache_pt2_type_hints() -> None:
    """Install the pt2 schema type-hint cache in this process (once; before `torch.export.load`)."""
    _install("pt2 schema type hints", _cache_type_hints)


_tried: set[str] = set()


def _install(name: str, patch: Any) -> None:
    if name in _tried:
        return
    _tried.add(name)
    try:
        if not patch():
            log.info("%s cache not installed: this torch's internals differ from 2.13's", name)
    except Exception as exc:  # a speed-up, never a reason to fail a conversion
        log.info("%s cache not installed: %s: %s", name, type(exc).__name__, exc)


def ops_known() -> frozenset[str]:
    """Every operator torch's dispatcher knows in this process now. It grows when an op library is
    loaded (the int8 stage's `quantized_decomposed` ops, a model's custom ops) and shrinks when one
    is unloaded: 3,600 names, 3.7 ms to read as a set on a 2-core AMD EPYC VM."""
    import torch

    return frozenset(torch._C._dispatch_get_all_op_names())


class _Entries(dict[Any, Any]):
    """A cache's built values by key, at most `limit` of them (the oldest goes first)."""

    def __init__(self, limit: int = 4) -> None:
        super().__init__()
        self.limit = limit

    def put(self, key: Any, value: Any) -> Any:
        while len(self) >= self.limit:
            del self[next(iter(self))]
        self[key] = value
        return value


def _torchlib_sizes() -> tuple[int, int]:
    """How many functions torch's and onnxscript's torchlib lists hold (each grows when a function
    is registered in it)."""
    from onnxscript.function_libs.torch_lib import ops, registration
    from torch.onnx._internal.exporter._torchlib import _torchlib_registry
    from torch.onnx._internal.exporter._torchlib import ops as torch_ops

    del ops, torch_ops  # importing them registers the torchlib functions, as a registry build does
    onnxscript_functions = sum(len(f.overloads) + len(f.complex) for f in registration.default_registry.values())
    return len(_torchlib_registry._registry), onnxscript_functions


class _RegistryCache:
    """`ONNXRegistry.from_torchlib` with each registry built once per key (the opset, the ops torch
    knows, the torchlib lists: the module docstring's table): every call returns a new registry
    holding a copy of the built one's op table (its lists copied too, so a custom op an export
    registers stays in that export's registry)."""

    def __init__(self, build: Any) -> None:
        self.build = build  # the original classmethod's function
        self.built = _Entries()
        self.builds = 0  # how many times the torchlib registry was really built (tests read it)

    def __call__(self, cls: Any, opset_version: Any = None) -> Any:
        from torch.onnx._internal.exporter import _constants

        opset = _constants.TORCHLIB_OPSET if opset_version is None else opset_version
        key = (cls, opset, ops_known(), _torchlib_sizes())
        master = self.built.get(key)
        if master is None:
            self.builds += 1
            master = self.built.put(key, self.build(cls, opset))
        registry = cls.__new__(cls)
        registry.__dict__.update(master.__dict__)
        registry.functions = {target: list(metas) for target, metas in master.functions.items()}
        return registry


def _cache_onnx_registry() -> bool:
    from torch.onnx._internal.exporter import _registration

    registry_cls = _registration.ONNXRegistry
    current = registry_cls.__dict__.get("from_torchlib")
    if not isinstance(current, classmethod) or not hasattr(registry_cls(), "functions"):
        return False
    try:  # what the key is read from (the module docstring's table)
        ops_known()
        _torchlib_sizes()
    except (AttributeError, ImportError):
        return False
    patched: Any = registry_cls  # a private name of torch's, replaced
    patched.from_torchlib = classmethod(_RegistryCache(current.__func__))
    return True


def torchlib_ops_without_ir() -> list[Any]:
    """onnxscript's `get_torchlib_ops`, reading each function's domain from its opset.

    The original reads it from the function's ONNX IR (`function_ir`), which onnxscript builds by
    parsing the function's Python source: 557 functions, 0.43-0.52 s of the first registry build on a
    2-core AMD EPYC VM, for a field the registry never reads (`from_torchlib` takes the qualified
    name, the function and `is_complex`). The opset's domain is the IR's for every torchlib
    function of onnxscript 0.7.2 (tests/workers/engine/test_warm_caches.py checks them all); a
    function without an opset still gets its IR's. The IR of the ops an export uses is built then.
    """
    from onnxscript._framework_apis import torch_2_5
    from onnxscript.function_libs.torch_lib import ops, registration

    del ops  # importing it registers the torchlib functions
    metas = []
    for qualified_name, overloads in registration.default_registry.items():
        if qualified_name.startswith("internal::"):
            continue  # onnxscript's own helpers, as the original skips them
        for function, is_complex in [*((f, False) for f in overloads.overloads),
                                     *((f, True) for f in overloads.complex)]:
            domain = getattr(getattr(function, "opset", None), "domain", None) or function.function_ir.domain
            metas.append(torch_2_5._OnnxFunctionMeta(qualified_name=qualified_name, function=function,
                                                     domain=domain, name=function.name, is_complex=is_complex))
    return metas


def _torchlib_ops_without_ir() -> bool:
    import importlib

    from torch.onnx._internal import _lazy_import

    lazy = getattr(_lazy_import, "onnxscript_apis", None)
    name = getattr(lazy, "_name", None)
    if not isinstance(name, str):
        return False
    apis = importlib.import_module(name)
    current = getattr(apis, "get_torchlib_ops", None)
    # the function this replaces, as onnxscript 0.7 writes it, and the names it is built from
    if getattr(current, "__module__", None) != "onnxscript._framework_apis.torch_2_5":
        return current is torchlib_ops_without_ir
    from onnxscript._framework_apis import torch_2_5
    from onnxscript.function_libs.torch_lib import registration

    if not hasattr(torch_2_5, "_OnnxFunctionMeta") or not hasattr(registration, "default_registry"):
        return False
    patched: Any = apis  # onnxscript's name, replaced where torch's exporter looks it up
    patched.get_torchlib_ops = torchlib_ops_without_ir
    return True


def registry_cache() -> _RegistryCache | None:
    """The installed ONNX registry cache, if any."""
    from torch.onnx._internal.exporter import _registration

    method = _registration.ONNXRegistry.__dict__.get("from_torchlib")
    func = getattr(method, "__func__", None)
    return func if isinstance(func, _RegistryCache) else None


class _DecompositionTableCache:
    """`create_onnx_friendly_decomposition_table` built once per key (the ONNX-implemented op set,
    the ops torch knows, torch's decompositions: the module docstring's table); every call returns
    a new dict (the export may change the one it is given)."""

    def __init__(self, build: Any) -> None:
        self.build = build
        self.built = _Entries()
        self.builds = 0  # how many times the table was really built (tests read it)

    def __call__(self, onnx_registered_ops: Any) -> dict[Any, Any]:
        import torch

        key = (frozenset(onnx_registered_ops), ops_known(), frozenset(torch._decomp.decomposition_table.items()))
        table = self.built.get(key)
        if table is None:
            self.builds += 1
            table = self.built.put(key, self.build(onnx_registered_ops))
        return dict(table)


def _cache_onnx_decompositions() -> bool:
    import torch
    from torch.onnx._internal.exporter import _decomp, _fx_passes

    current = getattr(_decomp, "create_onnx_friendly_decomposition_table", None)
    # the exporter must look the name up on the module at each call, as 2.13's _fx_passes does
    if not callable(current) or getattr(_fx_passes, "_decomp", None) is not _decomp:
        return False
    if not hasattr(torch._C, "_dispatch_get_all_op_names") or not hasattr(torch._decomp, "decomposition_table"):
        return False
    if isinstance(current, _DecompositionTableCache):
        return True
    patched: Any = _decomp  # a private name of torch's, replaced
    patched.create_onnx_friendly_decomposition_table = _DecompositionTableCache(current)
    return True


def decomposition_cache() -> _DecompositionTableCache | None:
    """The installed decomposition-table cache, if any."""
    from torch.onnx._internal.exporter import _decomp

    found = getattr(_decomp, "create_onnx_friendly_decomposition_table", None)
    return found if isinstance(found, _DecompositionTableCache) else None


class _TypingWithCachedHints:
    """The `typing` module as torch's serializer sees it, with `get_type_hints` remembered per
    (class, namespace). The hints of a dataclass never change once its module is loaded."""

    def __init__(self) -> None:
        # (class, id(namespace), extras) -> (the namespace, held so that its id stays its own, hints)
        self.hints: dict[tuple[Any, int, bool], tuple[Any, dict[str, Any]]] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(typing, name)

    def get_type_hints(self, obj: Any, globalns: Any = None, localns: Any = None,
                       include_extras: bool = False) -> dict[str, Any]:
        if localns is not None:
            return typing.get_type_hints(obj, globalns, localns, include_extras)
        key = (obj, id(globalns), include_extras)
        known = self.hints.get(key)
        if known is None:
            known = self.hints[key] = (globalns, typing.get_type_hints(obj, globalns, None, include_extras))
        return known[1]


def _cache_type_hints() -> bool:
    from torch._export.serde import serialize

    if getattr(serialize, "typing", None) is not typing or not hasattr(serialize, "_dict_to_dataclass"):
        return False
    patched: Any = serialize  # the module's own name for `typing`, replaced
    patched.typing = _TypingWithCachedHints()
    return True
