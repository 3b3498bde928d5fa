"""Readable, editable FX Python source of the transformed graph, with its tensors in one safetensors file.

The artifact is a folder:

    fx_source/
      module.py             the class MODULE_CLASS: modules rebuilt from their constructor arguments,
                            the graph's own tensors declared by shape, forward() as FX writes it
      weights.safetensors   every tensor, once (tied tensors under their first name, see TIED)
      __init__.py           `from .module import FxportModule`: the folder imports as a package too

Loading it unpickles nothing: `safetensors.torch.load_file` reads the tensors and
`load_state_dict(..., strict=True, assign=True)` puts them in place. (torch's own
`GraphModule.to_folder` pickled every submodule it could not print and loaded it with
`torch.load(weights_only=False)`, and stored those weights a second time in state_dict.pt.)

How each thing the graph reads gets into module.py:
- a call_module leaf of torch.nn (Conv2d, BatchNorm2d, Linear, LayerNorm, ...) is written as its
  constructor call, found from the module's attributes and checked: the call, run, must rebuild a
  module whose every attribute, submodule, parameter and buffer name and shape equal the original's;
- any other called module (a torch.nn module that fails that check, a user's module) is traced
  into the graph, so its tensors become get_attr reads of the top module;
- a get_attr tensor is declared by shape (Parameter or buffer, as it was) and read from the file;
- a get_attr non-tensor is written as a Python literal; one that has no literal form (a nested
  graph, a ScriptObject, ...) fails the export naming the node and the attribute;
- a function the graph calls (a leaf kept by `torch.fx.wrap`, like torchvision's stochastic_depth) is
  imported by name at the top of module.py when its module belongs to the standard library or to an
  installed distribution, so it imports wherever the same packages are installed. Any other module
  (`__main__`, a script's folder, a torch.package archive's `<torch_package_0>.*`, a checkout on
  sys.path) may be missing where the source is loaded: the function's own source is copied into
  module.py instead, with the globals it reads (imported, copied or written as literals by the same
  rules). A function whose source cannot be had (made by exec, a lambda, a closure) fails the export
  naming it. Each wrapped function gets its `torch.fx.wrap("name")` at module level, so tracing the
  loaded module again keeps it a leaf (torch's `to_folder` wrote that call inside the class body,
  where `wrap` refuses to run).

The written module.py is imported once before the exporter returns: a source that cannot even be
imported fails the fx_source target at once, naming its line.
"""

from __future__ import annotations
import __future__

import ast
import builtins
import dis
import functools
import importlib
import importlib.util
import inspect
import keyword
import math
import os
import sys
import textwrap
import traceback
import types
import warnings
import weakref
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule

from fxport.errors import ConversionFailed

MODULE_CLASS = "FxportModule"
WEIGHTS_FILE = "weights.safetensors"
_HINT = "drop 'fx_source' from targets to get the other artifacts"
# names module.py defines itself: a graph global of the same name would shadow them
# ("annotations": `from __future__ import annotations` binds it where functions are copied)
_RESERVED = {"os", "safetensors", "WEIGHTS", "TIED", "_set", "annotations", MODULE_CLASS}
# vars() entries two modules may differ in and still compute the same (eval() is set after loading)
_STATE_KEYS = {"_parameters", "_buffers", "_modules", "training"}


class FxSourceFromGraphModule:
    """`imports`: extra import lines module.py needs (an int8 graph's Q/DQ op library)."""

    def __init__(self, gm: GraphModule, imports: tuple[str, ...] = ()) -> None:
        self.gm, self.imports = gm, imports

    def __call__(self, folder: Path) -> Path:
        codegen = self.gm.graph._codegen
        if type(codegen) is not torch.fx.graph.CodeGen:
            raise ConversionFailed(
                f"fx_source: the graph's inputs and outputs go through {type(codegen).__name__} (a torch.export "
                "module that could not be traced into a plain graph, as with torch.cond), which has no plain "
                "Python form", stage="export", hint=f"remove data-dependent control flow (torch.cond); or {_HINT}")
        folder.mkdir(parents=True, exist_ok=True)
        gm = _inline_unbuildable_modules(self.gm)
        source, tensors = _SourceWriter(gm, self.imports).write()
        (folder / "module.py").write_text(source)
        check_imports(folder / "module.py")
        (folder / "__init__.py").write_text(f"from .module import {MODULE_CLASS}  # noqa: F401\n")
        _save_tensors(tensors, folder / WEIGHTS_FILE)
        # safetensors creates its file owner-only; give it the mode the source files got (the umask's)
        os.chmod(folder / WEIGHTS_FILE, (folder / "module.py").stat().st_mode & 0o777)
        return folder


