"""manifest.json as a type: old manifests keep loading, round trips lose nothing, stages merge by field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from fxport.manifest import SCHEMA_VERSION, Manifest, read_leniently

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


# ---------------------------------------------------------------- the stage sections, typed

# Written by this version's engine (int8 with two schemes, a fallback, a benchmark, a TensorRT
# preflight) and by a sandboxed worker job (`sandbox`): every section a reader reads.
REAL_MANIFESTS = [
    ROOT / "fixtures" / "manifests" / "v3_resnet18_int8_two_schemes.json",
    ROOT / "fixtures" / "manifests" / "v3_tiny_sandboxed.json",
]


@pytest.mark.parametrize("path", REAL_MANIFESTS + OLD_MANIFESTS, ids=lambda p: p.name)
def test_a_real_manifest_round_trips_byte_for_byte(path: Path) -> None:
    """Read through every typed section and written back: the same keys, in the same order, the
    same values (an int stays an int, a None stays written), the same bytes."""
    raw = json.loads(path.read_text())
    again = Manifest.from_json(path.read_text()).to_dict()
    assert again == raw
    if path in REAL_MANIFESTS:  # (an old fixture's top level was written in another order)
        assert json.dumps(again, indent=2) == json.dumps(raw, indent=2)


def test_the_sections_read_as_types() -> None:
    m = Manifest.read(REAL_MANIFESTS[0])
    assert m.benchmark is not None and m.quantization is not None and m.profile is not None
    row = m.benchmark.results[0]
    assert row.artifact == "eager" and isinstance(row.p50_ms, float) and row.runs == 6
    assert m.benchmark.machine is not None and m.benchmark.machine.cores == 2
    assert m.quantization.runtime == "onnxruntime" and set(m.quantization.schemes) == {"onnxruntime", "tensorrt"}
    tensorrt = m.quantization.schemes["tensorrt"]
    assert tensorrt.scheme is not None and (tensorrt.scheme.activations or "").startswith("int8")
    assert m.quantization.fallback is not None and m.quantization.fallback.latency is not None
    assert m.quantization.layers[0].node == "conv1" and m.quantization.calibration is not None
    assert m.graph_after is not None and m.graph_after.nodes[0].op == "placeholder"
    assert m.capture is not None and m.capture.attempts[0].ok is True
    assert m.verification[0].tolerances and m.verification[0].tolerances["precision"] == "int8"
    box = Manifest.read(REAL_MANIFESTS[1]).sandbox
    assert box is not None and box.network_isolated is True and box.memory_limit_mb == 8192


def test_a_section_assigned_and_patched_as_a_dict_is_written_as_the_dict_was() -> None:
    """What the engine does today: assign the section as the dict it built, then patch it in place
    (the first scheme's report is the section itself and its `schemes` entry: one record, patched once)."""
    report = {"precision": "int8", "runtime": "onnxruntime", "layers": [{"node": "fc", "sqnr_db": 30.5}],
              "fallback_layers": [], "fallback": {"steps": [], "fp32_macs_share": 0}}
    m = Manifest()
    m.quantization = {**report, "calibration": {"source": "random", "samples": 16},  # type: ignore[assignment]
                      "schemes": {"onnxruntime": report}}
    assert m.quantization is not None and m.quantization.layers[0].sqnr_db == 30.5
    m.quantization["fallback"]["latency"] = {"ms_all_int8": 1.0, "ms_with_fallback": 1.25}
    m.quantization.setdefault("artifact_notes", {})["torchscript"] = "int8 kernels"
    m.quantization["schemes"]["onnxruntime"]["onnx"] = {"onnxruntime": {"int8_kernels": {}}}
    written = m.to_dict()["quantization"]
    assert written["fallback"]["latency"] == {"ms_all_int8": 1.0, "ms_with_fallback": 1.25}
    assert written["schemes"]["onnxruntime"]["fallback"]["latency"] == written["fallback"]["latency"]
    assert written["artifact_notes"] == {"torchscript": "int8 kernels"}
    assert written["fallback"]["fp32_macs_share"] == 0 and isinstance(written["fallback"]["fp32_macs_share"], int)
    assert list(written) == ["precision", "runtime", "layers", "fallback_layers", "fallback", "calibration",
                             "schemes", "artifact_notes"]  # the writer's order, new keys last

    m.tensorrt = {"preflight": {"ok": True}}  # type: ignore[assignment]
    m.tensorrt = {**(m.tensorrt or {}), "engine": {"layers": 3}}  # type: ignore[assignment]
    assert m.tensorrt == {"preflight": {"ok": True}, "engine": {"layers": 3}}


def test_a_benchmark_section_merges_with_a_later_stages_rows() -> None:
    from fxport.benchmark import merge

    cpu = Manifest.read(REAL_MANIFESTS[0])
    assert cpu.benchmark is not None
    gpu_rows = {"results": [{**cpu.benchmark.as_dict()["results"][0], "artifact": "tensorrt", "runtime": "tensorrt"}],
                "machine": {"gpu": "NVIDIA H100"}, "seconds": 1.5}
    # the engine's GPU stage passes the section as it reads it (the dict it was) to merge()
    cpu.benchmark = merge(cpu.benchmark, gpu_rows)  # type: ignore[arg-type, assignment]
    assert cpu.benchmark is not None and cpu.benchmark.results[-1].artifact == "tensorrt"
    assert cpu.benchmark.machine is not None and cpu.benchmark.machine.gpu == "NVIDIA H100"


def test_numbers_keep_their_json_type() -> None:
    import numpy as np

    m = Manifest(benchmark={"results": [{"artifact": "onnx", "batch": 1, "p50_ms": 2, "p95_ms": np.float32(2.5),
                                         "verified": np.bool_(True)}]})
    row = m.to_dict()["benchmark"]["results"][0]
    assert row == {"artifact": "onnx", "batch": 1, "p50_ms": 2, "p95_ms": 2.5, "verified": True}
    assert isinstance(row["p50_ms"], int) and isinstance(row["p95_ms"], float)


def test_reading_leniently_leaves_out_only_the_sections_of_the_wrong_shape() -> None:
    raw = json.loads(REAL_MANIFESTS[0].read_text())
    raw["passes"] = "not a list of records"
    raw["benchmark"]["results"][0]["batch"] = "many"
    manifest, unreadable = read_leniently(raw)
    assert set(unreadable) == {"passes", "benchmark"}
    assert "benchmark.results.0.batch" in unreadable["benchmark"]
    assert manifest.passes == [] and manifest.benchmark is None
    assert manifest.quantization is not None and manifest.artifacts  # everything else is read
