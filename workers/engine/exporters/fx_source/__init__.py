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

A graph whose code goes through pytrees (torch.export's own module, `ep.module()`: its forward()
flattens the arguments by the program's in_spec and builds the result by its out_spec) is written
as plain positional code where its inputs are tensors and its outputs nest only tuples, lists and
dicts; otherwise forward() keeps the pytree calls, and module.py writes the two specs as Python
(pytree_io.py). torch.export's `_guards_fn` call is dropped: it exists only as a function object.

The written module.py is imported once before the exporter returns: a source that cannot even be
imported fails the fx_source target at once, naming its line.

Where each part lives:

    codegen.py         module.py itself: the class, its __init__ and forward(), from the graph
    constructors.py    a called torch.nn module as its constructor call, checked by rebuilding it;
                       the modules that have none traced into the graph
    module_globals.py  the names module.py binds at its top: imports, copied functions, literals
    pytree_io.py       torch.export's module: its guard call dropped, its pytree inputs and outputs
    weights.py         weights.safetensors: every tensor once (tied tensors under their first name)
    loading.py         the written module.py imported once, to fail at once on a source that cannot
    common.py          what the parts share: the file and class names, literals, error wording
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch.fx import GraphModule

from fxport.errors import ConversionFailed
from fxport.workers.engine.exporters.fx_source.codegen import _SourceWriter
from fxport.workers.engine.exporters.fx_source.common import _HINT, MODULE_CLASS, WEIGHTS_FILE
from fxport.workers.engine.exporters.fx_source.constructors import _inline_unbuildable_modules, constructor_source
from fxport.workers.engine.exporters.fx_source.loading import check_imports
from fxport.workers.engine.exporters.fx_source.pytree_io import plain_io
from fxport.workers.engine.exporters.fx_source.weights import _save_tensors

__all__ = ["MODULE_CLASS", "WEIGHTS_FILE", "FxSourceFromGraphModule", "check_imports", "constructor_source"]


class FxSourceFromGraphModule:
    """`imports`: extra import lines module.py needs (an int8 graph's Q/DQ op library)."""

    def __init__(self, gm: GraphModule, imports: tuple[str, ...] = ()) -> None:
        self.gm, self.imports = gm, imports

    def __call__(self, folder: Path) -> Path:
        gm, pytree_io = plain_io(self.gm)  # torch.export's module: its guard call dropped, its pytree code kept
        _refuse_higher_order_ops(gm)
        folder.mkdir(parents=True, exist_ok=True)
        gm = _inline_unbuildable_modules(gm)
        source, tensors = _SourceWriter(gm, self.imports, pytree_io).write()
        (folder / "module.py").write_text(source)
        check_imports(folder / "module.py")
        (folder / "__init__.py").write_text(f"from .module import {MODULE_CLASS}  # noqa: F401\n")
        _save_tensors(tensors, folder / WEIGHTS_FILE)
        # safetensors creates its file owner-only; give it the mode the source files got (the umask's),
        # through a descriptor: the sandbox refuses chmod by path (sandbox/confine.py)
        fd = os.open(folder / WEIGHTS_FILE, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            os.fchmod(fd, (folder / "module.py").stat().st_mode & 0o777)
        finally:
            os.close(fd)
        return folder


def _refuse_higher_order_ops(gm: GraphModule) -> None:
    """torch.cond, torch.while_loop and their kin take graphs as operands, which module.py has no way to
    write: named here, with the node, before anything is written."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator):
            raise ConversionFailed(
                f"fx_source: node {node.name!r} calls torch.ops.higher_order.{node.target.name()}, which takes "
                "graphs as operands (torch.cond, torch.while_loop, torch.map, ...): module.py has no way to "
                "write them", stage="export",
                hint=f"express the branch with tensor ops (torch.where) where both sides can run; or {_HINT}")
