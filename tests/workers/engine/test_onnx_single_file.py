"""spec.onnx.single_file is kept: torch's exporter moves weights to an external data file past about
1.5 GB whatever it is asked; fxport puts them back while they fit one protobuf, and refuses past it."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from fxport.errors import ConversionFailed
from fxport.workers.engine.exporters.onnx import as_one_file


def _model_with_external_weights(folder):
    weight = numpy_helper.from_array(np.arange(64 * 64, dtype=np.float32).reshape(64, 64) / 100, name="w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])], [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    path = folder / "model.onnx"
    onnx.save_model(model, str(path), save_as_external_data=True, location="model.onnx.data", size_threshold=0)
    assert (folder / "model.onnx.data").is_file()
    return path


def _run(path):
    x = np.ones((1, 64), dtype=np.float32)
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def test_external_weights_are_put_back_into_the_one_file(tmp_path):
    path = _model_with_external_weights(tmp_path)
    before = _run(path)
    note = as_one_file(path)
    assert note is not None and "single_file" in note
    assert not (tmp_path / "model.onnx.data").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]
    np.testing.assert_array_equal(_run(path), before)


def test_weights_past_one_protobuf_are_refused_naming_the_limit_and_the_way_out(tmp_path):
    path = _model_with_external_weights(tmp_path)
    with pytest.raises(ConversionFailed, match="at most 1000 bytes") as info:
        as_one_file(path, limit=1000)
    assert "onnx.single_file: false" in str(info.value)


def test_a_model_in_one_file_is_left_as_it_is(tmp_path):
    path = _model_with_external_weights(tmp_path)
    as_one_file(path)
    written = path.read_bytes()
    assert as_one_file(path) is None and path.read_bytes() == written
