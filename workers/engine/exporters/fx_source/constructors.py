"""Modules the graph calls: a torch.nn leaf is written as its constructor call, found from the module's
attributes and checked by rebuilding it; any other called module is traced into the graph."""

from __future__ import annotations

import inspect
import math
import warnings
import weakref
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule

from fxport.errors import ConversionFailed
from fxport.workers.engine.exporters.fx_source.common import _HINT, _first_line, _literal, _NotLiteral, _resolve

# vars() entries two modules may differ in and still compute the same (eval() is set after loading)
_STATE_KEYS = {"_parameters", "_buffers", "_modules", "training"}


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
