"""The original model's outputs are computed once per sample input and conversion (issue 24 item 3):
the TorchScript exporter's check of a trace at other shapes uses the very inputs verification
runs, and reads the original model's outputs there instead of running the graph again."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest
import torch
from torch import nn

from fxport.errors import ConversionFailed
from fxport.spec import parse_spec
from fxport.workers.engine import pipeline
from fxport.workers.engine.exporters.torchscript import TorchScriptFromGraphModule
from fxport.workers.engine.inputs import resolve_signature
from fxport.workers.engine.samples import Checks
from fxport.workers.engine.verify.runners import EagerRunner, ReferenceOutputs
from tests.models import get
from tests.workers.engine.conftest import save_pt2, spec_dict


class Counted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.linear(x).relu()


def test_reference_outputs_are_computed_once_per_input_object():
    model = Counted().eval()
    reference = ReferenceOutputs(model)
    a, b = (torch.randn(2, 4),), (torch.randn(2, 4),)
    first = reference.infer(a)
    assert reference.infer(a) is first and model.calls == 1
    reference.infer(b)
    assert model.calls == 2
    assert reference.output_paths == [""]
    # an equal but distinct input is another input: identity, not value, is the key
    reference.infer((a[0].clone(),))
    assert model.calls == 3
    assert [t.shape for t in reference.leaves(a)] == [torch.Size([2, 3])] and model.calls == 3


def _graph(batch_max: int = 8) -> tuple[torch.fx.GraphModule, nn.Module]:
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3)).eval()
    batch = torch.export.Dim("batch", min=1, max=batch_max)
    ep = torch.export.export(model, (torch.randn(2, 4),), dynamic_shapes=({0: batch},))
    return ep.module(), model


def test_trace_is_checked_against_the_reference_it_is_given():
    gm, model = _graph()
    example, checks = (torch.randn(2, 4),), [(torch.randn(1, 4),), (torch.randn(8, 4),)]
    asked: list[int] = []

    def reference(args):
        asked.append(id(args))
        with torch.no_grad():
            return [model(*args)]

    exporter = TorchScriptFromGraphModule(gm, example, check_inputs=checks, reference=reference)
    scripted = exporter.script_module()
    assert asked == [id(c) for c in checks]  # once per check input, for every candidate together
    assert scripted(checks[1][0]).shape == (8, 3)

    # outputs that disagree with the reference reject every candidate: the check compares with it
    wrong = TorchScriptFromGraphModule(gm, example, check_inputs=checks,
                                       reference=lambda args: [torch.full((args[0].shape[0], 3), 1e3)])
    with pytest.raises(ConversionFailed, match="other values"):
        wrong.script_module()


def test_trace_checks_are_verification_inputs_at_other_shapes_than_the_example():
    case = get("tiny_linear")
    spec = parse_spec(spec_dict(case, targets=("torchscript",), batch=(1, 2, 8)))
    sig = resolve_signature(spec, None)
    checks = Checks(sig, spec, ReferenceOutputs(nn.Identity()))
    by_id = {id(p.args): p.dims for p in checks.points}
    assert sig.export_point() == {"batch": 2}
    assert [by_id[id(args)] for args in checks.trace_checks()] == [{"batch": 1}, {"batch": 8}]


def test_a_conversion_runs_the_original_model_once_per_sample_input(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch):
    """TorchScript, ONNX and .pt2 with verification: every input the original model is run at
    is a verification input, and each is run once (before, the exporter's own check ran the
    graph at three more inputs)."""
    case = get("tiny_linear")
    model_path = save_pt2(case, tmp_path / "m.pt2")
    spec = parse_spec(spec_dict(case, targets=("torchscript", "onnx", "exported_program"), batch=(1, 2, 8)))
    runs: collections.Counter[int] = collections.Counter()
    shapes: list[tuple[int, ...]] = []
    plain_infer = EagerRunner.infer

    def counted(self, args):
        runs[id(args)] += 1
        shapes.append(tuple(args[0].shape))
        return plain_infer(self, args)

    monkeypatch.setattr(EagerRunner, "infer", counted)
    graph_runs = []
    plain_expected = TorchScriptFromGraphModule._expected_outputs

    def expected(self):
        graph_runs.append(self.reference is not None)
        return plain_expected(self)

    monkeypatch.setattr(TorchScriptFromGraphModule, "_expected_outputs", expected)
    manifest = pipeline.convert(model_path, spec, tmp_path / "out")
    assert all(r["passed"] for r in manifest["verification"])
    assert graph_runs and all(graph_runs)  # the trace's check read the shared reference
    points = 2 + 2  # samples at opt, then min and max
    assert len(runs) == points and set(runs.values()) == {1}, (runs, shapes)
