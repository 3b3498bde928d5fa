"""TorchScript from a .pt2 keeps its dynamic dims (issue 21, item 3).

A trace of the aten-level graph fixes `sym_size` to the example's sizes; the exporter then scripts
the graph's code instead (exporters/torchscript_script.py). These tests run real transformers
models built from configs through the engine and load the archive as a user would.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.fx
from torch import nn

from fxport.errors import ConversionFailed
from fxport.spec import parse_spec
from fxport.workers.engine.capture import fx_from_exported
from fxport.workers.engine.exporters.torchscript import TorchScriptFromGraphModule
from fxport.workers.engine.exporters.torchscript_script import ScriptingBlocked, script_graph_module
from fxport.workers.engine.pipeline import convert
from tests.models import CORPUS, third_party
from tests.workers.engine.conftest import save_pt2, spec_dict

BATCH = {"min": 1, "opt": 2, "max": 4}
SEQ = {"min": 4, "opt": 16, "max": 24}
EXPORT_BATCH, EXPORT_SEQ = (1, 8), (2, 32)  # the .pt2's own ranges: wider than the spec's


def _token_inputs(case_name: str, batch: int, seq: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Token ids, plus for BERT a right-padded mask (every row keeps at least half its tokens)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, third_party.VOCAB, (batch, seq), generator=gen)
    if case_name != "hf_bert":
        return (ids,)
    lengths = torch.randint(max(1, seq // 2), seq + 1, (batch,), generator=gen)
    return ids, (torch.arange(seq)[None, :] < lengths[:, None]).to(torch.int64)


def _save_pt2_with_dynamic_seq(case_name: str, path: Path) -> Path:
    case = CORPUS[case_name]
    batch = torch.export.Dim("batch", min=EXPORT_BATCH[0], max=EXPORT_BATCH[1])
    seq = torch.export.Dim("seq", min=EXPORT_SEQ[0], max=EXPORT_SEQ[1])
    args = case.example_inputs(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ep = torch.export.export(case.build(), args, dynamic_shapes=tuple({0: batch, 1: seq} for _ in args))
    torch.export.save(ep, str(path))
    return path


def _spec(case_name: str, **extra) -> dict:
    case = CORPUS[case_name]
    inputs = [{"name": n, "shape": ["batch", "seq"], "dtype": "int64"} for n in case.input_names]
    return {"inputs": inputs, "dynamic_dims": {"batch": BATCH, "seq": SEQ}, "targets": ["torchscript"],
            "verify": {"atol": case.tolerance, "rtol": 1e-3, "samples": 1}} | extra


@pytest.mark.parametrize("case_name", ["hf_bert", "hf_gpt2"])
def test_pt2_with_dynamic_batch_and_seq_gives_torchscript_that_runs_at_every_size(case_name: str,
                                                                                  tmp_path: Path) -> None:
    out = tmp_path / "out"
    model = _save_pt2_with_dynamic_seq(case_name, tmp_path / "model.pt2")
    manifest = convert(model, parse_spec(_spec(case_name)), out)

    assert manifest["status"] == "succeeded"
    assert [a["path"] for a in manifest["artifacts"]] == ["model.ts"]
    [record] = manifest["verification"]
    assert record["format"] == "torchscript" and record["passed"], record
    # min, opt and max of both dims, each checked against the eager model (shapes_checked holds a
    # point's input shape, or its list of input shapes when there are several)
    checked = {tuple(shape if isinstance(shape[0], int) else shape[0]) for shape in record["shapes_checked"]}
    assert {(BATCH[w], SEQ[w]) for w in ("min", "opt", "max")} <= checked, record["shapes_checked"]
    assert any("torchscript: scripted from the graph" in w for w in manifest["warnings"]), manifest["warnings"]
    assert json.loads((out / "manifest.json").read_text())["verification"] == manifest["verification"]

    # sizes inside the range that no sample point used, run as a user would: torch.jit.load
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        archive = torch.jit.load(str(out / "model.ts"))
    eager = CORPUS[case_name].build()
    for batch, seq in ((3, 7), (2, 5), (4, 23)):
        args = _token_inputs(case_name, batch, seq, seed=batch * 100 + seq)
        with torch.no_grad():
            got, want = archive(*args), eager(*args)
        assert got.shape == want.shape == (batch, seq, want.shape[-1])
        torch.testing.assert_close(got, want, atol=CORPUS[case_name].tolerance, rtol=1e-3)
    # past the spec's max the archive runs, as the manifest says (a TorchScript archive has no ranges)
    assert record["outside_range"].startswith("runs")
    with torch.no_grad():
        assert archive(*_token_inputs(case_name, BATCH["max"] + 1, SEQ["max"] + 1)).shape[:2] == (5, 25)


def test_script_method_scripts_the_export_graph(tmp_path: Path) -> None:
    """spec.torchscript.method: script works on a .pt2's aten graph (plain torch.jit.script refuses
    `torch.ops.aten.sym_size.int`), and scripting leaves the graph it was given as it was."""
    ep = torch.export.load(str(_save_pt2_with_dynamic_seq("hf_gpt2", tmp_path / "model.pt2")))
    gm = fx_from_exported(ep)
    code_before = gm.code
    checks = [_token_inputs("hf_gpt2", b, s) for b, s in ((1, 4), (4, 24))]
    exporter = TorchScriptFromGraphModule(gm, _token_inputs("hf_gpt2", 2, 16), "script", check_inputs=checks)
    exporter(tmp_path / "model.ts")
    assert gm.code == code_before
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        archive = torch.jit.load(str(tmp_path / "model.ts"))
    args = _token_inputs("hf_gpt2", 3, 11)
    with torch.no_grad():
        torch.testing.assert_close(archive(*args), gm(*args))


def test_onnx_below_opset_18_from_a_pt2_keeps_the_dynamic_dims(tmp_path: Path) -> None:
    """Opset <= 17 comes from the TorchScript-based exporter, which exports the scripted graph once the
    trace fixes the sizes: `x.size(d)` (the rewritten aten.sym_size) becomes ONNX Shape, not a constant."""
    import onnx

    out = tmp_path / "out"
    model = _save_pt2_with_dynamic_seq("hf_bert", tmp_path / "model.pt2")  # (GPT-2's aten::diff has no opset 17 form)
    manifest = convert(model, parse_spec(_spec("hf_bert", targets=["onnx"], onnx={"opset": 17})), out)
    [record] = manifest["verification"]
    assert record["format"] == "onnx" and record["passed"], record
    assert {(BATCH[w], SEQ[w]) for w in ("min", "max")} <= {tuple(s[0]) for s in record["shapes_checked"]}
    for value in onnx.load(str(out / "model.onnx")).graph.input:
        assert [d.dim_param for d in value.type.tensor_type.shape.dim] == ["batch", "seq"]


class _SizeArithmetic(nn.Module):
    """Sizes through `max`/`min`/`//`/`%` (torch.sym_max, ... in the export graph) and a dict output.
    symbolic_trace of its ep.module() fails on torch.sym_max, so the pipeline keeps the unretraced
    ep.module(): pytree input/output code and a `_guards_fn` submodule, all of which must go."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        batch, seq = x.shape[0], x.shape[1]
        half = seq // 2
        pad = torch.zeros(max(batch, half), 3)
        y = x[:, :half] * (seq * 2) / batch
        return y.sum(1, keepdim=True) + pad.sum() + min(batch, seq) + seq % 3, {"pad": pad}


