"""How far a quantized graph is from its float graph: per layer and end to end, on held-out data.

Per layer, two views of the same layer output:
- `sqnr_db` / `cosine` — the layer's *own* damage: its quantized form (input Q/DQ, int8
  weight, output Q/DQ) applied to the float model's input for it. This ranks layers for the
  fallback: a layer late in the network is not blamed for what earlier layers did.
- `cumulative_sqnr_db` / `cumulative_cosine` — the layer's output inside the quantized
  model, everything before it quantized too: where the error stands at that depth.
End to end: cosine, SQNR and top-1 agreement (argmax over the last dim) of every output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch.fx import GraphModule, Interpreter, Node

from fxport.workers.engine.passes import target_fn, target_name
from fxport.workers.engine.passes.graph_attrs import fetch_attr
from fxport.workers.engine.quantize.int8 import QdqGraph
from fxport.workers.engine.quantize.layers import Layer
from fxport.workers.engine.quantize.observers import quantize_weight
from fxport.workers.engine.quantize.scheme import fake_quantize

MAX_SQNR_DB = 200.0  # identical tensors: a finite, JSON-safe ceiling


@dataclass
class Agreement:
    """Streaming cosine / SQNR between a reference tensor and an approximation of it."""

    signal: float = 0.0  # Σ ref²
    noise: float = 0.0  # Σ (ref − got)²
    dot: float = 0.0
    got_sq: float = 0.0
    rows: int = 0
    top1_same: int = 0

    def add(self, ref: torch.Tensor, got: torch.Tensor, *, top1: bool = False) -> None:
        r, g = ref.detach().double().reshape(-1), got.detach().double().reshape(-1)
        mask = torch.isfinite(r) & torch.isfinite(g)
        r, g = r[mask], g[mask]
        self.signal += float(r @ r)
        self.noise += float((r - g) @ (r - g))
        self.dot += float(r @ g)
        self.got_sq += float(g @ g)
        if top1 and ref.dim() >= 2 and ref.shape[-1] >= 2:
            a = ref.reshape(-1, ref.shape[-1]).argmax(-1)
            b = got.reshape(-1, got.shape[-1]).argmax(-1)
            self.rows += int(a.numel())
            self.top1_same += int((a == b).sum())

    @property
    def sqnr_db(self) -> float:
        if self.noise <= 0:
            return MAX_SQNR_DB
        if self.signal <= 0:
            return -MAX_SQNR_DB
        return min(MAX_SQNR_DB, 10.0 * math.log10(self.signal / self.noise))

    @property
    def cosine(self) -> float:
        if self.signal <= 0 or self.got_sq <= 0:
            return 1.0 if self.signal == self.got_sq else 0.0
        return max(-1.0, min(1.0, self.dot / math.sqrt(self.signal * self.got_sq)))

    @property
    def top1(self) -> float | None:
        return self.top1_same / self.rows if self.rows else None


class _Recorder(Interpreter):
    """Runs a graph and keeps copies of the named nodes' values (in-place ops come later)."""

    def __init__(self, gm: GraphModule, wanted: set[str]) -> None:
        super().__init__(gm)
        self.wanted: set[str] = wanted
        self.values: dict[str, Any] = {}

    def run_node(self, n: Node) -> Any:
        out = super().run_node(n)
        if n.name in self.wanted:
            self.values[n.name] = out.detach().clone() if isinstance(out, torch.Tensor) else out
        return out


def leaves(out: Any) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


@dataclass
class EndToEnd:
    outputs: list[Agreement] = field(default_factory=list)
    samples: int = 0

    def add(self, ref: list[torch.Tensor], got: list[torch.Tensor]) -> None:
        if not self.outputs:
            self.outputs = [Agreement() for _ in ref]
        for acc, a, b in zip(self.outputs, ref, got):
            if a.is_floating_point():
                acc.add(a, b, top1=True)

    def summary(self) -> dict[str, Any]:
        float_outs = [o for o in self.outputs if o.signal > 0 or o.noise > 0]
        tops = [o.top1 for o in float_outs if o.top1 is not None]
        return {
            "cosine": min((o.cosine for o in float_outs), default=1.0),
            "sqnr_db": min((o.sqnr_db for o in float_outs), default=MAX_SQNR_DB),
            "top1_agreement": min(tops) if tops else None,
            "samples": self.samples,
            "per_output": [{"cosine": o.cosine, "sqnr_db": o.sqnr_db, "top1_agreement": o.top1} for o in self.outputs],
        }


def float_outputs(gm: GraphModule, batches: list[tuple[Any, ...]]) -> list[list[torch.Tensor]]:
    with torch.no_grad():
        return [[t.detach().clone() for t in leaves(gm(*args))] for args in batches]


def end_to_end(qgm: GraphModule, batches: list[tuple[Any, ...]], reference: list[list[torch.Tensor]]) -> dict[str, Any]:
    e2e = EndToEnd()
    with torch.no_grad():
        for args, ref in zip(batches, reference):
            e2e.add(ref, leaves(qgm(*args)))
            e2e.samples += _batch_size(args)
    return e2e.summary()


def _batch_size(args: tuple[Any, ...]) -> int:
    first = next((a for a in args if isinstance(a, torch.Tensor) and a.dim() > 0), None)
    return int(first.shape[0]) if first is not None else 1


