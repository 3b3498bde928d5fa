"""The export target registry: one entry per target the engine writes, in step with the spec."""

from __future__ import annotations

from pathlib import Path
from typing import get_args

import pytest

from fxport.jobs import STAGES
from fxport.spec import TARGETS, InputSpec
from fxport.workers.engine.exporters import REGISTRY
from fxport.workers.engine.exporters.registry import (
    TENSORRT_ONNX,
    exported_targets,
    later_stage,
    later_stage_of,
    later_targets,
)
from fxport.workers.engine.inputs import InputSignature
from fxport.workers.engine.request import DeferredTarget
from fxport.workers.jobs import artifact_format


def test_every_spec_target_has_an_entry():
    # TENSORRT_ONNX is not the user's: the int8 ONNX model the engine is built from, beside model.onnx
    assert set(TARGETS) == set(REGISTRY) - {TENSORRT_ONNX}


def test_the_engine_is_built_by_a_later_stage_from_an_onnx_entry():
    """tensorrt is not written by the export stage: its own stage (queue gpu) builds it from the
    ONNX model, and every target a later stage reads is an ONNX entry the export stage writes."""
    assert exported_targets(REGISTRY) == [t for t in REGISTRY if t != "tensorrt"]
    assert later_targets(TARGETS) == ["tensorrt"]
    stage = later_stage_of("tensorrt")
    assert (stage.name, stage.queue) == ("tensorrt", "gpu") and later_stage("tensorrt") is stage
    assert stage.source_paths == ("model.tensorrt.onnx", "model.onnx")
    assert all(REGISTRY[s].onnx and REGISTRY[s].from_graph is not None for s in stage.sources)
    assert stage.name in STAGES
    with pytest.raises(ValueError, match="unknown stage"):
        later_stage("export")


def test_deferrable_targets_are_the_later_stage_targets():
    assert set(get_args(DeferredTarget)) == set(later_targets(REGISTRY))


def test_paths_are_distinct_and_name_their_format():
    assert len({t.path for t in REGISTRY.values()}) == len(REGISTRY)
    for name, target in REGISTRY.items():
        assert artifact_format(target.path, {}) == name
        if target.onnx:
            assert artifact_format(target.path + ".data", {}) == name
    assert artifact_format("fx_source/module.py", {}) == "fx_source"


def test_eager_builds_exactly_torchscript_and_onnx():
    assert {n for n, t in REGISTRY.items() if t.from_eager is not None} == {"torchscript", "onnx"}


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_each_runner_is_made_for_its_own_format(name: str, tmp_path: Path):
    sig = InputSignature(inputs=[InputSpec(name="x", shape=[1, 4])], dynamic_dims={})
    runner = REGISTRY[name].runner(tmp_path / REGISTRY[name].path, sig)  # made, not activated: no file needed
    assert runner.name == name


def test_the_pt2_and_the_onnx_model_share_one_torch_export_of_the_graph(tmp_path: Path, tiny_pt2: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """No work twice: the graph is torch.export-ed once for both targets that need a program, and
    both artifacts still verify."""
    import torch

    from fxport.spec import parse_spec
    from fxport.workers.engine.pipeline import convert

    calls = []
    real = torch.export.export

    def counted(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.export, "export", counted)  # what the ONNX exporter calls on a module, too
    manifest = convert(tiny_pt2, parse_spec({"targets": ["onnx", "exported_program"], "verify": {"samples": 1}}),
                       tmp_path / "out", report=False)
    assert len(calls) == 1
    assert {v["format"]: v["passed"] for v in manifest["verification"]} == {"onnx": True, "exported_program": True}
