"""int8 Q/DQ on the FX graph: observers, placement, conversion, at both IR levels (tiny models)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from fxport.spec import QuantizationSpec
from fxport.workers.engine.quantize.int8 import DEQUANTIZE_OPS, QUANTIZE_OPS, count_qdq, qd
from fxport.workers.engine.quantize.layers import scan_layers
from fxport.workers.engine.quantize.observers import ActivationObserver, quantize_weight
from fxport.workers.engine.quantize.ptq import quantize_int8


class Block(nn.Module):
    """conv → relu → conv, a residual add, max pool, then a linear head: every placement rule once."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(4, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(8 * 4 * 4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.conv1(x))
        y = torch.relu(self.conv2(y) + y)
        return self.fc(torch.flatten(self.pool(y), 1))


def _capture(level: str) -> tuple[torch.fx.GraphModule, nn.Module]:
    torch.manual_seed(0)
    model = Block().eval()
    if level == "torch":
        return torch.fx.symbolic_trace(model), model
    batch = torch.export.Dim("batch", min=1, max=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ep = torch.export.export(model, (torch.randn(2, 4, 8, 8),), dynamic_shapes=({0: batch},))
    from fxport.workers.engine.capture import fx_from_exported

    return fx_from_exported(ep), model


def _data(n: int, seed: int) -> list[tuple[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 4, 8, 8, generator=g),) for _ in range(n)]


def test_observers_pick_ranges() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50_000, generator=g)
    x[0] = 30.0  # one outlier
    ranges = {}
    for kind in ("minmax", "percentile", "entropy"):
        obs = ActivationObserver(kind)
        obs(x)
        obs(torch.zeros(10))  # zeros (a ReLU's half) do not move a histogram-based range
        ranges[kind] = obs.amax()
    assert ranges["minmax"] == pytest.approx(30.0)
    assert 3.0 < ranges["percentile"] < 5.0 and 2.5 < ranges["entropy"] < 6.0
    ints = ActivationObserver("minmax")
    ints(torch.arange(4))
    assert not ints.float_tensor


def test_weights_are_symmetric_per_channel_int8() -> None:
    w = torch.randn(6, 3, 3, 3)
    w[2] *= 100  # one channel far larger: per-channel scales keep the others precise
    q, scale = quantize_weight(w)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127 and int(q.min()) >= -127
    assert scale.shape == (6,) and float(scale[2] / scale[0]) > 50
    err = (q.float() * scale[:, None, None, None] - w).abs().amax(dim=(1, 2, 3))
    assert bool((err <= scale / 2 + 1e-6).all())


@pytest.mark.parametrize("level", ["torch", "aten"])
def test_qdq_graph_at_both_levels(level: str) -> None:
    gm, model = _capture(level)
    assert [layer.name for layer in scan_layers(gm).layers] == ["conv1", "conv2", "fc"]
    result = quantize_int8(gm, _data(3, 1), _data(2, 2), QuantizationSpec())
    qgm = result.graph_module
    qgm.graph.lint()
    q_nodes = [n for n in qgm.graph.nodes if n.op == "call_function" and n.target in QUANTIZE_OPS]
    for q in q_nodes:  # symmetric int8: zero point 0, full range; each pair read by one node
        assert q.args[2:] == (0, -128, 127, torch.int8)
        assert [u.target for u in q.users] == [qd.dequantize_per_tensor.default] and len(next(iter(q.users)).users) == 1
    wdq = [n for n in qgm.graph.nodes if n.op == "call_function" and n.target is qd.dequantize_per_channel.default]
    assert len(wdq) == 3 and all(n.args[3:] == (0, -127, 127, torch.int8) for n in wdq)
    # no fp32 copy of a quantized weight is left in the module
    assert not [name for name, t in qgm.state_dict().items() if name.endswith("weight") and t.is_floating_point()]
    counts = count_qdq(qgm)
    assert counts["quantize"] == len(q_nodes) and counts["dequantize"] == len(q_nodes) + 3
    # the ReLU after conv1 shares conv1's output scale (one grid: no second rounding)
    scales = {q.meta["fxport_qdq"]["tensor"]: q.args[1] for q in q_nodes}
    relu1 = next(n.name for n in gm.graph.nodes if n.op in ("call_function", "call_method") and "relu" in str(n.target))
    conv1 = result.layers[0].node
    assert scales[conv1] == pytest.approx(scales[relu1], rel=1e-6)
    x = _data(1, 9)[0]
    with torch.no_grad():
        ref, got = model(*x), qgm(*x)
    assert torch.nn.functional.cosine_similarity(ref.flatten(), got.flatten(), dim=0) > 0.99
    report = result.report
    assert [r["node"] for r in report["layers"]] == ["conv1", "conv2", "fc"]
    assert all(r["sqnr_db"] > 20 and not r["fallback"] for r in report["layers"])
    assert report["end_to_end"]["cosine"] > 0.99 and report["worst"][0] in ("conv1", "conv2", "fc")


def test_gm_is_not_modified() -> None:
    gm, _ = _capture("torch")
    before = gm.code
    weight = gm.conv1.weight.detach().clone()
    quantize_int8(gm, _data(1, 1), _data(1, 2), QuantizationSpec())
    assert gm.code == before and torch.equal(gm.conv1.weight, weight)
    assert not any(n.target in QUANTIZE_OPS | DEQUANTIZE_OPS for n in gm.graph.nodes if n.op == "call_function")


def test_fallback_keeps_a_layer_float() -> None:
    gm, _ = _capture("aten")
    result = quantize_int8(gm, _data(2, 1), _data(1, 2), QuantizationSpec())
    partial = result.convert_with({"conv1", "fc"})
    assert partial.fallback == ["conv2"] and set(partial.layer_nodes) == {"conv1", "fc"}
    conv2 = next(n for n in partial.gm.graph.nodes if n.name == result.layers[1].node)
    assert conv2.args[1].op == "get_attr"  # its fp32 weight, not a dequantized int8 one


class Gpt2Style(nn.Module):
    """GPT-2's Conv1D: addmm(bias, x, W) with W stored [in, out] — output channels on axis 1."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16, 24) * 0.1)
        self.bias = nn.Parameter(torch.randn(24) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x.view(-1, 16), self.weight).view(x.shape[0], -1, 24)


def test_matmul_weights_quantize_per_column() -> None:
    model = Gpt2Style().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ep = torch.export.export(model, (torch.randn(2, 5, 16),))
    from fxport.workers.engine.capture import fx_from_exported

    gm = fx_from_exported(ep)
    (layer,) = scan_layers(gm).layers
    assert (layer.op, layer.axis, layer.x_arg, layer.w_arg, layer.out_channels) == ("matmul", 1, 1, 2, 24)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(2, 5, 16, generator=g),) for _ in range(3)]  # the export fixed the batch at 2
    result = quantize_int8(gm, data[:2], data[2:], QuantizationSpec())
    (wdq,) = [n for n in result.graph_module.graph.nodes if n.target is qd.dequantize_per_channel.default]
    assert wdq.args[3] == 1 and fetch_scale(result.graph_module, wdq).shape == (24,)
    assert result.report["end_to_end"]["cosine"] > 0.99


def fetch_scale(gm: torch.fx.GraphModule, wdq: torch.fx.Node) -> torch.Tensor:
    from fxport.workers.engine.passes.graph_attrs import fetch_attr

    return fetch_attr(gm, wdq.args[1].target)