def per_layer(gm: GraphModule, qdq: QdqGraph, layers: list[Layer], batches: list[tuple[Any, ...]]
              ) -> tuple[dict[str, dict[str, float]], dict[str, Any]]:
    """Per-layer metrics of the quantized layers of `qdq` against `gm`, and the end-to-end summary."""
    quantized = [layer for layer in layers if layer.name in qdq.layer_nodes]
    nodes = {n.name: n for n in gm.graph.nodes}
    wanted_f: set[str] = set()
    for layer in quantized:
        node = nodes[layer.node]
        wanted_f.add(layer.node)
        wanted_f.update(a.name for a in node.all_input_nodes if a.op != "get_attr")
    wanted_q = set(qdq.layer_outputs.values())
    own = {layer.name: Agreement() for layer in quantized}
    cumulative = {layer.name: Agreement() for layer in quantized}
    out_elems: dict[str, int] = {}
    weights = {layer.name: _dequantized_weight(gm, layer, qdq.scheme.weight_qmax) for layer in quantized}
    e2e = EndToEnd()
    with torch.no_grad():
        for args in batches:
            rec_f, rec_q = _Recorder(gm, wanted_f), _Recorder(qdq.gm, wanted_q)
            ref_out = leaves(rec_f.run(*args))
            got_out = leaves(rec_q.run(*args))
            e2e.add(ref_out, got_out)
            e2e.samples += _batch_size(args)
            for layer in quantized:
                node = nodes[layer.node]
                y = rec_f.values[layer.node]
                x = rec_f.values[layer.activation(node).name]
                scale_in = qdq.input_scales[layer.name]
                xq = x if math.isnan(scale_in) else fake_quantize(x, scale_in, qdq.input_zero_points[layer.name],
                                                                  qdq.scheme)
                y_own = _layer_forward(gm, node, layer, xq, weights[layer.name], rec_f.values)
                if layer.name in qdq.output_scales:
                    y_own = fake_quantize(y_own, qdq.output_scales[layer.name],
                                          qdq.output_zero_points[layer.name], qdq.scheme)
                y_cum = rec_q.values[qdq.layer_outputs[layer.name]]
                if layer.name in qdq.activation_after:
                    act = nodes[qdq.activation_after[layer.name]]
                    y, y_own, y_cum = (_apply(gm, act, t, rec_f.values) for t in (y, y_own, y_cum))
                own[layer.name].add(y, y_own)
                cumulative[layer.name].add(y, y_cum)
                out_elems[layer.name] = int(y[0].numel()) if y.dim() > 0 else 1
    metrics = {
        layer.name: {
            "sqnr_db": own[layer.name].sqnr_db, "cosine": own[layer.name].cosine,
            "cumulative_sqnr_db": cumulative[layer.name].sqnr_db,
            "cumulative_cosine": cumulative[layer.name].cosine,
            "macs": out_elems.get(layer.name, 0) * layer.macs_per_output,
        }
        for layer in quantized
    }
    return metrics, e2e.summary()


def _apply(gm: GraphModule, node: Node, x: torch.Tensor, values: dict[str, Any]) -> torch.Tensor:
    """The float graph's one-input op `node` (a ReLU or clamp) applied to `x` (never in place)."""
    x = x.clone()
    rest = [fetch_attr(gm, target_name(a)) if isinstance(a, Node) and a.op == "get_attr" else
            values.get(a.name) if isinstance(a, Node) else a for a in node.args[1:]]
    if node.op == "call_module":
        return cast(torch.Tensor, gm.get_submodule(str(node.target))(x))
    if node.op == "call_method":
        return cast(torch.Tensor, getattr(x, str(node.target))(*rest, **node.kwargs))
    return cast(torch.Tensor, target_fn(node)(x, *rest, **node.kwargs))


def _dequantized_weight(gm: GraphModule, layer: Layer, qmax: int) -> torch.Tensor:
    w = fetch_attr(gm, layer.weight)
    q, scale = quantize_weight(w, axis=layer.axis, qmax=qmax)
    shape = [1] * w.dim()
    shape[layer.axis] = -1
    return (q.float() * scale.reshape(shape)).to(w.dtype)


def _layer_forward(gm: GraphModule, node: Node, layer: Layer, x: torch.Tensor, weight: torch.Tensor,
                   values: dict[str, Any]) -> torch.Tensor:
    """The float graph's layer `node`, with input `x` and weight `weight` swapped in."""
    if node.op == "call_module":
        mod: Any = gm.get_submodule(str(node.target))  # an nn.Conv*d, or an nn.Linear (layer.op says which)
        if layer.op == "linear":
            return F.linear(x, weight, mod.bias)
        return cast(torch.Tensor, mod._conv_forward(x, weight, mod.bias))

    def value(a: Any) -> Any:
        if isinstance(a, Node):
            return fetch_attr(gm, target_name(a)) if a.op == "get_attr" else values[a.name]
        if isinstance(a, (list, tuple)):
            return type(a)(value(b) for b in a)
        return a

    args = [value(a) for a in node.args]
    args[layer.x_arg], args[layer.w_arg] = x, weight
    kwargs = {k: value(v) for k, v in node.kwargs.items()}
    return cast(torch.Tensor, target_fn(node)(*args, **kwargs))
