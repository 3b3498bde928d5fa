"""The engine's CPU stage for a tensorrt job: it makes the ONNX model, preflights it, and fails in
seconds — naming the node — on what TensorRT's parser rejects, before any GPU is involved."""

from __future__ import annotations

import warnings
from pathlib import Path

import onnx
import pytest
import torch
from onnx import TensorProto, helper

from fxport.errors import ConversionFailed
from fxport.spec import parse_spec
from fxport.workers.engine.pipeline import convert
from tests.models import get
from tests.workers.engine.conftest import save_pt2, spec_dict


class BitMask(torch.nn.Module):
    """Exports to ONNX BitwiseAnd, which TensorRT's ONNX parser does not support."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.bitwise_and((x * 10).to(torch.int32), 6)


def test_resnet_cpu_stage_makes_and_preflights_the_onnx_model(tmp_path):
    case = get("resnet18_small")
    pt2 = save_pt2(case, tmp_path / "m.pt2")
    spec = parse_spec(spec_dict(case, targets=("fx_source",)))  # onnx is added: the engine is built from it
    manifest = convert(pt2, spec, tmp_path / "out", deferred_targets=("tensorrt",))
    assert (tmp_path / "out" / "model.onnx").is_file()
    assert {a["format"] for a in manifest["artifacts"]} >= {"onnx", "fx_source"}
    assert not (tmp_path / "out" / "model.engine").exists()
    pre = manifest["tensorrt"]["preflight"]
    assert pre["ok"] and pre["errors"] == [] and pre["op_counts"]["Conv"] == 20
    assert {v["format"] for v in manifest["verification"]} == {"onnx", "fx_source"}


def test_an_op_tensorrt_rejects_fails_the_cpu_stage_naming_the_node(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ep = torch.export.export(BitMask(), (torch.rand(2, 4),))
    torch.export.save(ep, str(tmp_path / "bits.pt2"))
    spec = parse_spec({"targets": ["onnx"], "inputs": [{"name": "x", "shape": [2, 4]}]})
    with pytest.raises(ConversionFailed) as err:
        convert(tmp_path / "bits.pt2", spec, tmp_path / "out", deferred_targets=("tensorrt",))
    assert err.value.stage == "tensorrt"
    assert "(op BitwiseAnd)" in str(err.value) and "bitwise_and" in str(err.value)
    manifest = __import__("json").loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["status"] == "failed" and manifest["error"]["stage"] == "tensorrt"
    assert manifest["tensorrt"]["preflight"]["errors"][0]["op_type"] == "BitwiseAnd"
    assert manifest["verification"] == []  # failed before the (slower) verify stage


def _onnx_upload(path: Path, op: str = "Relu", name: str = "act") -> Path:
    out_shape = ["k"] if op == "Unique" else [2, 8]  # Unique flattens
    graph = helper.make_graph([helper.make_node(op, ["x"], ["y"], name=name)], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]), str(path))
    return path


def test_onnx_upload_with_an_unsupported_op_fails_in_the_cpu_stage(tmp_path):
    path = _onnx_upload(tmp_path / "u.onnx", "Unique", "dedupe")
    with pytest.raises(ConversionFailed, match=r"node 'dedupe' \(op Unique\)"):
        convert(path, parse_spec({"targets": ["onnx"]}), tmp_path / "out", deferred_targets=("tensorrt",))


def test_onnx_upload_for_a_reduced_precision_engine(tmp_path):
    path = _onnx_upload(tmp_path / "m.onnx")
    manifest = convert(path, parse_spec({"targets": ["onnx"], "precision": "fp16"}), tmp_path / "out",
                       deferred_targets=("tensorrt",))
    assert manifest["tensorrt"]["preflight"]["ok"]
    assert any("applies to the TensorRT engine" in w for w in manifest["warnings"])
    with pytest.raises(ConversionFailed, match="QuantizeLinear/DequantizeLinear"):
        convert(path, parse_spec({"targets": ["onnx"], "precision": "int8"}), tmp_path / "out8",
                deferred_targets=("tensorrt",))
