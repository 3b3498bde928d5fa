"""A model no capture rung can follow is built from its eager form: TorchScript and ONNX, verified
with the detection comparator; the graph-only targets fail with the capture reason."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from fxport.errors import CaptureFailed, VerificationFailed
from fxport.spec import VerifyOptions, parse_spec
from fxport.workers.engine.exporters.eager import TorchScriptFromEagerModule
from fxport.workers.engine.pipeline import convert
from fxport.workers.engine.verify.comparator import compare_outputs, plan_outputs
from tests.client.packaged import DETECTOR, UNTRACEABLE, package_model


@pytest.fixture(scope="module")
def detector(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return package_model(DETECTOR, "tiny_detector", tmp_path_factory.mktemp("detector"))


def _spec(targets: list[str], **extra) -> dict:
    return {"inputs": [{"name": "images", "shape": [1, 3, 32, 32]}], "targets": targets,
            "verify": {"samples": 6}, **extra}


def test_detector_is_built_from_eager_and_verified_as_detections(detector: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    # allow_partial: exported_program needs a graph; the job accepts the other two
    manifest = convert(detector, parse_spec(_spec(["torchscript", "onnx", "exported_program"], allow_partial=True)),
                       out)
    assert manifest["status"] == "succeeded"
    assert json.loads((out / "manifest.json").read_text())["capture"] == manifest["capture"]

    capture = manifest["capture"]
    assert capture["method"] == "eager"
    assert [(a["method"], a["ok"]) for a in capture["attempts"]] == [("fx", False), ("export", False),
                                                                      ("export", False)]
    assert "data-dependent" in capture["reason"]
    assert manifest["passes"] and all(not p["applied"] and "no graph" in p["notes"] for p in manifest["passes"])

    assert {a["format"] for a in manifest["artifacts"]} == {"torchscript", "onnx"}
    [pt2] = manifest["failed_targets"]
    assert pt2["target"] == "exported_program" and "needs a graph" in pt2["reason"]
    assert "data-dependent" in pt2["reason"]  # the capture reason, in one line
    assert any(w.startswith("exported_program was not built") for w in manifest["warnings"])
    assert any(w.startswith("torchscript: scripted from the eager model") for w in manifest["warnings"])

    records = {r["format"]: r for r in manifest["verification"]}
    assert set(records) == {"torchscript", "onnx"}
    for fmt, record in records.items():
        assert record["passed"] and record["verdict"] == "passed", (fmt, record)
        how = {c["name"]: (c["compared_as"], c.get("role")) for c in record["comparison"]}
        assert how == {"output_0 [0]['boxes']": ("detections", "boxes"),
                       "output_1 [0]['scores']": ("detections", "scores"),
                       "output_2 [0]['labels']": ("detections", "labels")}, how
        boxes = record["outputs"][0]
        # the six samples found different numbers of boxes, and every one of them paired up
        assert boxes["count_model"] == boxes["count_artifact"] == boxes["paired"] > 6 and boxes["unmatched"] == 0


def test_only_graph_targets_fail_as_before(detector: Path, tmp_path: Path) -> None:
    with pytest.raises(CaptureFailed) as info:
        convert(detector, parse_spec(_spec(["exported_program"])), tmp_path / "out")
    assert info.value.stage == "capture" and "only torchscript and onnx" in str(info.value)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["status"] == "failed" and manifest["error"]["stage"] == "capture"


def test_a_forced_rung_does_not_fall_back(detector: Path, tmp_path: Path) -> None:
    with pytest.raises(CaptureFailed) as info:
        convert(detector, parse_spec(_spec(["torchscript"], capture="export")), tmp_path / "out")
    assert "capture: auto" in str(info.value)


def test_a_branch_is_kept_by_scripting_and_a_trace_that_kept_one_side_fails_verification(tmp_path: Path) -> None:
    """ONNX from the eager model comes from the model scripted: its branch is an ONNX If node and it
    verifies. A model torch.jit.script rejects is traced instead, and an input that takes the other
    branch exposes the trace in verification."""
    model = package_model(UNTRACEABLE, "branchy", tmp_path)
    spec = {"inputs": [{"name": "x", "shape": [2, 4]}], "targets": ["onnx", "torchscript"], "verify": {"samples": 8}}
    manifest = convert(model, parse_spec(spec), tmp_path / "out")
    assert manifest["capture"]["method"] == "eager"
    assert [r["verdict"] for r in manifest["verification"]] == ["passed", "passed"]
    assert "If" in {n.op_type for n in onnx.load(str(tmp_path / "out" / "model.onnx")).graph.node}
    assert any(w.startswith("onnx: exported from the eager model scripted") for w in manifest["warnings"])

    unscriptable = package_model(UNSCRIPTABLE_BRANCH, "branchy_getattr", tmp_path / "unscriptable")
    spec["targets"] = ["onnx"]
    with pytest.raises(VerificationFailed) as info:  # a trace keeps one side of the branch
        convert(unscriptable, parse_spec(spec), tmp_path / "out2")
    text = str(info.value)
    assert "onnx: output_0: " in text and "elements beyond" in text and "built from the eager model" in text
    warnings = json.loads((tmp_path / "out2" / "manifest.json").read_text())["warnings"]
    assert any(w.startswith("onnx: traced from the eager model") and "torch.jit.script failed" in w for w in warnings)


# UNTRACEABLE, with an activation torch.jit.script cannot compile (getattr with a name it cannot see)
UNSCRIPTABLE_BRANCH = textwrap.dedent('''
    import torch
    from torch import nn


    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.activation = "tanh"

        def forward(self, x):
            y = getattr(torch, self.activation)(self.fc(x))
            if y.sum() > 0:  # decided by the values, in Python
                return y * 2
            return y - 1
''')


class _Unscriptable(nn.Module):
    """torch.jit.script rejects getattr with a name it cannot see at compile time; a trace does not care."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.activation = "relu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(torch, self.activation)(self.fc(x))


