"""Reference only: torch's own (deprecated) FX graph-mode quantization on the same model and data.

The product path never calls torch.ao.quantization's FX API; this test checks that fxport's
int8 graph is at least about as faithful as torch's default x86 recipe.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from fxport.spec import QuantizationSpec, parse_spec
from fxport.workers.engine.passes import PassContext, run_passes
from fxport.workers.engine.quantize.ptq import quantize_int8
from tests.models import get


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0))


@pytest.mark.slow
def test_fidelity_not_below_torch_ao_fx_quantization() -> None:
    from torch.ao.quantization import get_default_qconfig_mapping
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    case = get("resnet18_small")
    model = case.build()
    calibration = [case.example_inputs(8 + i) for i in range(4)]
    held_out = [case.example_inputs(4 + i) for i in range(4)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = prepare_fx(copy.deepcopy(model), get_default_qconfig_mapping("x86"), calibration[0])
        with torch.no_grad():
            for args in calibration:
                prepared(*args)
        reference = convert_fx(prepared)
    gm, _ = run_passes(torch.fx.symbolic_trace(model), parse_spec({}).passes, PassContext(level="torch"))
    ours = quantize_int8(gm, calibration, held_out, QuantizationSpec()).graph_module
    with torch.no_grad():
        fp32 = torch.cat([model(*a) for a in held_out])
        theirs = _cosine(fp32, torch.cat([reference(*a) for a in held_out]))
        mine = _cosine(fp32, torch.cat([ours(*a) for a in held_out]))
    assert mine >= theirs - 0.005, (mine, theirs)
