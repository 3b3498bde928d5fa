"""int8 schemes follow the runtime each artifact is for (issue 20): onnxruntime gets asymmetric uint8
activations (and 7-bit weights where the CPU would saturate), TensorRT symmetric int8; with both, two
ONNX models, each verified for its runtime, with its own per-layer report and fallback."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F

from fxport.errors import SpecError
from fxport.spec import parse_spec
from fxport.workers.engine.pipeline import convert
from fxport.workers.engine.quantize.observers import ActivationObserver, quantize_weight
from fxport.workers.engine.quantize.scheme import TENSORRT, ActivationRange, fake_quantize, scheme_for
from tests.models import get
from tests.workers.engine.conftest import save_pt2
from tests.workers.engine.quantize.test_quantize_pipeline import _activation_zero_point_types, _spec

INT16_MAX = 32767


# --------------------------------------------------------------------------------------
# Which schemes a spec asks for
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("targets", "runtime", "expected"), [
    (["onnx"], None, ["onnxruntime"]),
    (["onnx", "torchscript", "exported_program"], None, ["onnxruntime"]),
    (["tensorrt"], None, ["tensorrt"]),
    (["onnx", "tensorrt"], None, ["onnxruntime", "tensorrt"]),
    (["torchscript", "tensorrt"], None, ["onnxruntime", "tensorrt"]),
    (["onnx"], "tensorrt", ["tensorrt"]),  # an ONNX for a TensorRT elsewhere (Triton's TensorRT backend)
    (["onnx", "tensorrt"], "tensorrt", ["tensorrt"]),
])
def test_the_scheme_follows_the_targets(targets, runtime, expected) -> None:
    q: dict[str, Any] = {"runtime": runtime} if runtime else {}
    spec = parse_spec({"targets": targets, "precision": "int8", "quantization": q})
    assert spec.int8_runtimes() == expected
    assert parse_spec({"targets": targets}).int8_runtimes() == []  # fp32: no scheme


@pytest.mark.parametrize(("spec", "words"), [
    ({"targets": ["onnx", "tensorrt"], "precision": "int8", "quantization": {"runtime": "onnxruntime"}},
     "cannot feed the tensorrt target"),
    ({"targets": ["onnx"], "precision": "int8", "quantization": {"runtime": "tensorrt", "reduce_range": True}},
     "reduce_range applies to the onnxruntime scheme"),
    ({"targets": ["onnx"], "quantization": {"runtime": "onnxruntime"}}, "precision is not int8"),
    ({"targets": ["onnx"], "precision": "int8", "quantization": {"runtime": "openvino"}}, "quantization.runtime"),
])
def test_scheme_options_that_cannot_hold_are_refused_by_name(spec, words) -> None:
    with pytest.raises(SpecError, match=words):
        parse_spec(spec)


def test_the_scheme_options_leave_fp32_digests_alone_and_change_int8_cache_keys() -> None:
    from fxport.cache import spec_digest

    assert "runtime" not in parse_spec({"targets": ["onnx"]}).normalized()["quantization"]
    a = parse_spec({"targets": ["onnx", "tensorrt"], "precision": "int8"})
    b = parse_spec({"targets": ["onnx", "tensorrt"], "precision": "int8", "quantization": {"runtime": "tensorrt"}})
    assert spec_digest(a) != spec_digest(b)


# --------------------------------------------------------------------------------------
# The numbers of each scheme
# --------------------------------------------------------------------------------------


def test_asymmetric_qparams_hold_zero_exactly_and_use_the_whole_uint8_range() -> None:
    ort = scheme_for("onnxruntime")
    scale, zero = ort.qparams(ActivationRange(lo=0.0, hi=6.0, amax=6.0))  # after a ReLU
    assert zero == 0 and scale == pytest.approx(6.0 / 255)
    scale, zero = ort.qparams(ActivationRange(lo=-1.0, hi=3.0, amax=3.0))
    assert zero == round(1.0 / scale) and scale == pytest.approx(4.0 / 255)
    # the observer's clipping (amax below the extremes) applies to each side
    scale, zero = ort.qparams(ActivationRange(lo=-10.0, hi=2.0, amax=4.0))
    assert scale == pytest.approx(6.0 / 255) and zero == round(4.0 / scale)
    # symmetric: zero point 0, what TensorRT takes
    assert TENSORRT.qparams(ActivationRange(lo=0.0, hi=6.0, amax=6.0)) == (pytest.approx(6.0 / 127), 0)
    x = torch.linspace(-1.0, 3.0, 101)
    s, z = ort.qparams(ActivationRange(lo=-1.0, hi=3.0, amax=3.0))
    assert (fake_quantize(x, s, z, ort) - x).abs().max() <= s / 2 + 1e-6
    assert float(fake_quantize(torch.zeros(1), s, z, ort)) == 0.0


def test_the_observer_keeps_signed_extremes_for_the_asymmetric_scheme() -> None:
    obs = ActivationObserver("minmax")
    obs(torch.tensor([-0.5, 2.0]))
    obs(torch.tensor([0.25, float("inf"), -1.5]))
    r = obs.range()
    assert (r.lo, r.hi) == (-1.5, 2.0) and r.amax == 2.0


def _conv_pairs(model: torch.nn.Module, layer: torch.nn.Conv2d, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The conv's input (im2col rows, K in weight order) and its weight as (out channels, K)."""
    seen: dict[str, torch.Tensor] = {}
    handle = layer.register_forward_pre_hook(lambda _m, args: seen.setdefault("x", args[0].detach()))
    with torch.no_grad():
        model(x)
    handle.remove()
    cols = F.unfold(seen["x"], layer.kernel_size, dilation=layer.dilation, padding=layer.padding, stride=layer.stride)
    return cols.transpose(1, 2).reshape(-1, cols.shape[1]), layer.weight.detach().reshape(layer.weight.shape[0], -1)


