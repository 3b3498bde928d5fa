"""A dynamic dim the spec names without a range (issue 42, item 7), through `fxport convert`.

A .pt2 carries its dims' ranges: naming its inputs with `--input` no longer forces restating
them (the program's range is taken, by position, and the manifest says so). A model that carries
none (TorchScript, torch.package, ONNX) is refused at load, naming the dim and the flag that
gives it a range: exit 2, as the spec error it replaces."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.servers import scaled

FXPORT = [sys.executable, "-m", "fxport.cli"]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    import torch

    class Pool(torch.nn.Module):
        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.relu(tokens).mean(1)

    base = tmp_path_factory.mktemp("dim-ranges")
    model = Pool().eval()
    example = (torch.randn(2, 8, 4),)
    batch, seq = torch.export.Dim("batch", min=1, max=16), torch.export.Dim("seq", min=2, max=96)
    torch.export.save(torch.export.export(model, example, dynamic_shapes=({0: batch, 1: seq},)), base / "m.pt2")
    torch.jit.save(torch.jit.trace(model, example), str(base / "m.ts"))
    torch.onnx.export(model, example, str(base / "m.onnx"), dynamo=False, input_names=["tokens"],
                      dynamic_axes={"tokens": {0: "batch", 1: "seq"}})
    return {"pt2": base / "m.pt2", "ts": base / "m.ts", "onnx": base / "m.onnx"}


def _convert(model: Path, out: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([*FXPORT, "convert", str(model), "--target", "onnx", "--input", "tokens:batch,seq,4",
                           "--dynamic-batch", "1:2:8", *flags, "--out", str(out)], capture_output=True, text=True,
                          timeout=scaled(600), cwd=out.parent)


def test_a_pt2_gives_a_named_dim_its_own_range(models, tmp_path):
    proc = _convert(models["pt2"], tmp_path / "out")
    assert proc.returncode == 0, proc.stderr[-3000:]
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["inputs"]["dynamic_dims"]["seq"] == {"min": 2, "opt": 8, "max": 96}  # the program's
    assert manifest["inputs"]["dynamic_dims"]["batch"]["max"] == 8  # the flag's, where one was given
    assert any("'seq' takes the exported program's range 2..96" in w for w in manifest["warnings"])


# An ONNX upload is copied as it is: only its benchmark (or a TensorRT engine) needs the ranges.
@pytest.mark.parametrize(("fmt", "extra"), [("ts", ()), ("onnx", ("--benchmark",))])
def test_a_model_without_ranges_is_refused_naming_the_dim(models, tmp_path, fmt, extra):
    proc = _convert(models[fmt], tmp_path / "out", *extra)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "names dynamic dim 'seq', which has no range" in proc.stderr
    assert "--dynamic-dim seq=1:8:64" in proc.stderr
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["error"]["field"] == "dynamic_dims"
    fixed = _convert(models[fmt], tmp_path / "fixed", *extra, "--dynamic-dim", "seq=2:8:32")
    assert fixed.returncode == 0, fixed.stderr[-3000:]