def check_imports(path: Path) -> None:
    """Import the written module.py once, as a module of its own (nothing else sees it): a source that
    cannot even be imported fails the fx_source target here, naming the line, rather than later in
    verification or on the user's machine. Its class is not built: verification does that."""
    name = f"_fxport_fx_source_check_{os.getpid()}_{abs(hash(str(path)))}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    # no __pycache__ inside the artifact folder: it would ship as stray files
    writes_bytecode, sys.dont_write_bytecode = sys.dont_write_bytecode, True
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        lineno = exc.lineno if isinstance(exc, SyntaxError) else _line_in(exc, path)
        lines = path.read_text().splitlines()
        where = f"line {lineno} `{lines[lineno - 1].strip()}`" if lineno and 0 < lineno <= len(lines) else "it"
        raise ConversionFailed(
            f"fx_source: the written {path.name} does not import: {where} raised {type(exc).__name__}: "
            f"{_first_line(exc)}", stage="export",
            hint="a missing module on that line must be installed where the source is made and loaded; or "
                 f"capture the model at aten level (spec `capture: export`); or {_HINT}",
        ) from exc
    finally:
        sys.modules.pop(name, None)
        sys.dont_write_bytecode = writes_bytecode


def _line_in(exc: BaseException, path: Path) -> int | None:
    """The line of `path` the exception passed through last (the failing statement of module.py)."""
    lines = [f.lineno for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename) == path]
    return lines[-1] if lines else None


# ---------------------------------------------------------------------------------------------
# Modules: rebuilt from constructor arguments, or traced into the graph
# ---------------------------------------------------------------------------------------------

def _inline_unbuildable_modules(gm: GraphModule) -> GraphModule:
    """`gm` itself when every module it calls can be rebuilt from its constructor arguments; else
    `gm` traced again with those modules traced through (their tensors become get_attr reads)."""
    called = [n for n in gm.graph.nodes if n.op == "call_module"]
    unbuildable = {str(n.target): why for n in called
                   if (why := constructor_source(gm.get_submodule(str(n.target)))[1]) is not None}
    if not unbuildable:
        return gm

    class Inline(torch.fx.Tracer):
        def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
            return super().is_leaf_module(m, module_qualified_name) and constructor_source(m)[1] is None

    try:
        graph = Inline().trace(gm)
        traced = GraphModule(gm, graph, gm.__class__.__name__)
    except Exception as exc:
        target, why = next(iter(unbuildable.items()))
        kind = type(gm.get_submodule(target)).__qualname__
        raise ConversionFailed(
            f"fx_source: module {target!r} ({kind}) cannot be written as source: it is not rebuilt from its "
            f"constructor arguments ({why}), and tracing into it failed: {type(exc).__name__}: "
            f"{_first_line(exc)}", stage="export",
            hint="capture the model at aten level (spec `capture: export`, or upload a .pt2), where the graph "
                 f"calls no modules; or {_HINT}",
        ) from exc
    left = [str(n.target) for n in traced.graph.nodes
            if n.op == "call_module" and constructor_source(traced.get_submodule(str(n.target)))[1] is not None]
    if left:  # a leaf kept by the tracer's own rule, not ours
        raise ConversionFailed(
            f"fx_source: module(s) {', '.join(repr(t) for t in left)} cannot be written as source",
            stage="export", hint=f"capture the model at aten level (spec `capture: export`); or {_HINT}")
    return traced


# Keyed on what `_constructor_source` reads: the torch.nn class and the module's constructor arguments
# (`_signature_of`); its answer is checked by rebuilding the module, so no other state decides it.
_CONSTRUCTOR_CACHE: dict[tuple[type, str], tuple[str | None, str | None]] = {}


def constructor_source(module: nn.Module) -> tuple[str | None, str | None]:
    """(`"torch.nn.Conv2d(3, 16, 3, padding=1)"`, None), or (None, why not).

    Only torch.nn classes (their forward is torch's, importable wherever torch is), and only
    when evaluating the call rebuilds a module equal to `module` in everything but tensor values
    (`_same_module`): the arguments are read off the module's attributes of the same names, so
    the check is what makes a call right, never the reading.
    """
    cls = type(module)
    if getattr(nn, cls.__name__, None) is not cls:
        return None, f"{cls.__module__}.{cls.__qualname__} is not a torch.nn class"
    try:
        key = (cls, repr(_signature_of(module)))
    except Exception:
        key = None
    if key is not None and key in _CONSTRUCTOR_CACHE:
        return _CONSTRUCTOR_CACHE[key]
    result = _constructor_source(module, f"torch.nn.{cls.__name__}")
    if key is not None:
        if len(_CONSTRUCTOR_CACHE) >= 4096:  # a long-lived process: keep it bounded
            _CONSTRUCTOR_CACHE.clear()
        _CONSTRUCTOR_CACHE[key] = result
    return result


def _constructor_source(module: nn.Module, callee: str) -> tuple[str | None, str | None]:
    params = _init_parameters(type(module))
    if params is None:
        return None, f"{callee}'s constructor has no named parameters"
    why: str | None = "no argument list"
    # LSTM(*args, **kwargs) passes its own first argument (mode) to RNNBase: try without it too
    for skip in (0, 1):
        args = _arguments(module, params[skip:])
        if isinstance(args, str):
            why = args
            continue
        required, optional, flags = args
        # a bool parameter with no attribute of its name (MultiheadAttention's bias): its default, else not
        for flip in range(1 << min(len(flags), 3)):
            trial = dict(optional)
            for i, (name, default) in enumerate(flags[:3]):
                if flip >> i & 1:
                    trial[name] = not default
            call, why = _shortest_call(module, callee, required, trial)
            if call is not None:
                return call, None
    return None, why


