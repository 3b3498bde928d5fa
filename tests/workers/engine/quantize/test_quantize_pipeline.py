"""precision int8 / fp16 through `convert`: artifacts, Q/DQ in the ONNX, the per-layer report, fallback, failures."""

from __future__ import annotations

import json
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch

from fxport.errors import InvalidInput, VerificationFailed
from fxport.spec import parse_spec
from fxport.workers.engine.pipeline import convert
from fxport.workers.engine.quantize.observers import exact_int8_dot_products
from tests.models import get
from tests.workers.engine.conftest import save_package, save_pt2

SENSITIVE = "layer1.0.conv2"


def _spec(name: str, precision: str, targets: tuple[str, ...], **extra: Any) -> Any:
    case = get(name)
    spec: dict[str, Any] = {
        "inputs": [{"name": n, "shape": list(s), "dtype": d}
                   for n, s, d in zip(case.input_names, case.input_shapes, case.input_dtypes)],
        "dynamic_dims": {"batch": {"min": 1, "opt": 2, "max": 4}},
        "targets": list(targets), "precision": precision, "verify": {"samples": 2},
    }
    if precision == "int8":
        spec["quantization"] = {"calibration": {"samples": 16}}
    for key, value in extra.items():
        spec[key] = {**spec.get(key, {}), **value} if isinstance(value, dict) else value
    return parse_spec(spec)


def _sensitive_resnet(path: Path) -> Path:
    """resnet18_small with one layer int8 cannot represent, the model's function unchanged.

    layer1.0's first ReLU outputs 0 in channel 0 always (a BatchNorm bias of -1000), so
    layer1.0.conv2 may hold anything on input channel 0: a weight 50x its largest there
    changes nothing in fp32, but per-channel int8 scales then round every other weight of
    that layer to a few steps.
    """
    case = get("resnet18_small")
    model = case.build()
    with torch.no_grad():
        model.layer1[0].bn1.bias[0] = -1000.0
        conv = model.layer1[0].conv2
        conv.weight[:, 0] = 50 * conv.weight.abs().amax()
    args = case.example_inputs(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ep = torch.export.export(model, args, dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=64)},))
    torch.export.save(ep, str(path))
    return path


def _ops(path: Path) -> Counter:
    return Counter(n.op_type for n in onnx.load(str(path)).graph.node)


def _activation_zero_point_types(path: Path) -> set[str]:
    """The element types of the zero points of every QuantizeLinear (activations; weights are initializers)."""
    graph = onnx.load(str(path)).graph
    inits = {i.name: i for i in graph.initializer}
    consts = {n.output[0]: n.attribute[0].t for n in graph.node if n.op_type == "Constant" and n.attribute}
    types = set()
    for node in graph.node:
        if node.op_type == "QuantizeLinear" and len(node.input) > 2:
            t = inits.get(node.input[2]) or consts.get(node.input[2])
            types.add(onnx.TensorProto.DataType.Name(t.data_type))
    return types


def _check_int8_manifest(m: dict[str, Any], out: Path, layers: int) -> None:
    assert m["status"] == "succeeded"
    q = m["quantization"]
    assert q["precision"] == "int8" and q["method"] == "static" and q["observer"] == "minmax"
    assert len(q["layers"]) == layers and all({"node", "sqnr_db", "cosine", "fallback"} <= set(r) for r in q["layers"])
    assert q["worst"] == [r["node"] for r in sorted(q["layers"], key=lambda r: r["sqnr_db"])][:len(q["worst"])]
    assert q["calibration"]["source"] == "random" and q["calibration"]["held_out"] > 0
    assert any("random samples" in w for w in m["warnings"])  # the loud warning
    assert "quantize" in m["timings_s"]
    for v in m["verification"]:
        assert v["passed"] and v["tolerances"]["precision"] == "int8", v
    assert json.loads((out / "manifest.json").read_text())["quantization"]["worst"] == q["worst"]


