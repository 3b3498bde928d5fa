"""The names module.py binds at its top level for the code it runs: an import line where the object's
module is importable wherever the source loads, else a copy of the function's source, else a literal."""

from __future__ import annotations
import __future__

import ast
import builtins
import dis
import functools
import inspect
import os
import sys
import textwrap
import types
from typing import Any

import torch

from fxport.errors import ConversionFailed
from fxport.workers.engine.exporters.fx_source.common import (
    _HINT,
    MODULE_CLASS,
    _describe,
    _literal,
    _NotLiteral,
    _resolve,
)

# names module.py defines itself: a graph global of the same name would shadow them
# ("annotations": `from __future__ import annotations` binds it where functions are copied)
_RESERVED = {"os", "safetensors", "WEIGHTS", "TIED", "_set", "annotations", MODULE_CLASS,
             "LEAF", "IN_SPEC", "OUT_SPEC", "_UNREGISTERED"}  # the last four: a pytree module's (pytree_io.py)


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
