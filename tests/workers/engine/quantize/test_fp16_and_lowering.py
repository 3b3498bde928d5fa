"""fp16 graphs keep norms/softmax in fp32; int8 QDQ graphs lower to torch's int8 kernels with the same numbers."""

from __future__ import annotations

import warnings

import pytest
import torch

from fxport.spec import QuantizationSpec, parse_spec
from fxport.workers.engine.capture import fx_from_exported
from fxport.workers.engine.passes import PassContext, run_passes
from fxport.workers.engine.quantize.fp16 import to_half
from fxport.workers.engine.quantize.lowering import lower_to_quantized_kernels
from fxport.workers.engine.quantize.ptq import quantize_int8
from tests.models import get
from tests.workers.engine.quantize.hardware import needs_exact_int8


def _aten(name: str) -> tuple[torch.fx.GraphModule, torch.nn.Module, tuple]:
    case = get(name)
    model, args = case.build(), case.example_inputs(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ep = torch.export.export(model, args, dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=8)},))
    gm, _ = run_passes(fx_from_exported(ep), parse_spec({}).passes, PassContext(level="aten", example_inputs=args))
    return gm, model, args


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0))


@pytest.mark.parametrize("level", ["torch", "aten"])
def test_half_transformer_keeps_layer_norm_and_softmax_fp32(level: str) -> None:
    case = get("transformer_block")
    gm, model, args = _aten("transformer_block") if level == "aten" else (
        torch.fx.symbolic_trace(case.build()), case.build(), case.example_inputs(2))
    half = to_half(gm, args)
    kept = [k["op"] for k in half.kept_fp32]
    assert len(kept) == 3 and sum("norm" in k for k in kept) == 2 and sum("softmax" in k for k in kept) == 1
    params = dict(half.graph_module.named_parameters()) | dict(half.graph_module.named_buffers())
    assert {str(t.dtype) for n, t in params.items() if "norm" not in n} == {"torch.float16"}
    assert {str(t.dtype) for n, t in params.items() if "norm" in n} == {"torch.float32"}
    x = case.example_inputs(3)
    with torch.no_grad():
        got, ref = half.graph_module(*x), model(*x)
    assert got.dtype == torch.float32 and _cos(got, ref) > 0.9999  # fp32 interface, fp16 inside
    assert "float16" in half.graph_module.code


@needs_exact_int8
@pytest.mark.parametrize("runtime", ["tensorrt", "onnxruntime"])
def test_lowered_resnet_runs_int8_kernels_like_its_qdq_graph(runtime) -> None:
    from fxport.workers.engine.quantize.scheme import scheme_for

    gm, model, args = _aten("resnet18_small")
    case = get("resnet18_small")
    result = quantize_int8(gm, [case.example_inputs(8)], [case.example_inputs(4)], QuantizationSpec(),
                           scheme=scheme_for(runtime))
    lowered = lower_to_quantized_kernels(result.graph_module)
    k = lowered.kernels
    assert k["quantized conv2d"] == 20 and k["quantized linear"] == 1 and k["quantized add"] == 8
    if runtime == "tensorrt":
        assert k["Conv2d + ReLU fused"] == 9 and k["add + ReLU fused"] == 8
    else:  # uint8 with zero point 0 clips at 0 itself: no ReLU is left to fuse (int8._idle_relus)
        assert not [name for name in k if "ReLU" in name or "relu" in name], k
    x = case.example_inputs(3)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qdq, low, ref = result.graph_module(*x), lowered.graph_module(*x), model(*x)
        traced = torch.jit.trace(lowered.graph_module, x, check_trace=False)
        assert torch.equal(traced(*x), low)
    # same grid, other rounding inside the kernels: as close to fp32 as the QDQ graph is
    assert _cos(low, qdq) > 0.99 and abs(_cos(low, ref) - _cos(qdq, ref)) < 0.01


@needs_exact_int8
def test_lowered_linear_layers_match_exactly() -> None:
    gm, _, _ = _aten("transformer_block")
    case = get("transformer_block")
    result = quantize_int8(gm, [case.example_inputs(4)], [case.example_inputs(2)], QuantizationSpec())
    lowered = lower_to_quantized_kernels(result.graph_module)
    assert lowered.kernels == {"quantized linear": 4}
    x = case.example_inputs(2)
    with torch.no_grad():
        assert torch.allclose(lowered.graph_module(*x), result.graph_module(*x), atol=1e-5)


def test_precision_defaults_survive_the_normalized_spec_round_trip() -> None:
    # the worker and the sandbox re-parse spec.normalized(): fp16 must still get fp16 tolerances
    from fxport.spec import parse_spec
    from fxport.workers.engine.verify.precision import FP16_ATOL, tolerances_for

    spec = parse_spec({"precision": "fp16"})
    assert tolerances_for(parse_spec(spec.normalized())).options.atol == FP16_ATOL
    explicit = parse_spec({"precision": "fp16", "verify": {"atol": 0.5}})
    assert tolerances_for(parse_spec(explicit.normalized())).options.atol == 0.5