def test_resnet_int8_every_artifact(tmp_path: Path) -> None:
    model = save_pt2(get("resnet18_small"), tmp_path / "m.pt2")
    m = convert(model, _spec("resnet18_small", "int8", ("onnx", "torchscript", "exported_program", "fx_source")),
                tmp_path / "out")
    _check_int8_manifest(m, tmp_path / "out", layers=21)
    ops = _ops(tmp_path / "out" / "model.onnx")
    assert ops["QuantizeLinear"] > 20 and ops["DequantizeLinear"] > 40
    onnx_check = m["quantization"]["onnx"]
    assert onnx_check["onnxruntime"]["int8_kernels"]["QLinearConv"] == 20  # every conv runs int8 in onnxruntime
    assert not onnx_check["onnxruntime"]["float_compute"]
    # no tensorrt target: the onnxruntime scheme, uint8 activations (not TensorRT's form, so not checked for it)
    assert m["quantization"]["runtime"] == "onnxruntime" and "tensorrt_explicit_quantization" not in onnx_check
    assert _activation_zero_point_types(tmp_path / "out" / "model.onnx") == {"UINT8"}
    assert {a["int8_scheme"] for a in m["artifacts"]} == {"onnxruntime"}
    assert "quantized conv2d x20" in m["quantization"]["artifact_notes"]["torchscript"]
    formats = {v["format"] for v in m["verification"]}
    assert formats == {"onnx", "torchscript", "exported_program", "fx_source"}
    assert all({1, 2, 4} <= {s[0] for s in v["shapes_checked"]} for v in m["verification"])
    # the int8 .pt2 stores int8 weights
    import torch.ao.quantization.fx._decomposed  # noqa: F401

    ep = torch.export.load(str(tmp_path / "out" / "model.pt2"))
    assert sum(t.dtype == torch.int8 for t in ep.state_dict.values()) == 21


def test_transformer_int8_at_torch_level(tmp_path: Path) -> None:
    model = save_package(get("transformer_block"), tmp_path / "m.pkg")
    m = convert(model, _spec("transformer_block", "int8", ("onnx", "torchscript")), tmp_path / "out")
    assert m["capture"]["level"] == "torch"
    _check_int8_manifest(m, tmp_path / "out", layers=4)
    assert [r["node"] for r in m["quantization"]["layers"]] == ["qkv", "proj", "mlp.0", "mlp.2"]
    kernels = m["quantization"]["onnx"]["onnxruntime"]["int8_kernels"]
    assert sum(kernels.values()) >= 4, kernels
    assert "quantized linear x4" in m["quantization"]["artifact_notes"]["torchscript"]


@pytest.mark.parametrize("name, fmt", [("resnet18_small", "pkg"), ("transformer_block", "pt2")])
def test_fp16_onnx_and_torchscript_half(name: str, fmt: str, tmp_path: Path) -> None:
    case = get(name)
    model = save_package(case, tmp_path / "m.pkg") if fmt == "pkg" else save_pt2(case, tmp_path / "m.pt2")
    m = convert(model, _spec(name, "fp16", ("onnx", "torchscript")), tmp_path / "out")
    assert m["status"] == "succeeded" and m["quantization"]["precision"] == "fp16"
    for v in m["verification"]:
        assert v["passed"] and v["tolerances"]["atol"] == 2e-2, v
    graph = onnx.load(str(tmp_path / "out" / "model.onnx")).graph
    types = Counter(onnx.TensorProto.DataType.Name(i.data_type) for i in graph.initializer)
    assert types["FLOAT16"] > 0
    assert graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT  # fp32 interface
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ts = torch.jit.load(str(tmp_path / "out" / "model.ts"))
    dtypes = {str(t.dtype) for t in list(ts.parameters()) + list(ts.buffers()) if t.is_floating_point()}
    if name == "transformer_block":  # LayerNorm (and softmax) stay fp32 between Casts
        producers = {o: n for n in graph.node for o in n.output}
        norms = [n for n in graph.node if n.op_type == "LayerNormalization"]
        assert len(norms) == 2 and all(producers[n.input[0]].op_type == "Cast" for n in norms)
        assert len(m["quantization"]["kept_fp32"]) == 3 and "torch.float32" in dtypes
    assert "torch.float16" in dtypes


def test_sensitive_layer_is_named_and_kept_float(tmp_path: Path) -> None:
    model = _sensitive_resnet(tmp_path / "m.pt2")
    m = convert(model, _spec("resnet18_small", "int8", ("onnx",), quantization={"target_cosine": 0.98}),
                tmp_path / "out")
    q = m["quantization"]
    assert q["worst"][0] == SENSITIVE
    worst = next(r for r in q["layers"] if r["node"] == SENSITIVE)
    others = [r["sqnr_db"] for r in q["layers"] if r["node"] != SENSITIVE]
    assert worst["sqnr_db"] < min(others) - 10
    assert q["fallback_layers"] == [SENSITIVE] and worst["fallback"]
    assert [r["node"] for r in q["layers"] if r["fallback"]] == [SENSITIVE]
    assert q["end_to_end"]["cosine_all_int8"] < 0.98 <= q["end_to_end"]["cosine"] and q["end_to_end"]["target_met"]
    assert q["fallback"]["steps"][0]["layer"] == SENSITIVE and 0 < q["fallback"]["fp32_macs_share"] < 0.2
    latency = q["fallback"]["latency"]
    assert latency["ms_all_int8"] > 0 and latency["ms_with_fallback"] > 0
    assert m["quantization"]["onnx"]["onnxruntime"]["int8_kernels"]["QLinearConv"] == 19
    assert all(v["passed"] and v["cosine"] >= 0.98 for v in m["verification"])
    assert any(SENSITIVE in w for w in m["warnings"])


