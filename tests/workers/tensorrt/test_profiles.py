"""Optimization profiles from the spec's dynamic dims, their fit to a parsed network, the ONNX signature."""

from __future__ import annotations

import pytest
from onnx import TensorProto, helper

from fxport.errors import InvalidInput
from fxport.spec import DynamicDim, InputSpec, parse_spec
from fxport.workers.engine.tensorrt.profiles import (
    build_profiles,
    check_against_network,
    signature_from_onnx,
    verification_points,
)


def spec_of(inputs, dims):
    return parse_spec({"inputs": inputs, "dynamic_dims": dims, "targets": ["tensorrt"]})


def test_one_profile_with_every_input_at_min_opt_max():
    spec = spec_of([{"name": "x", "shape": ["batch", 3, 224, 224]}],
                   {"batch": {"min": 1, "opt": 8, "max": 64}})
    [profile] = build_profiles(spec.inputs, spec.dynamic_dims)
    assert profile.names == ["x"]
    assert profile["x"].min == (1, 3, 224, 224) and profile["x"].opt == (8, 3, 224, 224)
    assert profile["x"].max == (64, 3, 224, 224) and profile["x"].dynamic
    assert profile.as_dict() == {"x": {"min": [1, 3, 224, 224], "opt": [8, 3, 224, 224], "max": [64, 3, 224, 224]}}


def test_a_shared_dim_takes_the_same_value_in_every_input_and_static_inputs_are_pinned():
    spec = spec_of([
        {"name": "ids", "shape": ["batch", "seq"], "dtype": "int64"},
        {"name": "mask", "shape": ["batch", "seq"], "dtype": "int64"},
        {"name": "bias", "shape": [4]},
    ], {"batch": {"min": 1, "opt": 4, "max": 16}, "seq": {"min": 8, "opt": 128, "max": 512}})
    [profile] = build_profiles(spec.inputs, spec.dynamic_dims)
    assert profile.point("min") == {"ids": (1, 8), "mask": (1, 8), "bias": (4,)}
    assert profile.point("opt") == {"ids": (4, 128), "mask": (4, 128), "bias": (4,)}
    assert profile.point("max") == {"ids": (16, 512), "mask": (16, 512), "bias": (4,)}
    assert not profile["bias"].dynamic
    assert profile.covers({"ids": (2, 64), "mask": (2, 64), "bias": (4,)})
    assert not profile.covers({"ids": (32, 64), "mask": (32, 64), "bias": (4,)})


def test_all_static_inputs_need_no_profile():
    spec = parse_spec({"inputs": [{"name": "x", "shape": [1, 3, 32, 32]}], "targets": ["tensorrt"]})
    assert build_profiles(spec.inputs, spec.dynamic_dims) == []


def test_a_dim_without_a_range_is_refused_naming_it():
    with pytest.raises(InvalidInput, match="input 'x' dim 0 is the dynamic dim 'batch'"):
        build_profiles([InputSpec(name="x", shape=["batch", 3])], {})


def test_profile_against_the_parsed_network():
    [profile] = build_profiles([InputSpec(name="x", shape=["batch", 3, 32, 32])],
                               {"batch": DynamicDim(min=1, opt=2, max=8)})
    assert check_against_network(profile, {"x": (-1, 3, 32, 32)}) == []
    assert "dim 1 is 4" in check_against_network(profile, {"x": (-1, 4, 32, 32)})[0]
    assert "rank 3" in check_against_network(profile, {"x": (-1, 3, 32)})[0]
    problems = check_against_network(profile, {"x": (-1, 3, 32, 32), "y": (-1, 5)})
    assert problems == ["network input 'y' has dynamic dims [-1, 5] but the spec gives it no shape range "
                        "(spec inputs: x)"]
    assert "not inputs of the ONNX model" in check_against_network(profile, {"image": (-1, 3, 32, 32)})[-1]
    # a static network needs no profile; a dynamic one without a profile is a problem
    assert check_against_network(None, {"x": (1, 3, 32, 32)}) == []
    assert check_against_network(None, {"x": (-1, 3, 32, 32)})


def test_verification_points_are_min_and_max_of_each_profile_then_opt():
    [profile] = build_profiles([InputSpec(name="x", shape=["batch", 8])], {"batch": DynamicDim(min=1, opt=4, max=32)})
    assert verification_points([profile]) == [{"x": (1, 8)}, {"x": (32, 8)}, {"x": (4, 8)}]


def onnx_model(dims, elem=TensorProto.FLOAT, name="x"):
    graph = helper.make_graph([helper.make_node("Relu", [name], ["y"])], "g",
                              [helper.make_tensor_value_info(name, elem, dims)],
                              [helper.make_tensor_value_info("y", elem, dims)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])


def test_signature_from_the_spec_is_checked_against_the_onnx_inputs():
    spec = spec_of([{"name": "x", "shape": ["batch", 3, 8, 8]}], {"batch": {"min": 1, "opt": 2, "max": 4}})
    sig = signature_from_onnx(onnx_model(["s0", 3, 8, 8]), spec.inputs, spec.dynamic_dims)
    assert [i.name for i in sig.inputs] == ["x"] and sig.shape_points()[-1] == {"batch": 4}
    with pytest.raises(InvalidInput, match="do not match the ONNX model's inputs"):
        signature_from_onnx(onnx_model(["s0", 3, 8, 8], name="image"), spec.inputs, spec.dynamic_dims)
    with pytest.raises(InvalidInput, match="dim 1 is 4 in the ONNX model"):
        signature_from_onnx(onnx_model(["s0", 4, 8, 8]), spec.inputs, spec.dynamic_dims)
    with pytest.raises(InvalidInput, match="is float16 in the ONNX model"):
        signature_from_onnx(onnx_model(["s0", 3, 8, 8], TensorProto.FLOAT16), spec.inputs, spec.dynamic_dims)


def test_signature_from_the_onnx_model_alone_needs_static_dims():
    sig = signature_from_onnx(onnx_model([2, 3, 8, 8]), [], {})
    assert sig.inputs[0].shape == [2, 3, 8, 8] and sig.inputs[0].dtype == "float32"
    with pytest.raises(InvalidInput, match=r"dim 0 \(batch\) is dynamic .* no range"):
        signature_from_onnx(onnx_model(["batch", 3, 8, 8]), [], {})