def _init_parameters(cls: type) -> list[inspect.Parameter] | None:
    """The named parameters of cls's constructor, or of the nearest base's when cls takes only *args, **kwargs."""
    for klass in cls.__mro__:
        if klass is nn.Module or "__init__" not in vars(klass):
            continue
        try:
            params = list(inspect.signature(vars(klass)["__init__"]).parameters.values())[1:]
        except (TypeError, ValueError):
            return None
        named = [p for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if named or not params:
            return [p for p in named if p.name not in ("device", "dtype")]
    return []


def _arguments(module: nn.Module, params: list[inspect.Parameter]
               ) -> tuple[list[tuple[str, Any]], dict[str, Any], list[tuple[str, bool]]] | str:
    required: list[tuple[str, Any]] = []
    optional: dict[str, Any] = {}
    flags: list[tuple[str, bool]] = []
    elsewhere = _ARGUMENTS_ELSEWHERE.get(type(module), {})
    for param in params:
        has_default = param.default is not param.empty
        found, value = _attribute(module, elsewhere.get(param.name, param.name))
        if found:
            if isinstance(value, torch.Tensor) or (value is None and isinstance(param.default, bool)):
                value = value is not None  # bias=True/False: the attribute is the tensor, or None
        elif has_default:
            value = param.default
            if isinstance(value, bool):
                flags.append((param.name, value))
        else:
            return f"{param.name}=...: no attribute of that name to read it from"
        if not has_default or param.kind is param.POSITIONAL_ONLY:
            required.append((param.name, value))
        elif not _same_value(value, param.default):
            optional[param.name] = value
    return required, optional, flags


# Constructor arguments a torch.nn module keeps under another name (`d_model` is `self_attn.embed_dim`).
# Only where to look: `_same_module` still decides whether the call rebuilds the module.
_LAYER_ARGUMENTS = {"d_model": "self_attn.embed_dim", "nhead": "self_attn.num_heads",
                    "dim_feedforward": "linear1.out_features", "dropout": "dropout.p", "layer_norm_eps": "norm1.eps",
                    "batch_first": "self_attn.batch_first", "bias": "linear1.bias"}
_ARGUMENTS_ELSEWHERE: dict[type, dict[str, str]] = {
    nn.TransformerEncoderLayer: _LAYER_ARGUMENTS,
    nn.TransformerDecoderLayer: _LAYER_ARGUMENTS,
    nn.TransformerEncoder: {"encoder_layer": "layers.0"},
    nn.TransformerDecoder: {"decoder_layer": "layers.0"},
    nn.Transformer: {"num_encoder_layers": "encoder.num_layers", "num_decoder_layers": "decoder.num_layers",
                     **{k: f"encoder.layers.0.{v}" for k, v in _LAYER_ARGUMENTS.items()
                        if k not in ("d_model", "nhead")},
                     "activation": "encoder.layers.0.activation", "norm_first": "encoder.layers.0.norm_first"},
}


def _attribute(module: nn.Module, path: str) -> tuple[bool, Any]:
    """(True, module.<path>) when each step is the object's own attribute (not a class default), else (False, None)."""
    obj: Any = module
    for part in path.split("."):
        if isinstance(obj, nn.Module) and (part in obj._parameters or part in obj._buffers or part in obj._modules):
            obj = getattr(obj, part)
        elif part in getattr(obj, "__dict__", {}):
            obj = vars(obj)[part]
        else:
            return False, None
    return True, obj


def _argument(value: Any) -> str:
    """A constructor argument as source: a literal, a torch.nn module rebuilt the same way
    (TransformerEncoder's layer), or a torch function by name (a layer's activation)."""
    if isinstance(value, nn.Module):
        call, _ = constructor_source(value)
        if call is None:
            raise _NotLiteral(f"{type(value).__module__}.{type(value).__qualname__}")
        return call
    if callable(value) and not isinstance(value, type):
        name = getattr(value, "__name__", "")
        if name and getattr(torch.nn.functional, name, None) is value:
            return f"torch.nn.functional.{name}"
        module, qualname = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
        if isinstance(module, str) and module.startswith("torch.") and isinstance(qualname, str) \
                and _resolve(module, qualname) is value:
            return f"{module}.{qualname}"
    return _literal(value)


def _shortest_call(module: nn.Module, callee: str, required: list[tuple[str, Any]],
                   optional: dict[str, Any]) -> tuple[str | None, str | None]:
    """The call with every argument read off `module`, checked; then made shorter where the
    shorter call still rebuilds the same module (`kernel_size=(3, 3)` → `3`, `stride=(1, 1)` → left out)."""
    try:
        args = [_argument(v) for _, v in required]
        kwargs = {k: _argument(v) for k, v in optional.items()}
    except _NotLiteral as exc:
        return None, f"argument of type {exc} has no literal form"

    def call(a: list[str], kw: dict[str, str]) -> str:
        return f"{callee}({', '.join([*a, *(f'{k}={v}' for k, v in kw.items())])})"

    def rebuilds(text: str) -> bool:
        try:
            with torch.device("meta"), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                built = eval(text, {"torch": torch})  # noqa: S307 - text made here from literals only
        except Exception:
            return False
        return _same_module(built, module)

    if not rebuilds(call(args, kwargs)):
        return None, f"{call(args, kwargs)} does not rebuild it (it holds state its constructor does not make)"
    for i, (_, value) in enumerate(required):
        short = _short_tuple(value)
        if short is not None and rebuilds(call([*args[:i], short, *args[i + 1:]], kwargs)):
            args[i] = short
    for k, value in optional.items():
        trial = dict(kwargs)
        del trial[k]
        if rebuilds(call(args, trial)):
            kwargs = trial
            continue
        short = _short_tuple(value)
        if short is not None and rebuilds(call(args, {**kwargs, k: short})):
            kwargs[k] = short
    return call(args, kwargs), None


def _short_tuple(value: Any) -> str | None:
    if isinstance(value, tuple) and value and len(set(value)) == 1 and type(value[0]) is int:
        return repr(value[0])
    return None


def _signature_of(module: nn.Module) -> list[Any]:
    """Everything `_same_module` compares, as plain data: a cache key."""
    out = []
    for path, sub in module.named_modules():
        out.append((path, type(sub).__qualname__,
                    sorted((k, repr(_plain(v, sub))) for k, v in vars(sub).items() if k not in _STATE_KEYS),
                    [(k, None if t is None else (type(t).__name__, tuple(t.shape)))
                     for k, t in sub._parameters.items()],
                    [(k, None if t is None else tuple(t.shape)) for k, t in sub._buffers.items()],
                    sorted(sub._non_persistent_buffers_set)))
    return out


def _same_module(a: nn.Module, b: nn.Module) -> bool:
    """Same classes, same non-tensor attributes, same parameter and buffer names and shapes, at every depth."""
    mods_a, mods_b = dict(a.named_modules()), dict(b.named_modules())
    if list(mods_a) != list(mods_b):
        return False
    for path, x in mods_a.items():
        y = mods_b[path]
        if type(x) is not type(y):
            return False
        if x._non_persistent_buffers_set or y._non_persistent_buffers_set:
            return False  # not in the state dict, so the weights file would not fill them
        vx = {k: v for k, v in vars(x).items() if k not in _STATE_KEYS}
        vy = {k: v for k, v in vars(y).items() if k not in _STATE_KEYS}
        try:
            if vx.keys() != vy.keys() or not all(_same_value(_plain(vx[k], x), _plain(vy[k], y)) for k in vx):
                return False
        except _Opaque:
            return False
        for own_x, own_y in ((x._parameters, y._parameters), (x._buffers, y._buffers)):
            if list(own_x) != list(own_y):
                return False
            for k, t in own_x.items():
                u = own_y[k]
                if (t is None) != (u is None) or (t is not None and (tuple(t.shape) != tuple(u.shape)
                                                                     or type(t) is not type(u))):
                    return False
    return True


class _Opaque(Exception):
    """A tensor attribute that is not one of the module's own parameters or buffers: its value matters."""


def _plain(value: Any, owner: nn.Module) -> Any:
    """`value` with the module's own tensors (RNNs keep lists of them, and weak references to them)
    replaced by their names: what two modules can be compared on."""
    if isinstance(value, weakref.ref):
        value = value()
    if isinstance(value, torch.Tensor):
        for kind, own in (("parameter", owner._parameters), ("buffer", owner._buffers)):
            for name, t in own.items():
                if t is value:
                    return (kind, name)
        raise _Opaque()
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v, owner) for v in value) if type(value) in (list, tuple) else value
    return value


