"""What runs of the builder without TensorRT: the precision plan, ONNX precision traits, per-precision
tolerances, the optional import, and the clear refusal of a local build on a machine without a GPU."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from fxport.errors import ConversionFailed, InvalidInput
from fxport.spec import parse_spec
from fxport.workers.engine.tensorrt.builder import onnx_precision_traits, plan_precision, tensorrt_unavailable
from fxport.workers.engine.tensorrt.stage import trt_tolerances

TRT10 = {"FP16", "BF16", "INT8", "TF32", "FP8", "STRICT_TYPES", "DISABLE_TIMING_CACHE"}
TRT11 = {"TF32", "DISABLE_TIMING_CACHE"}  # TensorRT 11 removed the precision flags (strongly typed only)


def test_fp32_is_fp32_without_tf32():
    plan = plan_precision("fp32", onnx_has_fp16=False, onnx_has_qdq=False, builder_flags=TRT10)
    assert plan.set_flags == () and plan.clear_flags == ("TF32",) and not plan.strongly_typed
    assert plan_precision("fp32", onnx_has_fp16=False, onnx_has_qdq=False, builder_flags=TRT11).strongly_typed


def test_fp16_keeps_an_fp16_onnx_graph_as_typed_else_uses_the_flag():
    typed = plan_precision("fp16", onnx_has_fp16=True, onnx_has_qdq=False, builder_flags=TRT10)
    assert typed.strongly_typed and typed.set_flags == ()
    flagged = plan_precision("fp16", onnx_has_fp16=False, onnx_has_qdq=False, builder_flags=TRT10)
    assert not flagged.strongly_typed and flagged.set_flags == ("FP16",)
    with pytest.raises(ConversionFailed, match="no FP16 builder flag"):
        plan_precision("fp16", onnx_has_fp16=False, onnx_has_qdq=False, builder_flags=TRT11, tensorrt_version="11.4")


def test_int8_is_explicit_quantization_only():
    with pytest.raises(ConversionFailed, match="no QuantizeLinear/DequantizeLinear"):
        plan_precision("int8", onnx_has_fp16=False, onnx_has_qdq=False, builder_flags=TRT10)
    legacy = plan_precision("int8", onnx_has_fp16=False, onnx_has_qdq=True, builder_flags=TRT10)
    assert legacy.set_flags == ("INT8",) and not legacy.strongly_typed
    assert plan_precision("int8", onnx_has_fp16=False, onnx_has_qdq=True, builder_flags=TRT11).strongly_typed
    assert legacy.as_dict()["network"] == "weakly_typed"


def _graph(nodes, inits=()):
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])], initializer=list(inits))
    return helper.make_model(g)


def test_onnx_precision_traits():
    assert onnx_precision_traits(_graph([helper.make_node("Relu", ["x"], ["y"])])) == (False, False)
    half = _graph([helper.make_node("Cast", ["x"], ["h"], to=TensorProto.FLOAT16),
                   helper.make_node("Cast", ["h"], ["y"], to=TensorProto.FLOAT)])
    assert onnx_precision_traits(half) == (True, False)
    s, z = numpy_helper.from_array(np.array(0.1, np.float32), "s"), numpy_helper.from_array(np.array(0, np.int8), "z")
    qdq = _graph([helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
                  helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"])], [s, z])
    assert onnx_precision_traits(qdq) == (False, True)


def test_tolerances_per_precision_and_the_users_values_win():
    base = {"inputs": [{"name": "x", "shape": [1, 4]}], "targets": ["tensorrt"]}
    fp32 = trt_tolerances(parse_spec(base)).options
    assert (fp32.atol, fp32.rtol, fp32.min_cosine) == (1e-3, 1e-3, 0.9999)
    fp16 = trt_tolerances(parse_spec({**base, "precision": "fp16"}))
    assert (fp16.options.atol, fp16.options.min_cosine) == (5e-2, 0.999) and fp16.judge_abs_diff
    int8 = trt_tolerances(parse_spec({**base, "precision": "int8"}))
    assert not int8.judge_abs_diff and int8.options.min_cosine == 0.98 and int8.min_top1 == 0.8
    target = trt_tolerances(parse_spec({**base, "precision": "int8", "quantization": {"target_cosine": 0.995}}))
    assert target.options.min_cosine == 0.995
    mine = trt_tolerances(parse_spec({**base, "precision": "fp16", "verify": {"atol": 0.5}}))
    assert mine.options.atol == 0.5 and mine.options.rtol == 5e-2


def test_importing_fxport_and_the_engine_never_imports_tensorrt():
    code = ("import sys, fxport, fxport.workers.jobs, fxport.workers.engine.pipeline; "
            "import fxport.workers.engine.tensorrt.builder, fxport.workers.engine.tensorrt.runner, "
            "fxport.workers.engine.tensorrt.stage, fxport.workers.engine.tensorrt.timing_cache; "
            "assert 'tensorrt' not in sys.modules, 'tensorrt imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_a_local_tensorrt_build_on_a_machine_without_it_is_refused_at_load(tmp_path):
    pytest.importorskip("onnx")
    if tensorrt_unavailable() is None:
        pytest.skip("this machine can build TensorRT engines")
    from fxport.workers.engine.pipeline import convert

    path = tmp_path / "m.onnx"
    import onnx

    onnx.save(_graph([helper.make_node("Relu", ["x"], ["y"], name="r")]), str(path))
    spec = parse_spec({"targets": ["tensorrt"], "inputs": [{"name": "x", "shape": [2]}]})
    with pytest.raises(InvalidInput) as err:
        convert(path, spec, tmp_path / "out")
    assert err.value.stage == "load"
    assert "GPU worker" in str(err.value) and "TensorRT is not installed" in str(err.value)
