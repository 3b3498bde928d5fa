"""The capture ladder: forced rungs, recorded failures, shape errors that name the input."""

from __future__ import annotations

from pathlib import Path

import pytest

from fxport.errors import CaptureFailed, InvalidInput
from fxport.spec import parse_spec
from fxport.workers.engine.pipeline import convert
from tests.models import CORPUS
from tests.workers.engine.conftest import save_package, spec_dict


def test_forced_fx_on_untraceable_model_fails_with_the_users_line(tmp_path: Path) -> None:
    case = CORPUS["control_flow"]
    model = save_package(case, tmp_path / "m.pkg")
    with pytest.raises(CaptureFailed) as info:
        convert(model, parse_spec(spec_dict(case, capture="fx")), tmp_path / "out")
    assert info.value.stage == "capture"
    assert "handwritten.py" in str(info.value)
    assert (tmp_path / "out" / "manifest.json").exists()


def test_forced_export_skips_fx(tmp_path: Path) -> None:
    case = CORPUS["cnn_bn"]
    model = save_package(case, tmp_path / "m.pkg")
    manifest = convert(model, parse_spec(spec_dict(case, capture="export", targets=("onnx",))), tmp_path / "out")
    assert [a["method"] for a in manifest["capture"]["attempts"]] == ["export"]
    assert manifest["capture"]["level"] == "aten"


def test_shape_that_contradicts_the_model_names_the_input(tmp_path: Path) -> None:
    case = CORPUS["cnn_bn"]
    model = save_package(case, tmp_path / "m.pkg")
    spec = spec_dict(case)
    spec["inputs"][0]["shape"] = ["batch", 5, 32, 32]  # the first conv wants 3 channels
    with pytest.raises(InvalidInput) as info:
        convert(model, parse_spec(spec), tmp_path / "out")
    text = str(info.value)
    assert info.value.exit_code == 2
    assert "x[2, 5, 32, 32]" in text or "[2, 5, 32, 32]" in text
    assert "spec.inputs" in text
