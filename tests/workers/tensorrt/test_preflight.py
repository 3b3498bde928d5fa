"""CPU preflight against TensorRT's ONNX parser: small graphs built with onnx.helper, one rule each."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from fxport.errors import ConversionFailed
from fxport.workers.engine.tensorrt import support_matrix as sm
from fxport.workers.engine.tensorrt.preflight import check_preflight, preflight_onnx

F = TensorProto.FLOAT


def model(nodes, inputs, outputs, *, initializers=(), opset=20, functions=(), extra_opsets=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    imports = [helper.make_opsetid("", opset), *[helper.make_opsetid(d, v) for d, v in extra_opsets]]
    return helper.make_model(graph, opset_imports=imports, functions=list(functions), ir_version=9)


def vi(name, elem=F, shape=("N", 4)):
    return helper.make_tensor_value_info(name, elem, list(shape))


def const(name, value):
    return numpy_helper.from_array(np.asarray(value), name)


def small_cnn():
    w = const("w", np.random.default_rng(0).standard_normal((8, 3, 3, 3)).astype(np.float32))
    fc = const("fc", np.random.default_rng(1).standard_normal((8, 10)).astype(np.float32))
    axes = const("axes", np.array([2, 3], dtype=np.int64))
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"], name="relu1"),
        helper.make_node("MaxPool", ["r"], ["p"], name="pool1", kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("ReduceMean", ["p", "axes"], ["m"], name="gap", keepdims=0),
        helper.make_node("MatMul", ["m", "fc"], ["y"], name="head"),
    ]
    return model(nodes, [vi("x", shape=("N", 3, 16, 16))], [vi("y", shape=("N", 10))], initializers=[w, fc, axes])


def errors_of(report):
    return [(f.node, f.op_type) for f in report.errors]


def test_supported_graph_has_no_findings():
    report = preflight_onnx(small_cnn())
    assert report.ok and report.findings == []
    assert report.opset == 20 and report.node_count == 5
    assert report.op_counts == {"Conv": 1, "Relu": 1, "MaxPool": 1, "ReduceMean": 1, "MatMul": 1}
    check_preflight(report)  # no raise
    data = report.as_dict()
    assert data["ok"] is True and "onnx-tensorrt" in data["source"]
    assert data["checked_against"].startswith("TensorRT 10")


def test_unsupported_op_fails_naming_the_node_and_op():
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu_ok"),
        helper.make_node("Unique", ["r"], ["u"], name="dedupe_tokens"),
    ]
    report = preflight_onnx(model(nodes, [vi("x", shape=(8,))], [vi("u", shape=("K",))]))
    assert errors_of(report) == [("dedupe_tokens", "Unique")]
    with pytest.raises(ConversionFailed) as err:
        check_preflight(report)
    text = str(err.value)
    assert "node 'dedupe_tokens' (op Unique)" in text and "not supported" in text
    assert err.value.stage == "tensorrt" and err.value.field == "targets"
    assert "dedupe_tokens" in err.value.detail


def test_unnamed_node_is_named_by_its_index_and_output():
    report = preflight_onnx(model([helper.make_node("BitwiseNot", ["x"], ["y"])],
                                  [vi("x", TensorProto.INT32, (4,))], [vi("y", TensorProto.INT32, (4,))]))
    assert errors_of(report) == [("#0 (output y)", "BitwiseNot")]


def test_op_missing_from_the_table_and_custom_domain_ops_fail():
    nodes = [
        helper.make_node("NotARealOp", ["x"], ["a"], name="mystery"),
        helper.make_node("FusedGemm", ["a", "a"], ["y"], name="ort_fused", domain="com.microsoft"),
    ]
    report = preflight_onnx(model(nodes, [vi("x")], [vi("y")], extra_opsets=[("com.microsoft", 1)]))
    found = {f.node: f for f in report.errors}
    assert "not in TensorRT" in found["mystery"].reason
    assert found["ort_fused"].op_type == "com.microsoft::FusedGemm" and "plugin" in found["ort_fused"].reason


def test_every_unsupported_op_of_the_table_is_an_error():
    for op, (supported, _) in sm.OPS.items():
        if supported:
            continue
        report = preflight_onnx(model([helper.make_node(op, ["x"], ["y"], name=f"n_{op}")], [vi("x")], [vi("y")]))
        assert (f"n_{op}", op) in errors_of(report), op


def test_unsupported_op_inside_an_if_branch_names_where_it_sits():
    then_g = helper.make_graph([helper.make_node("Det", ["x"], ["t"], name="det_in_branch")], "then", [],
                               [vi("t", shape=())])
    else_g = helper.make_graph([helper.make_node("ReduceSum", ["x"], ["e"], name="sum_in_branch", keepdims=0)],
                               "else", [], [vi("e", shape=())])
    nodes = [helper.make_node("If", ["cond"], ["y"], name="branch", then_branch=then_g, else_branch=else_g)]
    report = preflight_onnx(model(nodes, [vi("cond", TensorProto.BOOL, ()), vi("x", shape=(3, 3))],
                                  [vi("y", shape=())]))
    [finding] = report.errors
    assert (finding.node, finding.op_type) == ("det_in_branch", "Det")
    assert "If branch.then_branch" in finding.where and "det_in_branch" in finding.describe()


def test_model_local_function_is_checked_by_its_body():
    body = [helper.make_node("Relu", ["a"], ["b"], name="fn_relu"),
            helper.make_node("MaxUnpool", ["b", "b"], ["c"], name="fn_unpool")]
    fn = helper.make_function("custom.fns", "Block", ["a"], ["c"], body, [helper.make_opsetid("", 20)])
    nodes = [helper.make_node("Block", ["x"], ["y"], name="block0", domain="custom.fns")]
    report = preflight_onnx(model(nodes, [vi("x")], [vi("y")], functions=[fn], extra_opsets=[("custom.fns", 1)]))
    [finding] = report.errors
    assert (finding.node, finding.op_type) == ("fn_unpool", "MaxUnpool")
    assert "function 'Block' (called by block0)" in finding.where


def test_string_and_complex_tensors_fail():
    nodes = [helper.make_node("Identity", ["s"], ["y"], name="pass_strings")]
    report = preflight_onnx(model(nodes, [vi("s", TensorProto.STRING, (2,))], [vi("y", TensorProto.STRING, (2,))]))
    assert any("STRING" in f.reason for f in report.errors)
    cast = [helper.make_node("Cast", ["x"], ["y"], name="to_complex", to=TensorProto.COMPLEX64)]
    report = preflight_onnx(model(cast, [vi("x")], [vi("y", TensorProto.COMPLEX64)]))
    assert ("to_complex", "Cast") in errors_of(report)


def test_double_is_a_warning_not_an_error():
    nodes = [helper.make_node("Relu", ["x"], ["y"], name="relu64")]
    report = preflight_onnx(model(nodes, [vi("x", TensorProto.DOUBLE)], [vi("y", TensorProto.DOUBLE)]))
    assert report.ok and any("DOUBLE" in f.reason for f in report.warnings)


@pytest.mark.parametrize("node, inputs, initializers, expect", [
    (helper.make_node("Resize", ["x", "", "scales"], ["y"], name="up", mode="cubic"),
     [vi("x", shape=(1, 1, 4, 4))], [const("scales", np.array([1, 1, 2, 2], np.float32))], "mode 'cubic'"),
    (helper.make_node("Resize", ["x", "", "scales"], ["y"], name="up", mode="linear",
                      coordinate_transformation_mode="tf_crop_and_resize"),
     [vi("x", shape=(1, 1, 4, 4))], [const("scales", np.array([1, 1, 2, 2], np.float32))], "tf_crop_and_resize"),
    (helper.make_node("Resize", ["x", "", "scales"], ["y"], name="up", antialias=1, mode="linear"),
     [vi("x", shape=(1, 1, 4, 4))], [const("scales", np.array([1, 1, 2, 2], np.float32))], "antialias"),
    (helper.make_node("MaxPool", ["x"], ["y", "idx"], name="pool", kernel_shape=[2, 2]),
     [vi("x", shape=(1, 1, 4, 4))], [], "Indices output"),
    (helper.make_node("AveragePool", ["x"], ["y"], name="pool", kernel_shape=[2, 2], dilations=[2, 2]),
     [vi("x", shape=(1, 1, 8, 8))], [], "dilations"),
    (helper.make_node("Dropout", ["x", "ratio", "training"], ["y"], name="drop"),
     [vi("x")], [const("ratio", np.array(0.5, np.float32)), const("training", np.array(True))],
     "training_mode is True"),
    (helper.make_node("TopK", ["x", "k"], ["v", "i"], name="topk", sorted=0),
     [vi("x", shape=(1, 16))], [const("k", np.array([3], np.int64))], "sorted=0"),
    (helper.make_node("TopK", ["x", "k"], ["v", "i"], name="topk"),
     [vi("x", shape=(1, 5000))], [const("k", np.array([4000], np.int64))], "K=4000"),
    (helper.make_node("ScatterND", ["x", "idx", "upd"], ["y"], name="scatter", reduction="add"),
     [vi("x", shape=(4,)), vi("idx", TensorProto.INT64, (1, 1)), vi("upd", shape=(1,))], [], "reduction 'add'"),
    (helper.make_node("LayerNormalization", ["x", "g"], ["y", "mean"], name="ln"),
     [vi("x")], [const("g", np.ones(4, np.float32))], "only the first output"),
    (helper.make_node("LSTM", ["x", "w", "r"], ["y"], name="lstm", hidden_size=2, layout=1),
     [vi("x", shape=(1, 2, 3))],
     [const("w", np.zeros((1, 8, 3), np.float32)), const("r", np.zeros((1, 8, 2), np.float32))],
     "layout must be 0"),
    (helper.make_node("ReduceSum", ["x", "axes"], ["y"], name="sum"),
     [vi("x"), vi("axes", TensorProto.INT64, (1,))], [], "axes ('axes') must be a build-time constant"),
    (helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["y"], name="q"),
     [vi("x")], [const("s", np.array(0.1, np.float32)), const("zp", np.array(3, np.int8))], "not 0"),
    (helper.make_node("DequantizeLinear", ["x", "s", "zp"], ["y"], name="dq"),
     [vi("x", TensorProto.UINT8)], [const("s", np.array(0.1, np.float32)), const("zp", np.array(0, np.uint8))],
     "uint8"),
    (helper.make_node("Constant", [], ["y"], name="strings", value_strings=["a", "b"]), [], [], "value_strings"),
])
def test_attribute_and_input_restrictions(node, inputs, initializers, expect):
    outputs = [vi(o, shape=()) for o in node.output if o]
    report = preflight_onnx(model([node], inputs, outputs, initializers=initializers))
    mine = [f for f in report.errors if f.node == node.name]
    assert mine and any(expect in f.reason for f in mine), report.findings


def test_opset_bounds():
    node = [helper.make_node("Relu", ["x"], ["y"], name="r")]
    old = preflight_onnx(model(node, [vi("x")], [vi("y")], opset=8))
    assert any("opset 8" in f.reason for f in old.errors)
    new = preflight_onnx(model(node, [vi("x")], [vi("y")], opset=sm.OPSET_MAX + 1))
    assert new.ok and any("newer" in f.reason for f in new.warnings)


def test_int8_needs_qdq_pairs():
    plain = model([helper.make_node("Relu", ["x"], ["y"], name="r")], [vi("x")], [vi("y")])
    report = preflight_onnx(plain, precision="int8")
    assert not report.ok and "QuantizeLinear/DequantizeLinear" in report.errors[0].reason
    assert preflight_onnx(plain, precision="fp16").ok
    qdq = model(
        [helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["q"], name="q"),
         helper.make_node("DequantizeLinear", ["q", "s", "zp"], ["y"], name="dq")],
        [vi("x")], [vi("y")], initializers=[const("s", np.array(0.05, np.float32)), const("zp", np.array(0, np.int8))])
    report = preflight_onnx(qdq, precision="int8")
    assert report.ok and report.has_qdq, report.findings


def test_ops_added_after_10_0_warn():
    node = [helper.make_node("RMSNormalization", ["x", "g"], ["y"], name="rms")]
    report = preflight_onnx(model(node, [vi("x")], [vi("y")], initializers=[const("g", np.ones(4, np.float32))],
                                  opset=23))
    assert report.ok and any("10.15" in f.reason for f in report.warnings)


def test_preflight_reads_a_file_without_its_external_weights(tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save_model(small_cnn(), str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="m.onnx.data", size_threshold=0)
    (tmp_path / "m.onnx.data").unlink()  # weights are never needed to preflight
    assert preflight_onnx(path).ok


def test_many_errors_are_summarised_with_all_in_detail():
    nodes = [helper.make_node("Det", ["x"], [f"d{i}"], name=f"det{i}") for i in range(8)]
    report = preflight_onnx(model(nodes, [vi("x", shape=(3, 3))], [vi(f"d{i}", shape=()) for i in range(8)]))
    with pytest.raises(ConversionFailed) as err:
        check_preflight(report)
    assert "8 problem(s)" in str(err.value) and "and 3 more" in str(err.value)
    assert all(f"det{i}" in err.value.detail for i in range(8))