def test_torchscript_falls_back_to_a_trace_when_script_fails(tmp_path: Path) -> None:
    model = _Unscriptable().eval()
    x = torch.randn(2, 4)
    exporter = TorchScriptFromEagerModule(model, (x,), check_inputs=[(torch.randn(3, 4),)])
    path = exporter(tmp_path / "model.ts")
    assert exporter.note.startswith("traced from the eager model (torch.jit.script failed:")
    loaded = torch.jit.load(str(path))
    torch.testing.assert_close(loaded(x), model(x))


# -- the detection comparator on its own -------------------------------------------------------

BOXES = np.array([[0, 0, 10, 10], [20, 20, 30, 35], [5, 40, 25, 60], [50, 50, 70, 80]], dtype=np.float32)
SCORES = np.array([0.9, 0.8, 0.7, 0.6], dtype=np.float32)
LABELS = np.array([1, 2, 1, 0], dtype=np.int64)
PATHS = ["[0]['boxes']", "[0]['scores']", "[0]['labels']"]


def _layout(*samples: list[np.ndarray]):
    return plan_outputs(list(samples), PATHS)


def test_same_detections_in_another_order_match() -> None:
    ref = [BOXES, SCORES, LABELS]
    order = np.array([2, 0, 3, 1])
    got = [BOXES[order] + 1e-5, SCORES[order], LABELS[order]]
    m = compare_outputs(ref, got, VerifyOptions(), _layout(ref))
    assert m["passed"], m
    assert [o["compared_as"] for o in m["outputs"]] == ["detections"] * 3
    assert m["outputs"][0]["paired"] == 4 and m["outputs"][0]["unmatched"] == 0


def test_one_extra_box_is_a_count_difference() -> None:
    ref = [BOXES, SCORES, LABELS]
    extra = np.array([[80, 0, 90, 12]], dtype=np.float32)
    got = [np.concatenate([BOXES, extra]), np.append(SCORES, np.float32(0.56)), np.append(LABELS, 2)]
    m = compare_outputs(ref, got, VerifyOptions(), _layout(ref))
    assert not m["passed"]
    boxes = m["outputs"][0]
    assert (boxes["count_model"], boxes["count_artifact"], boxes["paired"], boxes["unmatched"]) == (4, 5, 4, 1)
    assert "finds 5 where the model finds 4" in m["mismatch"] and "0.56" in m["mismatch"]
    # an allowance for detections that flip at a threshold lets exactly that many through
    assert compare_outputs(ref, got, VerifyOptions(max_unmatched_detections=1), _layout(ref))["passed"]


def test_a_moved_box_fails_and_a_relabelled_one_does_not_pair() -> None:
    ref = [BOXES, SCORES, LABELS]
    moved = BOXES.copy()
    moved[1] += 2.0  # still overlaps its original (IoU > 0.5): paired, then judged beyond tolerance
    m = compare_outputs(ref, [moved, SCORES, LABELS], VerifyOptions(), _layout(ref))
    assert not m["passed"] and m["outputs"][0]["unmatched"] == 0 and m["outputs"][0]["max_abs_diff"] == 2.0
    relabelled = LABELS.copy()
    relabelled[0] = 2
    m = compare_outputs(ref, [BOXES, SCORES, relabelled], VerifyOptions(), _layout(ref))
    assert not m["passed"] and m["outputs"][0]["unmatched"] == 2  # one lost, one extra


def test_tuple_outputs_with_a_varying_count_are_detections() -> None:
    """Without names: one float [N, 4], one float [N] and an int [N] whose N changes between inputs."""
    a = [BOXES, SCORES, LABELS]
    b = [BOXES[:2], SCORES[:2], LABELS[:2]]
    layout = plan_outputs([a, b], ["[0]", "[1]", "[2]"])
    [group] = layout.groups
    assert (group.boxes, group.scores, group.labels) == (0, 1, 2)
    fixed = plan_outputs([a, a], ["[0]", "[1]", "[2]"])  # the same count every time: element-wise
    assert fixed.groups == []
