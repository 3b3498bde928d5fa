"""Format detection by content, and clear rejections of everything else."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
import torch

from fxport.errors import UnsupportedModelFormat
from fxport.workers.engine.load import (
    ACCEPTED,
    ACCEPTED_TEXT,
    FORMAT_NAMES,
    FORMATS,
    detect_format,
    input_format,
    load_model,
)
from tests.models import get
from tests.workers.engine.conftest import save_package, save_pt2, save_torchscript


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("formats")
    case = get("cnn_bn")
    out = {
        # extensions deliberately wrong: detection must read the content
        "torch_export": save_pt2(case, d / "model.bin"),
        "torchscript": save_torchscript(case, d / "model.pt2"),
        "torch_package": save_package(case, d / "model.onnx"),
    }
    onnx_path = d / "model.pt"
    torch.onnx.export(case.build(), case.example_inputs(2), str(onnx_path), dynamo=False)
    out["onnx"] = onnx_path
    return out


@pytest.mark.parametrize("fmt", ["torch_export", "torchscript", "torch_package", "onnx"])
def test_detects_format_from_content_not_extension(files: dict[str, Path], fmt: str) -> None:
    assert detect_format(files[fmt]) == fmt


@pytest.mark.parametrize("fmt", ["torch_export", "torchscript", "torch_package"])
def test_loaded_module_computes_like_the_original(files: dict[str, Path], fmt: str) -> None:
    case = get("cnn_bn")
    loaded = load_model(files[fmt])
    args = case.example_inputs(3)
    with torch.no_grad():
        torch.testing.assert_close(loaded.module(*args), case.build()(*args), atol=1e-5, rtol=1e-4)


def test_truncated_archive_is_named_as_such(files: dict[str, Path], tmp_path: Path) -> None:
    data = files["torch_export"].read_bytes()
    cut = tmp_path / "cut.pt2"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(UnsupportedModelFormat, match="truncated or corrupt"):
        detect_format(cut)


def test_random_bytes_list_the_accepted_formats(tmp_path: Path) -> None:
    junk = tmp_path / "junk.pt2"
    junk.write_bytes(bytes(range(256)) * 64)
    with pytest.raises(UnsupportedModelFormat) as info:
        detect_format(junk)
    text = str(info.value)
    assert "torch.export" in text and "TorchScript" in text and "ONNX" in text and "torch.package" in text


def test_empty_file(tmp_path: Path) -> None:
    empty = tmp_path / "empty.pt2"
    empty.write_bytes(b"")
    with pytest.raises(UnsupportedModelFormat, match="empty"):
        detect_format(empty)


def test_state_dict_checkpoint_says_how_to_export(tmp_path: Path) -> None:
    path = tmp_path / "weights.pt"
    torch.save(get("cnn_bn").build().state_dict(), path)
    with pytest.raises(UnsupportedModelFormat, match="torch.export.save"):
        detect_format(path)


def test_unrelated_zip_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "docs.zip"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("readme.txt", "hello")
    with pytest.raises(UnsupportedModelFormat, match="zip archive but not one fxport reads"):
        detect_format(path)


def test_registry_is_the_one_source(files: dict[str, Path]) -> None:
    # names unique, every description in the rejection text, each entry has exactly one check
    assert len(set(FORMAT_NAMES)) == len(FORMATS)
    assert ACCEPTED == tuple(f.accepted for f in FORMATS)
    for fmt in FORMATS:
        assert fmt.accepted in ACCEPTED_TEXT
        assert (fmt.zip_entries is None) != (fmt.sniff is None), fmt.name
        assert input_format(fmt.name) is fmt
    # the tests build one file per registered format, and each round-trips detect -> load
    assert set(files) == set(FORMAT_NAMES)
    for name, path in files.items():
        assert detect_format(path) == name
        assert load_model(path).format == name
    with pytest.raises(KeyError):
        input_format("keras")