def _same_value(x: Any, y: Any) -> bool:
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        return False
    if type(x) is not type(y):
        return isinstance(x, (int, float)) and isinstance(y, (int, float)) and not isinstance(x, bool) \
            and not isinstance(y, bool) and x == y
    if isinstance(x, (tuple, list)):
        return len(x) == len(y) and all(_same_value(p, q) for p, q in zip(x, y))
    if isinstance(x, dict):
        return x.keys() == y.keys() and all(_same_value(x[k], y[k]) for k in x)
    if isinstance(x, float) and math.isnan(x):
        return math.isnan(y)
    try:
        return bool(x == y)
    except Exception:
        return False


class _NotLiteral(Exception):
    pass


def _literal(value: Any) -> str:
    """Python source that evaluates to `value` (with `torch` imported)."""
    if value is None or isinstance(value, (bool, int, str)):
        return repr(value)
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else f'float("{value}")'
    if isinstance(value, torch.Size):
        return f"torch.Size({_literal(list(value))})"
    if isinstance(value, tuple) and type(value) is tuple:
        items = [_literal(v) for v in value]
        return f"({items[0]},)" if len(items) == 1 else f"({', '.join(items)})"
    if isinstance(value, list) and type(value) is list:
        return f"[{', '.join(_literal(v) for v in value)}]"
    if isinstance(value, dict) and type(value) is dict and all(isinstance(k, str) for k in value):
        return "{" + ", ".join(f"{k!r}: {_literal(v)}" for k, v in value.items()) + "}"
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, torch.device):
        return f"torch.device({str(value)!r})"
    raise _NotLiteral(f"{type(value).__module__}.{type(value).__qualname__}")


