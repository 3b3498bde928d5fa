"""The export target registry: one entry per target the engine writes, in step with the spec."""

from __future__ import annotations

from pathlib import Path

import pytest

from fxport.spec import TARGETS, InputSpec
from fxport.workers.engine.exporters import REGISTRY
from fxport.workers.engine.exporters.registry import TENSORRT_ONNX
from fxport.workers.engine.inputs import InputSignature
from fxport.workers.jobs import artifact_format


def test_every_spec_target_but_the_engine_has_an_entry():
    # tensorrt is built by its own stage (workers/engine/tensorrt), from the onnx entry's model
    assert set(TARGETS) - {"tensorrt"} == set(REGISTRY) - {TENSORRT_ONNX}


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