def saturation_error(x_u8: np.ndarray, w_s8: np.ndarray, zero_point: int) -> float:
    """The relative error a layer's int32 output gets when u8×s8 product pairs are summed as vpmaddubsw
    (x86 int8 GEMM without VNNI) sums them, into a saturating int16: x[2k]·w[2k] + x[2k+1]·w[2k+1]."""
    k = x_u8.shape[1] - x_u8.shape[1] % 2
    x, w = x_u8[:, :k].astype(np.int64), w_s8[:, :k].astype(np.int64)
    pairs = x[:, None, 0::2] * w[None, :, 0::2] + x[:, None, 1::2] * w[None, :, 1::2]
    exact = pairs.sum(-1)
    saturated = np.clip(pairs, -INT16_MAX - 1, INT16_MAX).sum(-1)
    true = exact - zero_point * w.sum(-1)[None, :]  # the kernel's zero-point correction is exact
    return float(np.linalg.norm(exact - saturated) / np.linalg.norm(true))


@pytest.mark.parametrize("name", ["layer1.0.conv2", "layer2.0.conv1", "layer3.1.conv2", "layer4.0.conv1"])
def test_on_a_cpu_without_vnni_only_the_symmetric_scheme_saturates(name) -> None:
    """Why the runtime picks the scheme, shown on real layers' calibrated inputs: onnxruntime on x86
    runs a symmetric int8 activation shifted by 128 (as uint8), so its pairs are large and overflow
    vpmaddubsw's int16 — several % of error per layer, measured 2.5-7.7% here; the asymmetric uint8
    activation after a ReLU is mostly small, and with 7-bit weights (reduce_range) no pair can overflow
    at all (2 × 255 × 63 < 32767). This CPU may have VNNI: the arithmetic is emulated."""
    case = get("resnet18_small")
    model = case.build().eval()
    layer = model.get_submodule(name)  # each reads a ReLU's output
    cols, weight = _conv_pairs(model, layer, case.example_inputs(4)[0])
    obs = ActivationObserver("minmax")
    obs(cols)
    errors = {}
    for label, scheme in (("tensorrt", TENSORRT), ("onnxruntime", scheme_for("onnxruntime")),
                          ("onnxruntime reduce_range", scheme_for("onnxruntime", reduce_range=True))):
        scale, zero = scheme.qparams(obs.range())
        q = torch.clamp(torch.round(cols / scale) + zero, scheme.act_qmin, scheme.act_qmax)
        shift = 128 if scheme.act_qmin < 0 else 0  # what the u8×s8 kernel multiplies
        w_s8, _ = quantize_weight(weight, qmax=scheme.weight_qmax)
        errors[label] = saturation_error((q + shift).numpy()[:256], w_s8.numpy(), zero + shift)
    assert errors["onnxruntime reduce_range"] == 0.0
    assert errors["tensorrt"] > 0.01, errors
    assert errors["onnxruntime"] < errors["tensorrt"] / 5, errors


# --------------------------------------------------------------------------------------
# Through convert: one artifact per runtime, each verified for it
# --------------------------------------------------------------------------------------


def _int8_spec(targets: tuple[str, ...], **quantization: Any) -> Any:
    return _spec("resnet18_small", "int8", targets, quantization={"calibration": {"samples": 16}, **quantization})