# ---------------------------------------------------------------------------------------------
# module.py
# ---------------------------------------------------------------------------------------------

class _SourceWriter:
    def __init__(self, gm: GraphModule, imports: tuple[str, ...]) -> None:
        self.gm, self.imports = gm, imports

    def write(self) -> tuple[str, dict[str, torch.Tensor]]:
        gm = self.gm
        forward, globals_ = self._forward_code()

        modules: dict[str, str] = {}  # path -> constructor call, in the order the graph first calls them
        called = list(dict.fromkeys(str(n.target) for n in gm.graph.nodes if n.op == "call_module"))
        for path in called:
            if any(path.startswith(p + ".") for p in called):
                continue  # called inside a module called too: that one's constructor makes it
            call, _ = constructor_source(gm.get_submodule(path))
            assert call is not None  # _inline_unbuildable_modules left only buildable ones
            modules[path] = call

        slots: dict[str, torch.Tensor] = {}  # state-dict name -> tensor (the file's content)
        for path in modules:
            for name, tensor in gm.get_submodule(path).state_dict(keep_vars=True).items():
                slots[f"{path}.{name}"] = tensor
        declared: dict[str, torch.Tensor] = {}  # tensors the graph reads itself
        constants: dict[str, str] = {}  # non-tensor attributes, as literals
        for node in gm.graph.nodes:
            if node.op != "get_attr":
                continue
            target = str(node.target)
            value = _fetch(gm, target)
            inside = next((p for p in modules if target.startswith(p + ".")), None)
            if inside is not None and (target in slots or not isinstance(value, torch.Tensor)):
                continue  # the rebuilt module has it (its non-tensor attributes were compared)
            if isinstance(value, torch.Tensor):
                if target not in declared:
                    declared[target] = value
                    slots[target] = value
                continue
            try:
                constants[target] = _literal(value)
            except _NotLiteral:
                raise ConversionFailed(
                    f"fx_source: node {node.name!r} reads attribute {target!r}, a {type(value).__module__}."
                    f"{type(value).__qualname__}, which has no Python literal form (only tensors, numbers, "
                    "strings, dtypes, devices and tuples/lists/dicts of them can be written)", stage="export",
                    hint="turn the attribute into a tensor buffer or a plain number in the model, or capture it "
                         f"at aten level (spec `capture: export`); or {_HINT}",
                ) from None

        stored, tied = _dedupe(slots)
        init = self._init_body(modules, declared, constants)
        source = self._module_text(globals_, forward, init, tied)
        return source, stored

    def _forward_code(self) -> tuple[str, _ModuleGlobals]:
        """forward() as FX writes it (without type annotations: they name types the file would have to
        import for nothing) and the top-level names of module.py its globals need."""
        graph = self.gm.graph
        types_ = {n: n.type for n in graph.nodes}
        try:
            for n in graph.nodes:
                n.type = None
            code = graph.python_code(root_module="self")
        finally:
            for n, t in types_.items():
                n.type = t
        src = code.src
        start = src.find("def forward(")
        # what precedes forward is FX's `wrap("fn")` for functions traced as leaves: _ModuleGlobals
        # writes those at module level itself
        src = src[start:].rstrip() + "\n"
        used = {n.id for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Name)}
        wrapped = {id(n.target) for n in graph.nodes if n.op == "call_function" and n.meta.get("is_wrapped")}
        names = _ModuleGlobals()
        for name in sorted(used & set(code.globals)):
            obj = code.globals[name]
            users = [n.name for n in graph.nodes if n.op == "call_function" and n.target is obj]
            names.bind(name, obj, "the graph" + (f" (node {users[0]!r})" if users else ""))
            if id(obj) in wrapped:
                names.wrapped.append(name)
        return src, names

    def _init_body(self, modules: dict[str, str], declared: dict[str, torch.Tensor],
                   constants: dict[str, str]) -> list[str]:
        body = []
        if modules or declared:
            body.append('with torch.device("meta"):  # shapes only: every value is read from `weights` below')
        if modules:
            body.append("    # the modules the graph calls, from their constructor arguments")
            body.extend(f"    {_assign(path, call)}" for path, call in modules.items())
        if declared:
            body.append("    # the tensors the graph reads itself")
        for target, t in declared.items():
            dims = ", ".join(str(d) for d in t.shape) if t.dim() else "()"
            empty = f"torch.empty({dims}{'' if t.dtype == torch.float32 else f', dtype={t.dtype}'})"
            if isinstance(t, nn.Parameter):
                body.append(f"    {_assign(target, f'torch.nn.Parameter({empty})')}")
            elif _plain_name(target):
                body.append(f"    self.register_buffer({target!r}, {empty})")
            else:
                body.append(f"    _set(self, {target!r}, {empty})")
        body.extend(_assign(target, text) for target, text in constants.items())
        body += [
            "tensors = safetensors.torch.load_file(weights)  # safetensors: reads no pickle",
            "tensors.update({alias: tensors[name] for alias, name in TIED.items()})",
            "self.load_state_dict(tensors, strict=True, assign=True)",
            "self.eval()",
        ]
        return body

    def _module_text(self, names: _ModuleGlobals, forward: str, init: list[str], tied: dict[str, str]) -> str:
        imports = list(dict.fromkeys(["import torch", *names.imports]))
        extra = [i for i in self.imports if i not in imports]
        if "torch.ops.quantized_decomposed" in forward and not any("_decomposed" in i for i in extra):
            extra.append("import torch.ao.quantization.fx._decomposed  # defines torch.ops.quantized_decomposed")
        tied_text = "{" + ", ".join(f"{a!r}: {n!r}" for a, n in tied.items()) + "}"
        init_text = "\n".join(" " * 8 + line for line in init)
        forward_text = "\n".join(("    " + line) if line else "" for line in forward.splitlines())
        import_text = "\n".join(["import safetensors.torch", *imports, *extra])
        # a copied function's annotations name types module.py need not import: never evaluate them
        future = "from __future__ import annotations\n\n" if names.copied else ""
        return f'''"""FX source written by fxport: readable, editable PyTorch.

    from module import {MODULE_CLASS}   # with this folder on sys.path
    model = {MODULE_CLASS}()              # reads {WEIGHTS_FILE} beside this file
    out = model(x)

Loading runs no pickle: the tensors come from {WEIGHTS_FILE} (safetensors), the modules
from their constructor arguments below.
"""

{future}import os

{import_text}

WEIGHTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "{WEIGHTS_FILE}")
# tensors stored once, under their first name, and used under these names too
TIED = {tied_text}
{names.definitions_text()}

class {MODULE_CLASS}(torch.nn.Module):
    def __init__(self, weights: str = WEIGHTS) -> None:
        super().__init__()
{init_text}

{forward_text}


def _set(root: torch.nn.Module, path: str, value: object) -> None:
    """root.<path> = value (a tensor not a Parameter as a buffer), making the plain module containers
    on the way: "layer1.0.conv1" sets attribute conv1 of module "0" of module layer1."""
    *parents, name = path.split(".")
    for part in parents:
        if part not in root._modules:
            root.add_module(part, torch.nn.Module())
        root = root._modules[part]
    if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
        root.register_buffer(name, value)
    else:
        setattr(root, name, value)
'''


