"""module.py: the class MODULE_CLASS, its modules rebuilt from their constructor arguments, the graph's
own tensors declared by shape, forward() as FX writes it."""

from __future__ import annotations

import ast
import keyword
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule

from fxport.errors import ConversionFailed
from fxport.workers.engine.exporters.fx_source.common import _HINT, MODULE_CLASS, WEIGHTS_FILE, _literal, _NotLiteral
from fxport.workers.engine.exporters.fx_source.constructors import constructor_source
from fxport.workers.engine.exporters.fx_source.module_globals import _ModuleGlobals
from fxport.workers.engine.exporters.fx_source.pytree_io import PytreeIO, SpecWriter, registration_check
from fxport.workers.engine.exporters.fx_source.weights import _dedupe


class _SourceWriter:
    """`pytree_io`: the specs of a graph whose forward() flattens and unflattens by them (pytree_io.py)."""

    def __init__(self, gm: GraphModule, imports: tuple[str, ...], pytree_io: PytreeIO | None = None) -> None:
        self.gm, self.imports, self.pytree_io = gm, imports, pytree_io

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
        specs = self._specs_text(globals_)
        if specs:
            init.insert(len(init) - 1, "self._in_spec, self._out_spec = IN_SPEC, OUT_SPEC  # read by forward()")
        source = self._module_text(globals_, forward, init, tied, specs)
        return source, stored

    def _specs_text(self, names: _ModuleGlobals) -> str:
        """IN_SPEC and OUT_SPEC as Python, for a graph whose forward() flattens and unflattens by them."""
        if self.pytree_io is None:
            return ""
        writer = SpecWriter(names.bind)
        in_spec = writer.source(self.pytree_io.in_spec, "inputs' structure (in_spec)")
        out_spec = writer.source(self.pytree_io.out_spec, "outputs' structure (out_spec)")
        return ("\n\n# what forward() takes and returns, as torch.export recorded it: forward() flattens its\n"
                "# arguments by IN_SPEC into the graph's inputs, and builds its result from its outputs by OUT_SPEC\n"
                f"LEAF = treespec_leaf()\nIN_SPEC = {in_spec}\nOUT_SPEC = {out_spec}\n"
                + registration_check(writer.registered))

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

    def _module_text(self, names: _ModuleGlobals, forward: str, init: list[str], tied: dict[str, str],
                     specs: str) -> str:
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
{names.definitions_text()}{specs}

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