@pytest.fixture(scope="module")
def both_schemes(tmp_path_factory) -> tuple[dict[str, Any], Path]:
    """int8 with CPU targets and tensorrt (built later on the GPU queue, as a worker's CPU stage does)."""
    tmp = tmp_path_factory.mktemp("schemes")
    model = save_pt2(get("resnet18_small"), tmp / "m.pt2")
    out = tmp / "out"
    m = convert(model, _int8_spec(("onnx", "torchscript", "tensorrt")), out, deferred_targets=("tensorrt",))
    return m, out


def test_cpu_and_tensorrt_targets_get_an_onnx_each_named_apart(both_schemes) -> None:
    m, out = both_schemes
    assert m["status"] == "succeeded"
    schemes = {a["path"]: a["int8_scheme"] for a in m["artifacts"]}
    assert schemes == {"model.onnx": "onnxruntime", "model.ts": "onnxruntime", "model.tensorrt.onnx": "tensorrt"}
    assert _activation_zero_point_types(out / "model.onnx") == {"UINT8"}
    assert _activation_zero_point_types(out / "model.tensorrt.onnx") == {"INT8"}
    q = m["quantization"]
    assert q["runtime"] == "onnxruntime" and set(q["schemes"]) == {"onnxruntime", "tensorrt"}
    assert q["schemes"]["tensorrt"]["onnx"]["tensorrt_explicit_quantization"]["ok"] is True
    assert m["tensorrt"]["preflight"]["ok"] is True  # the preflight read the engine's own ONNX
    # the CPU it was verified on, since int8 accuracy on a CPU depends on it
    assert q["verified_on"]["cpu"] and "exact_int8_dot_products" in q["verified_on"]
    assert json.loads((out / "manifest.json").read_text())["quantization"]["schemes"].keys() == q["schemes"].keys()


def test_each_scheme_keeps_its_accuracy_on_held_out_data_in_its_runtime(both_schemes) -> None:
    """Cosine and top-1 against fp32 on the held-out calibration samples, each artifact in its runtime:
    the CPU artifacts on this CPU's int8 kernels, the TensorRT ONNX with its Q/DQ as written."""
    m, _ = both_schemes
    by_format = {v["format"]: v for v in m["verification"]}
    assert set(by_format) == {"onnx", "torchscript", "onnx_tensorrt"}
    for v in by_format.values():
        assert v["passed"], v
        assert v["cosine"] >= 0.98 and v["top1_agreement"] >= 0.6, v  # random weights, 16 calibration samples
    assert "float kernels" in by_format["onnx_tensorrt"]["runtime"]
    assert by_format["onnx"]["runtime"] == "onnxruntime"
    for runtime, report in m["quantization"]["schemes"].items():
        assert report["runtime"] == runtime and report["end_to_end"]["cosine"] >= 0.98
        assert len(report["layers"]) == 21  # a per-layer report for each scheme


def test_reduce_range_gives_7_bit_weights_and_the_fallback_works_per_scheme(tmp_path) -> None:
    model = save_pt2(get("resnet18_small"), tmp_path / "m.pt2")
    spec = _int8_spec(("onnx", "tensorrt"), reduce_range=True, target_cosine=0.998)
    spec = spec.model_copy(update={"verify": spec.verify.model_copy(update={"fail_on_mismatch": False})})
    m = convert(model, spec, tmp_path / "out", deferred_targets=("tensorrt",))
    q = m["quantization"]
    assert q["scheme"]["reduce_range"] is True and "[-63, 63]" in q["scheme"]["weights"]
    assert q["schemes"]["tensorrt"]["scheme"]["reduce_range"] is False
    graph = onnx.load(str(tmp_path / "out" / "model.onnx")).graph
    int8_weights = [onnx.numpy_helper.to_array(i) for i in graph.initializer if i.data_type == onnx.TensorProto.INT8]
    assert int8_weights and max(int(np.abs(w).max()) for w in int8_weights) == 63
    # a target neither scheme reaches with every layer in int8: each falls back on its own, worst layers first
    for runtime, report in q["schemes"].items():
        assert report["fallback_layers"], runtime
        assert report["fallback"]["steps"][0]["layer"] == report["fallback_layers"][0]
    assert any(w.startswith("int8 (tensorrt scheme):") for w in m["warnings"])


def test_the_cli_and_the_report_show_each_scheme(both_schemes) -> None:
    from rich.console import Console

    from fxport.cli.result_table import render_quantization

    m, out = both_schemes
    console = Console(record=True, width=200)
    render_quantization(m["quantization"], console)
    text = console.export_text()
    assert "int8 (onnxruntime scheme, minmax observer" in text
    assert "also the tensorrt scheme (its own ONNX model, for the tensorrt target): end-to-end cosine" in text
    html = (out / "report.html").read_text()
    assert "int8 schemes, one per runtime" in html and "uint8 asymmetric per tensor" in html