def test_unretraced_export_module_with_size_arithmetic_scripts() -> None:
    dims = {0: torch.export.Dim.AUTO, 1: torch.export.Dim.AUTO}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ep = torch.export.export(_SizeArithmetic(), (torch.randn(4, 10),), dynamic_shapes=(dims,))
    gm = fx_from_exported(ep)
    assert "tree_flatten_spec" in gm.code and "_guards_fn" in gm.code  # the form this test is about
    scripted = script_graph_module(gm)
    for shape in ((2, 5), (7, 40), (9, 3)):
        x = torch.randn(*shape)
        got, want = scripted(x), _SizeArithmetic()(x)
        torch.testing.assert_close(got[0], want[0])
        assert set(got[1]) == {"pad"} and got[1]["pad"].shape == want[1]["pad"].shape


def test_control_flow_pt2_refuses_naming_the_op_and_the_source_line(tmp_path: Path) -> None:
    """torch.cond has no TorchScript form: neither a trace nor a script of the graph works, and a
    .pt2 has no eager model to trace. The refusal names the op, the model's line, and what to do."""
    case = CORPUS["control_flow"]
    model = save_pt2(case, tmp_path / "model.pt2")
    with pytest.raises(ConversionFailed) as info:
        convert(model, parse_spec(spec_dict(case, targets=("torchscript",))), tmp_path / "out")
    text = str(info.value)
    assert info.value.stage == "export"
    assert "scripting the graph stops at torch.ops.higher_order.cond" in text, text
    assert "handwritten.py:" in text and "torch.cond(x.sum() > 0" in text, text  # the model's own line
    assert "drop 'torchscript' from targets" in text


def _spread(*tensors: torch.Tensor) -> torch.Tensor:
    return sum(t * i for i, t in enumerate(tensors))


torch.fx.wrap("_spread")


class _VarargsHelper(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _spread(x, x + 1).relu()


def test_a_scripting_error_names_the_line_torchscript_stopped_at() -> None:
    """A torch-level graph (as from a torch.package) calling a helper TorchScript cannot compile: the
    error names the helper's own line, which the user can change, not TorchScript's internals."""
    gm = torch.fx.symbolic_trace(_VarargsHelper())
    with pytest.raises(ScriptingBlocked) as info:
        script_graph_module(gm)
    line = _spread.__code__.co_firstlineno
    assert info.value.op == "`def _spread(*tensors: torch.Tensor) -> torch.Tensor:`"
    assert info.value.source == f"{__file__}:{line}" and "variable number of arguments" in info.value.reason
    exporter = TorchScriptFromGraphModule(gm, (torch.randn(2, 3),), "script", check_inputs=[(torch.randn(2, 3),)])
    with pytest.raises(ConversionFailed, match=rf"scripting the graph stops at .*test_torchscript_dynamic.py:{line}"):
        exporter.script_module()
