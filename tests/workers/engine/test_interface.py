"""What a serving config reads off an artifact (issue 22, items 1, 2 and 4): output names from the
spec (or output_0, ...), every dynamic dim under the name the spec gives it, and provenance inside
the ONNX model, the TorchScript archive and the .pt2."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

from fxport.errors import InvalidInput, SpecError
from fxport.spec import parse_spec, spec_from_flags
from fxport.workers.engine.exporters.interface import PROVENANCE_FILE
from fxport.workers.engine.pipeline import convert


class Tagger(nn.Module):
    """tokens [batch, seq] → (per-token logits [batch, seq, 5], pooled [batch, 8]): two outputs, two dynamic dims."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 8)
        self.head = nn.Linear(8, 5)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.embed(tokens)
        return self.head(h), h.mean(dim=1)


@pytest.fixture(scope="module")
def tagger_pt2(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tagger") / "tagger.pt2"
    torch.manual_seed(0)
    dims = {0: torch.export.Dim("batch", min=1, max=16), 1: torch.export.Dim("seq", min=2, max=32)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ep = torch.export.export(Tagger().eval(), (torch.randint(0, 50, (2, 6)),), dynamic_shapes=(dims,))
    torch.export.save(ep, str(path))
    return path


def _spec(**extra):
    return parse_spec({"inputs": [{"name": "tokens", "shape": ["batch", "seq"], "dtype": "int64"}],
                       "dynamic_dims": {"batch": {"min": 1, "opt": 2, "max": 8},
                                        "seq": {"min": 2, "opt": 6, "max": 16}},
                       "targets": ["onnx", "torchscript", "exported_program"], "verify": {"samples": 1}} | extra)


def _dims(value) -> list:
    return [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]


def test_named_outputs_and_every_dim_name_reach_the_onnx_model_and_the_manifest(tagger_pt2, tmp_path) -> None:
    m = convert(tagger_pt2, _spec(outputs=["token_logits", "pooled"]), tmp_path / "out", job_id="01JOBID")
    graph = onnx.load(str(tmp_path / "out" / "model.onnx")).graph
    assert [o.name for o in graph.output] == ["token_logits", "pooled"]
    assert _dims(graph.input[0]) == ["batch", "seq"]  # the spec's names, whatever the exporter chose
    assert _dims(graph.output[0]) == ["batch", "seq", 5] and _dims(graph.output[1]) == ["batch", 8]
    assert m["outputs"] == [{"name": "token_logits", "dtype": "float32", "shape": ["batch", "seq", 5]},
                            {"name": "pooled", "dtype": "float32", "shape": ["batch", 8]}]
    # the renamed model still runs, and was verified after the renaming
    session = ort.InferenceSession(str(tmp_path / "out" / "model.onnx"), providers=["CPUExecutionProvider"])
    assert [o.name for o in session.get_outputs()] == ["token_logits", "pooled"]
    assert all(v["passed"] for v in m["verification"])


def test_the_manifest_says_what_each_artifact_does_past_the_spec_ranges(tagger_pt2, tmp_path) -> None:
    """Item 6: a .pt2 asserts its ranges, ONNX, TorchScript and this FX source run any size. The manifest
    says so per artifact; here each artifact is run one step past each dim's max to check it says true."""
    from fxport.workers.engine.exporters.fx_source import MODULE_CLASS
    from fxport.workers.engine.verify import runners as r

    spec = _spec(targets=["onnx", "torchscript", "exported_program", "fx_source"])
    m = convert(tagger_pt2, spec, tmp_path / "out")
    said = {v["format"]: v["outside_range"] for v in m["verification"]}
    out = tmp_path / "out"
    runners = {"onnx": r.OnnxRuntimeRunner(out / "model.onnx"), "torchscript": r.TorchScriptRunner(out / "model.ts"),
               "exported_program": r.ExportedProgramRunner(out / "model.pt2"),
               "fx_source": r.FxSourceRunner(out / "fx_source", MODULE_CLASS)}
    for fmt, runner in runners.items():
        for past in ({"batch": 9, "seq": 6}, {"batch": 2, "seq": 17}):
            with runner:
                try:
                    runner.infer((torch.randint(0, 50, (past["batch"], past["seq"])),))
                    refused = False
                except Exception:
                    refused = True
            assert said[fmt].startswith("refused" if refused else "runs"), (fmt, past, said[fmt])
    assert said["exported_program"].startswith("refused") and said["onnx"].startswith("runs")


def test_default_output_names_are_stable_and_readable(tagger_pt2, tmp_path) -> None:
    convert(tagger_pt2, _spec(), tmp_path / "out")
    graph = onnx.load(str(tmp_path / "out" / "model.onnx")).graph
    assert [o.name for o in graph.output] == ["output_0", "output_1"]


def test_provenance_is_in_every_artifact(tagger_pt2, tmp_path) -> None:
    spec = _spec()
    m = convert(tagger_pt2, spec, tmp_path / "out", job_id="01JOBID")
    want = {"version": m["fxport_version"], "source_sha256": m["input"]["sha256"],
            "spec_digest": spec.artifact_digest()}
    model = onnx.load(str(tmp_path / "out" / "model.onnx"))
    assert {p.key: p.value for p in model.metadata_props} == {f"fxport.{k}": v for k, v in want.items()}
    files = {PROVENANCE_FILE: ""}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.jit.load(str(tmp_path / "out" / "model.ts"), _extra_files=files)
    assert json.loads(files[PROVENANCE_FILE]) == want
    extra = {PROVENANCE_FILE: ""}
    torch.export.load(str(tmp_path / "out" / "model.pt2"), extra_files=extra)
    assert json.loads(extra[PROVENANCE_FILE]) == want
    # the same model and spec in another job, with other labels and limits (they describe the job):
    # the same ONNX bytes (the cache and redelivery rely on it)
    other = spec.model_copy(update={"labels": {"ci": "2"}, "limits": spec.limits.model_copy(update={"timeout_s": 60})})
    again = convert(tagger_pt2, other, tmp_path / "again", job_id="01OTHER")
    assert {a["path"]: a["sha256"] for a in again["artifacts"]}["model.onnx"] == \
        {a["path"]: a["sha256"] for a in m["artifacts"]}["model.onnx"]


def test_a_wrong_number_of_output_names_is_named_with_the_count(tagger_pt2, tmp_path) -> None:
    with pytest.raises(InvalidInput, match=r"names 1 output\(s\) but the model has 2") as err:
        convert(tagger_pt2, _spec(outputs=["only_one"]), tmp_path / "out")
    assert err.value.field == "outputs" and "output_0, output_1" in err.value.hint


def test_output_flags_combine_with_the_spec_file() -> None:
    data = spec_from_flags({"targets": ["onnx"], "precision": "fp16"}, outputs=["logits", "features"])
    spec = parse_spec(data)
    assert spec.outputs == ["logits", "features"] and spec.precision == "fp16"
    with pytest.raises(SpecError, match="duplicate output names"):
        parse_spec(spec_from_flags({}, outputs=["a", "a"]))


class Masked(nn.Module):
    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return (ids * mask).float().sum(dim=1, keepdim=True)


def test_a_pt2s_shared_dim_keeps_one_name_across_inputs(tmp_path) -> None:
    """A .pt2 stores dims as symbols (s0, s1), not Dim names: without spec.inputs the names are made up,
    but inputs sharing a dim must share its name (one range), on the signature and in the ONNX model."""
    seq = torch.export.Dim("seq", min=2, max=32)
    args = (torch.ones(2, 6, dtype=torch.int64), torch.ones(2, 6, dtype=torch.int64))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ep = torch.export.export(Masked(), args, dynamic_shapes=({0: torch.export.Dim("batch", max=8), 1: seq},
                                                                 {0: torch.export.Dim("batch", max=8), 1: seq}))
    torch.export.save(ep, str(tmp_path / "m.pt2"))
    m = convert(tmp_path / "m.pt2", parse_spec({"targets": ["onnx"], "verify": {"samples": 1}}), tmp_path / "out")
    shapes = [i["shape"] for i in m["inputs"]["inputs"]]
    assert shapes[0] == shapes[1] == ["batch", "ids_dim1"] and set(m["inputs"]["dynamic_dims"]) == {"batch", "ids_dim1"}
    graph = onnx.load(str(tmp_path / "out" / "model.onnx")).graph
    assert _dims(graph.input[0]) == _dims(graph.input[1]) == ["batch", "ids_dim1"]


def test_opset_17_and_lower_come_from_the_torchscript_based_exporter(tmp_path) -> None:
    """Item 3: older TensorRT, onnxruntime and edge converters need opset 17 or lower; the file must really be
    at the opset asked for (the torch.export exporter's own fallback silently left ResNet at 18)."""
    from tests.models import get
    from tests.workers.engine.conftest import save_pt2, spec_dict

    case = get("resnet18_small")
    model = save_pt2(case, tmp_path / "m.pt2")
    for opset in (17, 11):
        out = tmp_path / f"o{opset}"
        m = convert(model, parse_spec(spec_dict(case, targets=("onnx",), onnx={"opset": opset})), out)
        assert [o.version for o in onnx.load(str(out / "model.onnx")).opset_import if o.domain in ("", "ai.onnx")] \
            == [opset]
        assert m["verification"][0]["passed"] and m["outputs"][0]["name"] == "output_0"
        assert m["outputs"][0]["shape"][0] == "batch"


@pytest.mark.parametrize("opset", [18, 20])
def test_the_opset_the_exporter_reports_is_the_one_in_the_file(tmp_path, monkeypatch, opset: int) -> None:
    """From opset 18 the check takes the written opset from the torch.export-based exporter's own
    model instead of parsing the file again: that word must be the file's, and a file at another
    opset than asked for must still fail the job, naming both."""
    from fxport.errors import ConversionFailed
    from fxport.workers.engine.exporters import onnx as onnx_exporter
    from tests.models import get
    from tests.workers.engine.conftest import save_pt2, spec_dict

    reported: list[int | None] = []
    real = onnx_exporter.check_onnx

    def spy(path: Path, asked: int, written_opset: int | None = None, **kw: Any) -> Path:
        reported.append(written_opset)
        return real(path, asked, written_opset, **kw)

    monkeypatch.setattr(onnx_exporter, "check_onnx", spy)
    case = get("tiny_linear")
    out = tmp_path / "out"
    convert(save_pt2(case, tmp_path / "m.pt2"), parse_spec(spec_dict(case, targets=("onnx",), onnx={"opset": opset})),
            out)
    in_file = [o.version for o in onnx.load(str(out / "model.onnx")).opset_import if o.domain in ("", "ai.onnx")]
    assert reported == [opset] and in_file == [opset]
    with pytest.raises(ConversionFailed, match=f"came out at opset {opset}, not the {opset - 1} asked for"):
        real(out / "model.onnx", opset - 1, reported[0])
    with pytest.raises(ConversionFailed, match=f"came out at opset {opset}, not the {opset - 1} asked for"):
        real(out / "model.onnx", opset - 1)  # read from the file when the exporter said nothing


def test_a_model_that_needs_a_newer_opset_names_the_op_and_the_opset(tmp_path) -> None:
    from fxport.errors import ConversionFailed
    from tests.models import get
    from tests.workers.engine.conftest import save_pt2, spec_dict

    case = get("transformer_block")
    model = save_pt2(case, tmp_path / "m.pt2")
    with pytest.raises(ConversionFailed, match=r"opset 11 failed: .*'aten::unflatten'.* added in version 13"):
        convert(model, parse_spec(spec_dict(case, targets=("onnx",), onnx={"opset": 11})), tmp_path / "out")


def test_int8_below_opset_18_is_refused_by_the_spec() -> None:
    with pytest.raises(SpecError, match="onnx.opset 17 cannot hold int8"):
        parse_spec({"targets": ["onnx"], "precision": "int8", "onnx": {"opset": 17}})
    parse_spec({"targets": ["onnx"], "precision": "fp16", "onnx": {"opset": 17}})  # fp16 can
