"""Calibration files: formats detected by content, validated against the input signature, split for hold-out."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from fxport.errors import InvalidInput
from fxport.spec import CalibrationSpec, DynamicDim, InputSpec
from fxport.workers.engine.calibration import load_calibration, read_tensor_file, validate_tensors
from fxport.workers.engine.inputs import InputSignature

IMAGE = InputSignature(inputs=[InputSpec(name="x", shape=["batch", 3, 8, 8])],
                       dynamic_dims={"batch": DynamicDim(min=1, opt=4, max=16)})
TOKENS = InputSignature(  # two inputs sharing a dynamic sequence dim, static batch
    inputs=[InputSpec(name="ids", shape=[1, "seq"], dtype="int64"),
            InputSpec(name="mask", shape=[1, "seq"], dtype="int64")],
    dynamic_dims={"seq": DynamicDim(min=4, opt=8, max=16)})


def _npz(path: Path, **arrays: np.ndarray) -> Path:
    with path.open("wb") as fh:  # a file object: np.savez would add ".npz" to a name
        np.savez(fh, **arrays)
    return path


def _images(n: int) -> np.ndarray:
    return np.random.default_rng(0).standard_normal((n, 3, 8, 8)).astype(np.float32)


def test_npz_batches_and_hold_out(tmp_path: Path) -> None:
    data = load_calibration(_npz(tmp_path / "c.bin", x=_images(20)), IMAGE, CalibrationSpec(samples=64), seed=0)
    assert data.info["source"] == "file" and data.info["layout"] == "batch"
    assert (data.info["samples"], data.info["held_out"]) == (15, 5)
    assert [b[0].shape[0] for b in data.calibration] == [4, 4, 4, 3]  # the batch dim's opt size
    held = torch.cat([b[0] for b in data.held_out])
    assert torch.equal(held, torch.from_numpy(_images(20)[15:]))  # the last quarter, never calibrated on
    assert not data.warnings


def test_safetensors_with_a_leading_samples_dim(tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    rng = np.random.default_rng(1)
    ids = rng.integers(0, 100, (6, 1, 8)).astype(np.int64)
    path = tmp_path / "calib"  # no extension: detected by content
    save_file({"ids": ids, "mask": np.ones_like(ids)}, str(path))
    data = load_calibration(path, TOKENS, CalibrationSpec(samples=3), seed=0)
    assert data.info["layout"] == "samples" and data.info["samples"] == 3 and data.info["held_out"] == 2
    assert data.info["unused"] == 1
    assert all(t.shape == (1, 8) and t.dtype == torch.int64 for b in data.calibration for t in b)


def test_random_samples_warn_loudly() -> None:
    data = load_calibration(None, IMAGE, CalibrationSpec(samples=8), seed=3)
    assert data.info["source"] == "random" and "random" in data.info["warning"]
    assert data.warnings == [data.info["warning"]] and "--calibration" in data.warnings[0]
    assert sum(b[0].shape[0] for b in data.calibration) == 8 and sum(b[0].shape[0] for b in data.held_out) >= 8
    again = load_calibration(None, IMAGE, CalibrationSpec(samples=8), seed=3)
    assert torch.equal(again.calibration[0][0], data.calibration[0][0])
    assert not torch.equal(data.calibration[0][0], data.held_out[0][0])


@pytest.mark.parametrize("arrays, sig, expected", [
    ({"x": _images(4), "y": _images(4)}, IMAGE, "'y', which is not an input of the model (its inputs: x)"),
    ({"image": _images(4)}, IMAGE, "'image', which is not an input"),
    ({"ids": np.zeros((4, 1, 8), np.int64)}, TOKENS, "no array for input 'mask' (it has: ids)"),
    ({"x": _images(4).astype(np.int64)}, IMAGE, "'x' has dtype int64; the model expects float32"),
    ({"ids": np.zeros((4, 1, 8), np.float32), "mask": np.zeros((4, 1, 8), np.int64)}, TOKENS,
     "'ids' has dtype float32; the model expects int64"),
    ({"x": np.zeros((4, 3, 8, 9), np.float32)}, IMAGE, "'x' dim 3 is 9; the model expects 8 there"),
    ({"x": np.zeros((4, 3, 8), np.float32)}, IMAGE, "shape [4, 3, 8] (rank 3)"),
    ({"ids": np.zeros((4, 1, 32), np.int64), "mask": np.zeros((4, 1, 32), np.int64)}, TOKENS,
     "dim 2 ('seq') is 32, outside the spec's range seq in [4, 16]"),
    ({"ids": np.zeros((4, 1, 8), np.int64), "mask": np.zeros((4, 1, 6), np.int64)}, TOKENS,
     "dim 'seq' is 8 in input 'ids' but 6 in input 'mask'"),
    ({"ids": np.zeros((4, 1, 8), np.int64), "mask": np.zeros((3, 1, 8), np.int64)}, TOKENS,
     "different numbers of samples: ids: 4, mask: 3"),
    ({"x": np.full((4, 3, 8, 8), np.nan, np.float32)}, IMAGE, "'x' contains NaN or Inf"),
])
def test_validation_errors_name_the_input_and_the_problem(tmp_path: Path, arrays: dict, sig: InputSignature,
                                                          expected: str) -> None:
    with pytest.raises(InvalidInput) as info:
        load_calibration(_npz(tmp_path / "c.npz", **arrays), sig, CalibrationSpec(), seed=0)
    assert info.value.stage == "quantize" and info.value.field == "calibration"
    assert expected in str(info.value), str(info.value)


def test_float64_is_cast_with_a_note() -> None:
    samples, layout, notes = validate_tensors({"x": torch.zeros(2, 3, 8, 8, dtype=torch.float64)}, IMAGE)
    assert samples[0][0].dtype == torch.float32 and layout == "batch"
    assert notes == ["calibration input 'x' was float64; cast to float32"]


def test_unreadable_and_too_small_files(tmp_path: Path) -> None:
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"not a tensor file at all")
    with pytest.raises(InvalidInput, match="neither .npz nor safetensors"):
        read_tensor_file(junk)
    pickled = _npz(tmp_path / "obj.npz", x=np.array([{"a": 1}], dtype=object))
    with pytest.raises(InvalidInput, match="not a plain numeric array"):
        read_tensor_file(pickled)
    with pytest.raises(InvalidInput, match="holds 1 sample; at least 2"):
        load_calibration(_npz(tmp_path / "one.npz", x=_images(1)), IMAGE, CalibrationSpec(), seed=0)
