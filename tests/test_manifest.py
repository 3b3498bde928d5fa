"""manifest.json as a type: old manifests keep loading, round trips lose nothing, stages merge by field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from fxport.manifest import SCHEMA_VERSION, Manifest

ROOT = Path(__file__).parent
# Written by earlier fxport versions, before manifests had a schema_version: they must load forever.
OLD_MANIFESTS = [
    ROOT / "fixtures" / "manifests" / "v1_pt2_onnx_torchscript.json",
    ROOT / "report" / "fixtures" / "manifest_resnet18_int8.json",
]


@pytest.mark.parametrize("path", OLD_MANIFESTS, ids=lambda p: p.name)
def test_old_manifests_load_and_write_back_unchanged(path: Path) -> None:
    raw = json.loads(path.read_text())
    manifest = Manifest.read(path)
    assert manifest.schema_version == 1  # no key: written before versioning
    assert manifest.status == "succeeded"
    assert manifest.artifacts and all(a.sha256 and a.path for a in manifest.artifacts)
    assert {v.format for v in manifest.verification} <= {a.format for a in manifest.artifacts}
    assert manifest.to_dict() == raw  # every key, known or not, survives a read and a write


def test_unknown_keys_from_a_newer_version_are_kept() -> None:
    raw = json.loads(OLD_MANIFESTS[0].read_text())
    raw["schema_version"] = SCHEMA_VERSION + 5
    raw["a_later_section"] = {"x": 1}
    raw["artifacts"][0]["a_later_field"] = "kept"
    again = Manifest.model_validate(raw).to_dict()
    assert again["a_later_section"] == {"x": 1}
    assert again["artifacts"][0]["a_later_field"] == "kept"


@pytest.mark.parametrize("path, value", [
    (("artifacts", 0, "sha256"), None),
    (("artifacts", 0, "bytes"), "many"),
    (("verification", 0, "passed"), "perhaps"),
    (("status",), "exploded"),
])
def test_a_manifest_of_the_wrong_shape_is_refused_naming_the_field(path: tuple, value: object) -> None:
    raw = json.loads(OLD_MANIFESTS[0].read_text())
    target = raw
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises(ValidationError) as info:
        Manifest.model_validate(raw)
    assert tuple(info.value.errors()[0]["loc"][:len(path)]) == path


def test_a_later_stage_merges_by_field() -> None:
    cpu = Manifest.read(OLD_MANIFESTS[0])
    stage = Manifest(
        status="succeeded", toolchain={"tensorrt": "10.9.0", "onnx": None},
        artifacts=[{"format": "tensorrt", "path": "model.plan", "bytes": 10, "sha256": "ab" * 32}],
        verification=[{"format": "tensorrt", "runtime": "tensorrt", "passed": True}],
        warnings=["tensorrt: a warning", cpu.warnings[0] if cpu.warnings else "tensorrt: a warning"],
        timings_s={"load": 1.0, "export": 2.5}, tensorrt={"engine": {"layers": 3}},
    )
    merged = cpu.merge_stage(stage, name="tensorrt")
    assert [a.format for a in merged.artifacts] == [a.format for a in cpu.artifacts] + ["tensorrt"]
    assert merged.verification[-1].format == "tensorrt"
    assert merged.toolchain["tensorrt"] == "10.9.0" and merged.toolchain["onnx"] == cpu.toolchain["onnx"]
    assert merged.timings_s["tensorrt"] == pytest.approx(3.5)
    assert merged.warnings.count("tensorrt: a warning") == 1
    assert merged.tensorrt == {"engine": {"layers": 3}}
    assert merged.capture == cpu.capture and merged.passes == cpu.passes  # the CPU stage's record stands
    assert len(cpu.artifacts) == len(merged.artifacts) - 1  # the CPU manifest itself is not changed


def test_a_failed_stage_fails_the_merged_manifest_with_its_error() -> None:
    cpu = Manifest.read(OLD_MANIFESTS[0])
    failed = Manifest(status="failed", error={"stage": "tensorrt", "code": "conversion_failed",
                                              "message": "engine build failed: unsupported op"})
    merged = cpu.merge_stage(failed, name="tensorrt")
    assert merged.status == "failed"
    assert merged.error is not None and merged.error.stage == "tensorrt"
    assert merged.artifacts == cpu.artifacts  # what the CPU stage made is still listed


def test_a_multi_input_models_shapes_load_as_written() -> None:
    """With several inputs each point checked is a list of shapes, one per input."""
    raw = json.loads(OLD_MANIFESTS[0].read_text())
    raw["verification"][0]["shapes_checked"] = [[[2, 7], [2, 7]], [[1, 2], [1, 2]]]
    manifest = Manifest.model_validate(raw)
    assert manifest.verification[0].shapes_checked == [[[2, 7], [2, 7]], [[1, 2], [1, 2]]]
    assert manifest.to_dict() == raw


def test_the_engine_writes_the_current_schema_through_the_type(tmp_path: Path, tiny_pt2: Path) -> None:
    """The engine builds manifest.json as a Manifest: the current schema_version, every section a
    reader indexes present (also when empty), and a read-and-write-back that changes nothing."""
    from fxport.spec import parse_spec
    from fxport.workers.engine.pipeline import convert

    returned = convert(tiny_pt2, parse_spec({"targets": ["onnx"], "verify": {"samples": 1}}), tmp_path / "out",
                       report=False)
    written = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert written == returned and written["schema_version"] == SCHEMA_VERSION
    for key in ("passes", "artifacts", "verification", "warnings", "timings_s", "error", "capture", "toolchain"):
        assert key in written, key
    assert written["toolchain"]["tensorrt"] is None and written["toolchain"]["python"]  # one reading of versions
    assert Manifest.read(tmp_path / "out" / "manifest.json").to_dict() == written


def test_a_value_json_has_no_type_for_is_written_not_lost() -> None:
    """The open-ended sections (profile, quantization, benchmark) are filled by torch code: a numpy
    scalar or a torch dtype there is written as its number or its text, never fails the write."""
    import numpy as np
    import torch

    m = Manifest(profile={"ms": np.float32(1.5), "dtype": torch.float32, "n": np.int64(3), "path": Path("/x")})
    assert json.loads(m.to_json())["profile"] == {"ms": 1.5, "dtype": "torch.float32", "n": 3, "path": "/x"}