class _ModuleGlobals:
    """The names module.py binds at its top level for the code it runs (forward(), and the functions it
    copies), each bound once to one object: by an import line where the object's module is importable
    wherever the source loads (`_importable_where_loaded`), else by a copy of the function's source,
    else by a literal. Anything else fails the export naming the name and who uses it."""

    def __init__(self) -> None:
        self.bound: dict[str, Any] = {"os": os, "torch": torch}  # module.py imports these itself
        self.imports: list[str] = []
        self.constants: list[str] = []  # `NAME = literal`, read by copied functions
        self.copied: list[str] = []  # function definitions, each under a comment saying where it came from
        self.aliases: list[str] = []  # `graph_name = function_name`
        self.wrapped: list[str] = []  # names torch.fx.wrap keeps as leaves when module.py is traced again

    def bind(self, name: str, obj: Any, user: str) -> None:
        if name in self.bound:
            if self.bound[name] is obj:
                return
            raise ConversionFailed(
                f"fx_source: {user} uses the global {name!r} ({_describe(obj)}), a name module.py already binds "
                f"to {_describe(self.bound[name])}", stage="export",
                hint=f"rename one of them in the model's code; or {_HINT}")
        if name in _RESERVED:
            raise ConversionFailed(f"fx_source: {user} uses a global named {name!r}, a name module.py defines "
                                   "itself", stage="export", hint=f"rename it in the model's code; or {_HINT}")
        self.bound[name] = obj
        line = _import_line(name, obj)
        if line is not None:
            if line:
                self.imports.append(line)
        elif isinstance(obj, types.FunctionType):
            self._copy(name, obj, user)
        else:
            try:
                self.constants.append(f"{name} = {_literal(obj)}")
            except _NotLiteral:
                raise ConversionFailed(
                    f"fx_source: {user} uses {name!r}, {_describe(obj)}, which cannot be imported by name where "
                    "the source runs (its module is not part of an installed package or the standard library), "
                    "and is neither a function whose source can be copied nor a literal", stage="export",
                    hint="make it importable (a function of an installed package), or capture the model at "
                         f"aten level (spec `capture: export`); or {_HINT}") from None

    def _copy(self, name: str, fn: types.FunctionType, user: str) -> None:
        """Write `fn`'s own source into module.py (under its own name; `name = fn` when the graph calls it
        by another), then bind the globals it reads."""
        if fn.__name__ != name:
            self.bind(fn.__name__, fn, user)
            self.aliases.append(f"{name} = {fn.__name__}")
            return
        source, reads = _function_source(fn)
        if isinstance(reads, str):
            raise ConversionFailed(
                f"fx_source: {user} calls {_describe(fn)}, whose module cannot be imported where the source runs "
                f"(it is not part of an installed package or the standard library), and whose source cannot be "
                f"copied into module.py: {reads}", stage="export",
                hint=f"define {fn.__name__!r} at the top level of a module file (or of an installed package); or "
                     f"capture the model at aten level (spec `capture: export`); or {_HINT}")
        self.copied.append(f"# {fn.__name__}: copied from module {fn.__module__}, which the loading process may "
                           f"not be able to import\n{source}")
        for global_name in reads:
            if global_name in fn.__globals__:
                self.bind(global_name, fn.__globals__[global_name], f"function {_describe(fn)}")
            # else a builtin, or a name its own module lacks too: the copy behaves as the original does

    def definitions_text(self) -> str:
        """What module.py defines between its imports and its class ('' when nothing)."""
        parts = []
        if self.constants:
            parts.append("# globals the copied functions read\n" + "\n".join(self.constants))
        parts += self.copied
        if self.aliases:
            parts.append("\n".join(self.aliases))
        if self.wrapped:
            parts.append("# functions the graph calls as leaves: tracing this module again keeps them so\n"
                         + "\n".join(f'torch.fx.wrap("{name}")' for name in self.wrapped))
        return "".join(f"\n\n{part}\n" for part in parts)