def test_missed_target_fails_with_the_layer_table(tmp_path: Path) -> None:
    model = _sensitive_resnet(tmp_path / "m.pt2")
    spec = _spec("resnet18_small", "int8", ("exported_program",), verify={"min_cosine": 0.99})
    with pytest.raises(VerificationFailed) as info:
        convert(model, spec, tmp_path / "out")
    text = str(info.value)
    assert "int8 artifact(s) miss their target (int8: cosine >= 0.99" in text
    assert "per-layer error" in text and text.index(SENSITIVE) < text.index("layer4")  # worst first
    assert info.value.detail and SENSITIVE in info.value.detail
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert m["status"] == "failed" and m["error"]["stage"] == "verify" and m["quantization"]["worst"][0] == SENSITIVE


def test_calibration_file_feeds_and_is_held_out(tmp_path: Path) -> None:
    case = get("transformer_block")
    model = save_pt2(case, tmp_path / "m.pt2")
    rng = np.random.default_rng(0)
    calib = tmp_path / "calib.npz"
    np.savez(calib, x=rng.standard_normal((12, 16, 64)).astype(np.float32))
    m = convert(model, _spec("transformer_block", "int8", ("exported_program",)), tmp_path / "out",
                calibration_path=calib)
    cal = m["quantization"]["calibration"]
    assert (cal["source"], cal["file_samples"], cal["samples"], cal["held_out"]) == ("file", 12, 9, 3)
    assert not any("random" in w for w in m["warnings"])
    # int8 is judged on the 3 held-out samples (batches of opt=2) and the batch extremes 1 and 4
    v = m["verification"][0]
    assert v["passed"] and sorted({s[0] for s in v["shapes_checked"]}) == [1, 2, 4]


def test_calibration_file_with_a_wrong_name_fails_in_quantize(tmp_path: Path) -> None:
    model = save_pt2(get("transformer_block"), tmp_path / "m.pt2")
    calib = tmp_path / "calib.npz"
    np.savez(calib, tokens=np.zeros((4, 16, 64), np.float32))
    with pytest.raises(InvalidInput, match="'tokens', which is not an input of the model"):
        convert(model, _spec("transformer_block", "int8", ("onnx",)), tmp_path / "out", calibration_path=calib)
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert m["error"]["stage"] == "quantize" and not m["artifacts"]


@pytest.mark.parametrize(("flags", "machine", "exact"), [
    ("fpu sse4_2 avx2 fma", "x86_64", False),  # AVX2 only: vpmaddubsw saturates
    ("avx2 avx512f avx512bw", "x86_64", False),  # AVX-512 without VNNI saturates too
    ("avx2 avx512f avx512_vnni", "x86_64", True),
    ("avx2 avx_vnni", "x86_64", True),
    ("fp asimd", "aarch64", True),
])
def test_which_cpus_sum_int8_products_exactly(flags, machine, exact) -> None:
    assert exact_int8_dot_products(f"processor\t: 0\nflags\t\t: {flags}\n", machine) is exact


@pytest.mark.skipif(exact_int8_dot_products(), reason="needs a CPU whose int8 kernels saturate (x86 without VNNI)")
def test_int8_on_a_saturating_cpu_fails_verification_and_says_why(tmp_path: Path) -> None:
    """Where the int8 kernels cannot compute what the quantized graph says (the symmetric TensorRT
    scheme forced onto CPU artifacts), the artifacts are refused, and the error names the CPU as
    the cause rather than only the quantization."""
    model = save_pt2(get("resnet18_small"), tmp_path / "m.pt2")
    with pytest.raises(VerificationFailed) as err:
        convert(model, _spec("resnet18_small", "int8", ("onnx", "torchscript"), quantization={"runtime": "tensorrt"}),
                tmp_path / "out")
    assert "miss their target" in str(err.value) and "no VNNI" in err.value.hint
