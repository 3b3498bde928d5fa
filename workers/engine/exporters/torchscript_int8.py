"""TorchScript of an int8 QDQ graph: real int8 kernels (fbgemm/x86) where the ops allow, fake-quant otherwise.

The QDQ graph's `quantized_decomposed` ops exist only in Python (their library must be
imported), so a TorchScript archive cannot carry them. `TorchScriptInt8FromQdqGraph` first
tries `lower_to_quantized_kernels` (quantize/lowering.py: Conv/Linear/add/ReLU/pooling on
quantized tensors, the same scales and rounding as the QDQ graph); when a Q/DQ pattern has no
quantized kernel it keeps that part as `fake_quantize_per_tensor_affine` on float tensors — the
same numbers, core aten ops only, but no speed-up there. `note` says which it got.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.fx import GraphModule

from fxport.workers.engine.exporters.torchscript import TorchScriptFromGraphModule
from fxport.workers.engine.passes.graph_attrs import fetch_attr, prune_unused_attrs, unique_name
from fxport.workers.engine.quantize.int8 import copy_graph_module, qd


def fake_quant_graph(qgm: GraphModule) -> GraphModule:
    """A copy of a QDQ graph in core aten ops: Q→DQ ⇒ fake_quantize_per_tensor_affine, int8 weight ⇒ its float value."""
    gm = copy_graph_module(qgm)
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is qd.dequantize_per_tensor.default:
            q = node.args[0]
            x, scale, zero, qmin, qmax, _ = q.args
            with graph.inserting_before(node):
                fq = graph.call_function(torch.fake_quantize_per_tensor_affine, (x, scale, zero, qmin, qmax))
            node.replace_all_uses_with(fq)
            graph.erase_node(node)
            if not q.users:
                graph.erase_node(q)
        elif node.target is qd.dequantize_per_channel.default:
            w_node, s_node, z_node, axis = node.args[:4]
            w = fetch_attr(gm, w_node.target).float()
            s = fetch_attr(gm, s_node.target).float()
            z = fetch_attr(gm, z_node.target).float()
            shape = [1] * w.dim()
            shape[axis] = -1
            value = (w - z.reshape(shape)) * s.reshape(shape)
            name = unique_name(gm, "_fxport_dequantized_weight")
            gm.register_buffer(name, value)
            with graph.inserting_before(node):
                attr = graph.get_attr(name)
            node.replace_all_uses_with(attr)
            graph.erase_node(node)
    graph.eliminate_dead_code()
    prune_unused_attrs(gm)
    graph.lint()
    gm.recompile()
    return gm


class TorchScriptInt8FromQdqGraph:
    """Lazy exporter: `__call__(path)` writes the archive; `note` and `int8_kernels` describe it."""

    def __init__(self, qgm: GraphModule, example_inputs: tuple[Any, ...], *,
                 check_inputs: Sequence[tuple[Any, ...]] = (), lower: bool = True,
                 extra_files: dict[str, str] | None = None) -> None:
        self.qgm, self.example_inputs, self.check_inputs, self.lower = qgm, example_inputs, list(check_inputs), lower
        self.extra_files = dict(extra_files or {})
        self.note = ""
        self.int8_kernels: dict[str, int] = {}

    def __call__(self, path: Path) -> Path:
        module: GraphModule | None = None
        if self.lower:
            try:
                from fxport.workers.engine.quantize.lowering import lower_to_quantized_kernels

                lowered = lower_to_quantized_kernels(self.qgm)
                module, self.int8_kernels, left = lowered.graph_module, lowered.kernels, lowered.float_islands
                self.note = (f"int8 kernels (quantized engine {torch.backends.quantized.engine}): "
                             + ", ".join(f"{k} x{v}" for k, v in sorted(self.int8_kernels.items()))
                             + (f"; {left} ops run in float between int8 tensors" if left else ""))
            except Exception as exc:  # a pattern the lowering does not know: the faithful slow form
                module = None
                self.note = f"fake-quant graph (int8 lowering not possible: {type(exc).__name__}: {exc})"
        if module is None:
            module = fake_quant_graph(self.qgm)
            if not self.note:
                self.note = "fake-quant graph (float kernels with int8 rounding)"
        exporter = TorchScriptFromGraphModule(module, self.example_inputs, "trace", check_inputs=self.check_inputs,
                                              extra_files=self.extra_files)
        return exporter(path)
