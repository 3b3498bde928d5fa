"""Every corpus model through every applicable target, each artifact verified against eager.

Two input formats per model: a .pt2 (aten-level graph) and, where the model is fx-traceable,
a torch.package (torch-level graph) — so every pass runs at both IR levels.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fxport.digest import sha256_file
from fxport.spec import parse_spec
from fxport.workers.engine.pipeline import convert
from fxport.workers.engine.publish import WRITING_DIR
from tests.models import CORPUS
from tests.workers.engine.conftest import save_package, save_pt2, spec_dict

FAST = [n for n, c in CORPUS.items() if "slow" not in c.tags]


def _check_manifest(manifest: dict, out: Path, case_name: str, targets: tuple[str, ...] | None = None) -> None:
    case = CORPUS[case_name]
    targets = targets or case.targets
    assert manifest["status"] == "succeeded"
    on_disk = json.loads((out / "manifest.json").read_text())
    assert on_disk["artifacts"] == manifest["artifacts"]
    formats = {a["format"] for a in manifest["artifacts"]}
    assert formats == set(targets)
    for art in manifest["artifacts"]:
        assert sha256_file(out / art["path"])[0] == art["sha256"]
    verified = {v["format"]: v for v in manifest["verification"]}
    assert set(verified) == set(targets)
    for fmt, v in verified.items():
        assert v["passed"], f"{case_name}/{fmt}: {v}"
        # one metrics entry per model output (multi_io returns two)
        assert len(v["outputs"]) == (2 if case_name == "multi_io" else len(v["outputs"])) >= 1
        assert max(o["max_abs_diff"] for o in v["outputs"]) == v["max_abs_diff"]
        # batch min (1), opt (2) and max (4) were all run
        first_dims = [s[0] if isinstance(s[0], int) else s[0][0] for s in v["shapes_checked"]]
        if case.dynamic_batch:
            assert {1, 2, 4} <= set(first_dims), v["shapes_checked"]
    if case.has_batchnorm:
        after = manifest["graph_after"]["op_counts"]
        assert not [op for op in after if "batch_norm" in op.lower() or "BatchNorm" in op], after
    for stage in ("load", "capture", "passes", "export", "verify"):
        assert stage in manifest["timings_s"]


@pytest.mark.parametrize("name", FAST)
def test_pt2_through_every_target(name: str, tmp_path: Path) -> None:
    case = CORPUS[name]
    model = save_pt2(case, tmp_path / "model.pt2")
    # hf_bert, hf_gpt2, hf_vit: a trace fixes their dynamic dims, so their TorchScript is scripted
    manifest = convert(model, parse_spec(spec_dict(case)), tmp_path / "out")
    assert manifest["capture"]["level"] == "aten"
    _check_manifest(manifest, tmp_path / "out", name)


@pytest.mark.parametrize("name", [n for n in FAST if CORPUS[n].fx_traceable])
def test_package_captures_at_torch_level(name: str, tmp_path: Path) -> None:
    case = CORPUS[name]
    model = save_package(case, tmp_path / "model.pkg")
    manifest = convert(model, parse_spec(spec_dict(case)), tmp_path / "out")
    assert manifest["capture"]["method"] == "fx" and manifest["capture"]["level"] == "torch"
    _check_manifest(manifest, tmp_path / "out", name)


@pytest.mark.parametrize("name", [n for n in FAST if CORPUS[n].third_party])
def test_third_party_package_captures_by_export_with_torchscript(name: str, tmp_path: Path) -> None:
    case = CORPUS[name]
    model = save_package(case, tmp_path / "model.pkg")
    manifest = convert(model, parse_spec(spec_dict(case)), tmp_path / "out")
    assert [a["ok"] for a in manifest["capture"]["attempts"]][:1] == [False]  # symbolic_trace failed
    assert manifest["capture"]["level"] == "aten"
    _check_manifest(manifest, tmp_path / "out", name)


def test_control_flow_falls_through_to_export_naming_the_source_line(tmp_path: Path) -> None:
    case = CORPUS["control_flow"]
    model = save_package(case, tmp_path / "model.pkg")
    manifest = convert(model, parse_spec(spec_dict(case)), tmp_path / "out")
    attempts = manifest["capture"]["attempts"]
    assert attempts[0]["method"] == "fx" and not attempts[0]["ok"]
    assert "handwritten.py" in attempts[0]["source_line"]
    assert attempts[-1]["ok"] and manifest["capture"]["level"] == "aten"
    _check_manifest(manifest, tmp_path / "out", "control_flow")


@pytest.mark.slow
def test_resnet18_full_size(tmp_path: Path) -> None:
    case = CORPUS["resnet18"]
    model = save_pt2(case, tmp_path / "model.pt2")
    manifest = convert(model, parse_spec(spec_dict(case, batch=(1, 2, 4))), tmp_path / "out")
    _check_manifest(manifest, tmp_path / "out", "resnet18")
    fuse = next(p for p in manifest["passes"] if p["name"] == "fuse_conv_bn")
    assert fuse["changed"] and "20" in fuse["notes"]


def test_an_artifact_appears_under_its_name_only_once_it_is_whole(tmp_path: Path, monkeypatch) -> None:
    """The worker uploads artifacts while the engine still exports (workers/artifact_upload.py),
    so none may be visible under its name while its exporter is writing it."""
    from fxport.workers.engine.exporters.onnx import OnnxFromGraphModule
    from fxport.workers.engine.exporters.torchscript import TorchScriptFromGraphModule

    out = tmp_path / "out"
    seen: list[tuple[str, list[str]]] = []
    for exporter in (TorchScriptFromGraphModule, OnnxFromGraphModule):
        def spy(self, path: Path, _write=exporter.__call__) -> Path:
            written = _write(self, path)
            seen.append((path.name, sorted(p.name for p in out.iterdir())))  # what a scan of out/ finds now
            return written
        monkeypatch.setattr(exporter, "__call__", spy)
    case = CORPUS["cnn_bn"]
    manifest = convert(save_pt2(case, tmp_path / "model.pt2"),
                       parse_spec(spec_dict(case, targets=("torchscript", "onnx"))), out)
    assert [name for name, _ in seen] == ["model.ts", "model.onnx"]
    assert "model.ts" not in seen[0][1] and seen[1][1] == [WRITING_DIR, "model.ts"]  # the earlier one is in place
    assert not (out / WRITING_DIR).exists()  # nothing left over
    _check_manifest(manifest, out, "cnn_bn", ("torchscript", "onnx"))


def test_fx_source_runs_from_wherever_it_is_copied(tmp_path: Path) -> None:
    import importlib.util
    import shutil
    import sys

    import torch

    case = CORPUS["cnn_bn"]
    model = save_pt2(case, tmp_path / "model.pt2")
    convert(model, parse_spec(spec_dict(case, targets=("fx_source",))), tmp_path / "out")
    assert not (tmp_path / "out" / "fx_source" / "__pycache__").exists()
    moved = tmp_path / "elsewhere" / "fx_source"
    shutil.copytree(tmp_path / "out" / "fx_source", moved)
    shutil.rmtree(tmp_path / "out")  # the original location is gone, as on the user's machine
    source = (moved / "module.py").read_text()
    assert str(tmp_path / "out") not in source and WRITING_DIR not in source
    spec = importlib.util.spec_from_file_location("moved_fx_source", moved / "module.py")
    module = importlib.util.module_from_spec(spec)
    sys.dont_write_bytecode = True
    spec.loader.exec_module(module)
    args = case.example_inputs(3)
    with torch.no_grad():
        torch.testing.assert_close(module.FxportModule()(*args), case.build()(*args), atol=1e-4, rtol=1e-3)