def _function_source(fn: types.FunctionType) -> tuple[str, list[str] | str]:
    """(`def ...` source of `fn` without its decorators, the global names it reads), or ('', why not)."""
    if fn.__qualname__ != fn.__name__ or fn.__name__ == "<lambda>":
        return "", ("it is not a function defined at the top level of its module (a lambda, a nested "
                    "function or a method)")
    if fn.__closure__:
        return "", f"it is a closure over {', '.join(fn.__code__.co_freevars)}"
    if inspect.unwrap(fn) is not fn:
        return "", "it is a decorator's wrapper around another function"
    try:
        text = textwrap.dedent("".join(inspect.getsourcelines(fn)[0]))
        node = ast.parse(text).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return "", "its source is not available (made by exec or in an interactive session, or its file is gone)"
    if not isinstance(node, ast.FunctionDef) or node.name != fn.__name__:
        return "", "its source does not start with its `def`"
    text = "\n".join(text.splitlines()[node.lineno - 1:]).rstrip()  # decorators left out
    if not _compiles_to(text, fn):
        return "", f"its source file ({inspect.getsourcefile(fn)}) no longer holds the code that ran (edited since)"
    for imp in ast.walk(node):
        if isinstance(imp, (ast.Import, ast.ImportFrom)):
            modules = [a.name for a in imp.names] if isinstance(imp, ast.Import) else [imp.module or ""]
            if isinstance(imp, ast.ImportFrom) and imp.level or not all(map(_importable_where_loaded, modules)):
                return "", (f"it imports {', '.join(modules) or 'from its own package'} (line "
                            f"{imp.lineno - node.lineno + 1} of it), which the loading process may not have")
    reads: dict[str, None] = {}
    code_objects = [fn.__code__]
    while code_objects:
        code = code_objects.pop()
        reads.update((i.argval, None) for i in dis.get_instructions(code) if i.opname.endswith("_GLOBAL"))
        code_objects.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    for default in [*node.args.defaults, *(d for d in node.args.kw_defaults if d is not None)]:
        reads.update((n.id, None) for n in ast.walk(default) if isinstance(n, ast.Name))
    return text, list(reads)


def _compiles_to(text: str, fn: types.FunctionType) -> bool:
    """Whether `text` compiles to `fn`'s code (its file may have been edited since it was imported):
    the same names, arguments, locals and constants at every depth. Not the bytecode itself, which
    depends on the module around the function (3.11 calls a method of an imported module another way)."""
    flags = fn.__code__.co_flags & __future__.annotations.compiler_flag
    try:
        module_code = compile(text, "<copy>", "exec", flags=flags, dont_inherit=True)
    except SyntaxError:
        return False
    code = next((c for c in module_code.co_consts if isinstance(c, types.CodeType)), None)
    return code is not None and _code_shape(code) == _code_shape(fn.__code__)


def _code_shape(code: types.CodeType) -> tuple[Any, ...]:
    consts = tuple(_code_shape(c) if isinstance(c, types.CodeType) else (type(c).__name__, repr(c))
                   for c in code.co_consts)
    return (code.co_argcount, code.co_posonlyargcount, code.co_kwonlyargcount, code.co_varnames, code.co_names,
            code.co_freevars, code.co_cellvars, consts)


