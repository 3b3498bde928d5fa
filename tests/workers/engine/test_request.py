"""EngineRequest: one typed value from the worker (or `fxport convert`) to the engine in the sandbox."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from fxport.spec import parse_spec
from fxport.workers.engine.request import EngineRequest, TimingCachePaths, cpu_stage
from fxport.workers.sandbox.request import SandboxLimits, SandboxRequest


def _request(spec: dict, **kw) -> EngineRequest:
    return EngineRequest(model_path=Path("m.pt2"), spec=parse_spec(spec), out_dir=Path("out"), **kw)


def test_whether_the_engine_is_built_here_is_decided_in_one_place() -> None:
    here = _request({"targets": ["onnx", "tensorrt"]})
    later = _request({"targets": ["onnx", "tensorrt"]}, deferred_targets=("tensorrt",))
    none = _request({"targets": ["onnx"]})
    assert (here.builds_tensorrt, here.needs_tensorrt_onnx) == (True, True)
    assert (later.builds_tensorrt, later.needs_tensorrt_onnx) == (False, True)
    assert (none.builds_tensorrt, none.needs_tensorrt_onnx) == (False, False)
    # the sandbox's terms follow: the GPU only for a build here, and then no address-space cap
    box = SandboxRequest(engine=here, limits=SandboxLimits(memory_bytes=1, cpu_seconds=1), events_path=Path("e"),
                         readable=[], require=[])
    assert box.gpu and not box.limit_address_space


def test_a_request_written_as_json_reads_back_as_the_same_request() -> None:
    spec = {"targets": ["onnx"], "inputs": [{"name": "x", "shape": ["batch", 4]}],
            "dynamic_dims": {"batch": {"min": 1, "opt": 2, "max": 8}}, "precision": "fp16", "labels": {"team": "a"}}
    request = _request(spec, job_id="j1", deferred_targets=("tensorrt",), input_sha256="ab" * 32, timeout_s=30,
                       timing_cache=TimingCachePaths(read=Path("/c/in"), write=Path("/c/out")))
    box = SandboxRequest(engine=request, limits=SandboxLimits(memory_bytes=1 << 30, cpu_seconds=31),
                         events_path=Path("/w/events"), readable=[Path("/w/m.pt2")], require=["seccomp"])
    back = SandboxRequest.model_validate_json(box.model_dump_json())
    assert back == box
    assert back.engine.spec.normalized() == parse_spec(spec).normalized()
    assert back.engine.timeout == 30 and back.engine.memory_bytes == parse_spec(spec).limits.memory_mb << 20


def test_a_request_refuses_an_unknown_key_and_a_target_it_cannot_defer() -> None:
    data = _request({"targets": ["onnx"]}).model_dump(mode="json")
    with pytest.raises(ValidationError, match="extra"):
        EngineRequest.model_validate({**data, "deferred": ["tensorrt"]})
    with pytest.raises(ValidationError):
        EngineRequest.model_validate({**data, "deferred_targets": ["onnx"]})


@pytest.mark.parametrize("spec", [
    {"targets": ["onnx"]},
    {"targets": ["tensorrt"]},
    {"targets": ["torchscript", "tensorrt"]},
    {"targets": ["tensorrt"], "precision": "int8"},
    {"targets": ["onnx", "tensorrt"], "precision": "int8"},
])
def test_the_cpu_stage_of_a_job_is_what_validating_its_spec_anew_gives(spec: dict) -> None:
    """cpu_stage derives the CPU part without a second validation; it must give the spec a full
    validation of the hand-written CPU part gives (the manifest and the cache key record it)."""
    derived, deferred = cpu_stage(parse_spec(spec))
    wants = "tensorrt" in spec["targets"]
    assert deferred == (("tensorrt",) if wants else ())
    expected = dict(spec)
    if wants:
        targets = [t for t in spec["targets"] if t != "tensorrt"]
        expected["targets"] = targets + ([] if "onnx" in targets else ["onnx"])
        if spec["targets"] == ["tensorrt"] and spec.get("precision") == "int8":
            expected["quantization"] = {"runtime": "tensorrt"}
    assert derived.normalized() == parse_spec(expected).normalized()
