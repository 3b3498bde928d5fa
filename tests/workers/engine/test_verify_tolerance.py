"""Verification that neither magnitude nor constants fool: tolerances scale with the output, and an
output the model returns as a constant makes the verdict inconclusive instead of passed."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from fxport.spec import VerifyOptions, parse_spec
from fxport.workers.engine.pipeline import convert
from fxport.workers.engine.verify.comparator import SamplePoint, compare_outputs, verify_artifacts
from fxport.workers.engine.verify.runners import EagerRunner

FEATURES = 64


class Scaled(nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


def deep_mlp(seed: int) -> nn.Module:
    """16 ReLU layers of 512, then 1000 logits in the hundreds (max |logit| 200-450), centred on zero:
    onnxruntime and eager then differ by ~1e-6 of the largest logit, which is more than atol 1e-4
    on the logits near zero (measured: a fixed atol fails 1-3 of 4 inputs, depending on the weights)."""
    gen = torch.Generator().manual_seed(seed)
    layers: list[nn.Module] = []
    width = FEATURES
    for _ in range(16):
        linear = nn.Linear(width, 512)
        with torch.no_grad():
            linear.weight.copy_(torch.randn(linear.weight.shape, generator=gen) * (2.0 / width) ** 0.5)
            linear.bias.copy_(torch.randn(512, generator=gen) * 0.1)
        layers += [linear, nn.ReLU()]
        width = 512
    head = nn.Linear(512, 1000)
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=gen) / 512 ** 0.5)
        head.bias.zero_()
    return nn.Sequential(*layers, head, Scaled(100.0)).eval()


def save_pt2(model: nn.Module, path: Path, *example: torch.Tensor) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.export.save(torch.export.export(model, example), str(path))
    return path


def _inputs(k: int) -> torch.Tensor:
    return torch.randn(2, FEATURES, generator=torch.Generator().manual_seed(100 + k))


def test_outputs_in_the_hundreds_pass_with_the_default_tolerances(tmp_path: Path) -> None:
    import onnxruntime as ort

    fixed_atol_failures = 0
    for seed in range(3):
        model = deep_mlp(seed)
        out = tmp_path / f"out{seed}"
        spec = parse_spec({"inputs": [{"name": "input", "shape": [2, FEATURES]}], "targets": ["onnx"],
                           "passes": [], "verify": {"samples": 4}})
        manifest = convert(save_pt2(model, tmp_path / f"mlp{seed}.pt2", _inputs(0)), spec, out)
        [record] = manifest["verification"]
        assert record["passed"] and record["verdict"] == "passed", record
        [logits] = record["outputs"]
        assert logits["ref_max_abs"] > 150  # the magnitude this test is about
        # the tolerance in effect scales with it, and the manifest says so
        assert logits["atol_effective"] == pytest.approx(1e-5 * logits["ref_max_abs"])
        assert record["tolerances"]["scale_atol"] == 1e-5 and "max|model output|" in record["tolerances"]["rule"]

        # the same artifact under a fixed atol of 1e-4: the verdict would depend on the inputs drawn
        session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
        for k in range(4):
            x = _inputs(k)
            with torch.no_grad():
                want = model(x).numpy()
            got = session.run(None, {"input": x.numpy()})[0]
            fixed_atol_failures += not np.allclose(got, want, atol=1e-4, rtol=1e-3)
            assert compare_outputs([want], [got], VerifyOptions())["passed"]
    assert fixed_atol_failures >= 1  # else this model no longer shows what the scale-aware rule is for


def _logits(seed: int = 0) -> np.ndarray:
    with torch.no_grad():
        return deep_mlp(seed)(_inputs(0)).numpy()


def test_an_artifact_off_by_one_percent_still_fails() -> None:
    ref = _logits()
    assert compare_outputs([ref], [ref.copy()], VerifyOptions())["passed"]
    m = compare_outputs([ref], [ref * 1.01], VerifyOptions())
    assert not m["passed"] and "output_0" in m["mismatch"] and "elements beyond" in m["mismatch"]
    # one logit off by 1% of the largest: within the cosine, beyond the tolerance
    one_off = ref.copy()
    one_off[0, 7] += 0.01 * np.abs(ref).max()
    m = compare_outputs([ref], [one_off], VerifyOptions())
    assert not m["passed"] and m["cosine"] > 0.999 and "1 of 2000 elements" in m["mismatch"]


def test_scale_atol_zero_makes_atol_a_fixed_bound() -> None:
    ref = _logits()
    got = ref.copy()
    got[np.abs(ref) < 1.0] += 5e-4  # last-bit noise at the magnitude of the output, on the small logits
    assert compare_outputs([ref], [got], VerifyOptions())["passed"]
    assert not compare_outputs([ref], [got], VerifyOptions(scale_atol=0.0))["passed"]


class Zeros(nn.Module):
    """Zero weights: every output is 0 whatever the input (an untrained or wrongly loaded model)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)
        nn.init.zeros_(self.fc.weight)
        nn.init.zeros_(self.fc.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class Constant(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(x[:, :3]) + 3.0


@pytest.mark.parametrize("model, outputs, reference", [
    (Zeros(), ["logits"], "all zeros"),
    (Constant(), None, "the constant 3"),
])
def test_a_constant_output_gives_an_inconclusive_verdict(model: nn.Module, outputs: list[str] | None,
                                                         reference: str, tmp_path: Path) -> None:
    name = outputs[0] if outputs else "output_0"
    spec = {"inputs": [{"name": "x", "shape": [2, 8]}], "targets": ["torchscript", "onnx"], "passes": []}
    if outputs:
        spec["outputs"] = outputs
    manifest = convert(save_pt2(model, tmp_path / "m.pt2", torch.randn(2, 8)), parse_spec(spec), tmp_path / "out")
    assert manifest["status"] == "succeeded"  # not a failure: nothing mismatched
    for record in manifest["verification"]:
        assert record["verdict"] == "inconclusive" and record["passed"], record
        assert record["inconclusive"] == [{"output": name, "reference": reference}]
        assert record["outputs"][0]["verdict"] == "inconclusive"
    [warning] = [w for w in manifest["warnings"] if "inconclusive" in w]
    assert f"output {name!r} is {reference}" in warning and "torchscript, onnx" in warning
    assert "trained weights" in warning and "inputs" in warning


class HalfDead(nn.Module):
    """Two heads, the second dead (zero weights): only the first is verified."""

    def __init__(self) -> None:
        super().__init__()
        self.live, self.dead = nn.Linear(8, 4), Zeros()

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"live": self.live(x), "dead": self.dead(x)}


def test_only_the_constant_output_is_named() -> None:
    model = HalfDead().eval()
    points = [SamplePoint({}, (torch.randn(2, 8, generator=torch.Generator().manual_seed(k)),)) for k in range(3)]
    [record] = verify_artifacts(EagerRunner(model), [EagerRunner(model)], points, VerifyOptions())
    assert record["verdict"] == "inconclusive"
    assert record["inconclusive"] == [{"output": "output_1 ['dead']", "reference": "all zeros"}]
    assert [o["verdict"] for o in record["outputs"]] == ["passed", "inconclusive"]
    # a varying output passes as before
    [record] = verify_artifacts(EagerRunner(model.live), [EagerRunner(model.live)], points, VerifyOptions())
    assert record["verdict"] == "passed" and "inconclusive" not in record