def _plain_name(path: str) -> bool:
    """`self.<path> = ...` means what it says: one identifier, and not a name nn.Module has itself."""
    return path.isidentifier() and not keyword.iskeyword(path) and not hasattr(nn.Module, path) \
        and path != "training"


def _assign(path: str, value: str) -> str:
    return f"self.{path} = {value}" if _plain_name(path) else f"_set(self, {path!r}, {value})"


def _fetch(gm: nn.Module, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _import_line(name: str, obj: Any) -> str | None:
    """The line that makes `name` mean `obj` in module.py ('' when nothing is needed), or None."""
    from torch.fx.graph import _custom_builtins

    if name in _custom_builtins and _custom_builtins[name].obj is obj:
        return _custom_builtins[name].import_str
    if getattr(builtins, name, None) is obj:
        return ""
    if isinstance(obj, types.ModuleType):
        if not _importable_where_loaded(obj.__name__) or _resolve(obj.__name__, "") is not obj:
            return None
        return f"import {obj.__name__}" if name == obj.__name__ else f"import {obj.__name__} as {name}"
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    if not isinstance(module, str) or not isinstance(qualname, str) or "<" in qualname:
        return None
    for mod in dict.fromkeys([module, module.lstrip("_")]):  # _operator → operator
        if _importable_where_loaded(mod) and _resolve(mod, qualname) is obj:
            top, _, rest = qualname.partition(".")
            if not rest:
                return f"from {mod} import {top}" if top == name else f"from {mod} import {top} as {name}"
            return f"import {mod}\n{name} = {mod}.{qualname}"
    return None


def _importable_where_loaded(module: str) -> bool:
    """Whether module.py may import `module` by name: the standard library's modules and those of an
    installed distribution exist wherever the same packages are installed. Any other (`__main__`, a
    script's folder, a checkout on sys.path, a torch.package archive's `<torch_package_0>.*`) is
    importable here, perhaps, but not where the source is loaded."""
    top = module.partition(".")[0]
    return top in sys.stdlib_module_names or top in sys.builtin_module_names or top in _installed_top_levels()


@functools.cache  # the installed packages: fixed for a process's life
def _installed_top_levels() -> frozenset[str]:
    from importlib.metadata import packages_distributions

    return frozenset(packages_distributions())


def _resolve(module: str, qualname: str) -> Any:
    try:
        obj: Any = importlib.import_module(module)
        for part in qualname.split(".") if qualname else ():
            obj = getattr(obj, part)
        return obj
    except Exception:
        return None


def _describe(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__qualname__)}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else ""


# ---------------------------------------------------------------------------------------------
# weights.safetensors
# ---------------------------------------------------------------------------------------------

def _dedupe(slots: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(name -> tensor to store, alias -> stored name): a tensor reachable under several names (tied
    weights) is stored once, under the first. Tensors that merely overlap are stored each on its own."""
    stored: dict[str, torch.Tensor] = {}
    tied: dict[str, str] = {}
    first: dict[tuple[Any, ...], str] = {}
    for name, tensor in slots.items():
        t = tensor.detach()
        key = (t.device, t.dtype, t.untyped_storage().data_ptr() if t.numel() else id(tensor), t.storage_offset(),
               tuple(t.shape), t.stride())
        if key in first:
            tied[name] = first[key]
        else:
            first[key] = name
            stored[name] = t
    return stored, tied


def _save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    try:
        from safetensors.torch import save_file
    except ImportError as exc:
        raise ConversionFailed("fx_source needs the 'safetensors' package on the worker to write its weights",
                               stage="export", hint=f"install fxport[engine] (it brings safetensors); or {_HINT}"
                               ) from exc

    out: dict[str, torch.Tensor] = {}
    seen_storage: set[int] = set()
    for name, t in tensors.items():
        if t.is_sparse or t.layout != torch.strided or t.is_quantized or t.device.type == "meta":
            raise ConversionFailed(
                f"fx_source: tensor {name!r} ({t.layout}, {t.dtype}, {t.device.type}) cannot be stored in "
                f"{WEIGHTS_FILE}: safetensors holds dense tensors only", stage="export",
                hint=f"keep such tensors out of the graph (dequantize or densify them in the model); or {_HINT}")
        t = t.cpu()
        ptr = t.untyped_storage().data_ptr() if t.numel() else 0
        # save_file refuses two entries over one storage (views, slices): those get their own copy
        if not t.is_contiguous() or (ptr and ptr in seen_storage):
            t = t.contiguous().clone()
        if ptr:
            seen_storage.add(ptr)
        out[name] = t
    try:
        save_file(out, str(path), metadata={"format": "pt"})
    except Exception as exc:
        raise ConversionFailed(f"fx_source: {WEIGHTS_FILE} could not be written: {type(exc).__name__}: "
                               f"{_first_line(exc)}", stage="export", hint=_HINT) from exc
