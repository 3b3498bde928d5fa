"""bench/bench_model_bytes.py: the model of a size holds the bytes asked, and one conversion of a small
one is measured the way the benchmark's table reads it (every stage timed, each target's export and
verify seconds, the peak RSS), with a slope of 1 for what grows in proportion."""

from __future__ import annotations

from pathlib import Path

import onnxruntime
import pytest
import torch

from bench._sizes import STAGES
from bench.bench_model_bytes import (
    LAYERS,
    PIECES,
    TARGETS,
    measure,
    save_model,
    slopes,
    weight_bytes,
    wide_stack,
    width_for,
)


@pytest.mark.parametrize("nbytes", [1e6, 8e6, 100e6])
def test_the_stack_holds_the_bytes_asked(nbytes: float) -> None:
    model = wide_stack(width_for(nbytes))
    assert sum(isinstance(m, torch.nn.Linear) for m in model) == LAYERS
    assert weight_bytes(model) == pytest.approx(nbytes, rel=0.005)


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)  # measure() sets one, as the benchmark's subprocess does


def test_one_conversion_is_measured_per_stage_and_target(tmp_path: Path, one_thread: None) -> None:
    saved = save_model(2e6, tmp_path / "stack.pt2")
    assert saved["weight_bytes"] == pytest.approx(2e6, rel=0.01)
    session, onnx_export = onnxruntime.InferenceSession, torch.onnx.export
    run = measure(tmp_path / "stack.pt2", tmp_path / "out", saved["width"], list(TARGETS), single_file=True)
    assert (onnxruntime.InferenceSession, torch.onnx.export) == (session, onnx_export)  # the timers are gone

    assert run["error"] is None
    assert run["verified"] == dict.fromkeys(TARGETS, True)
    assert set(STAGES) <= set(run["timings_s"])
    assert set(run["export_s"]) >= set(TARGETS) and set(run["verify_s"]) >= set(TARGETS)
    # the targets' seconds are parts of their stage's
    assert sum(run["export_s"].values()) <= run["timings_s"]["export"] * 1.05 + 0.01
    assert set(run["peak_by_stage"]) == set(STAGES)
    assert run["peak_rss"] >= max(run["peak_by_stage"].values()) >= run["rss_before"] > 0
    assert sum(run["artifact_bytes"].values()) > 3 * saved["weight_bytes"]  # each artifact holds the weights
    # every piece the ONNX target's figures are split into was called, where the engine calls it
    assert all(run["pieces_s"][piece] > 0 for piece in PIECES), run["pieces_s"]
    assert run["pieces_s"]["torch.onnx.export"] < run["export_s"]["onnx"]
    assert run["pieces_s"]["ort session"] < run["verify_s"]["onnx"]

    # the slopes of rows whose every figure doubles with the bytes are 1
    def scaled(k: int) -> dict:
        return {"weight_bytes": saved["weight_bytes"] * k, "run": {
            **run, **{key: dict.fromkeys(run[key], float(k)) for key in ("timings_s", "export_s", "verify_s",
                                                                         "pieces_s")},
            "total_s": k, "peak_rss": 2 * k, "rss_before": k}}

    values = dict(slopes([scaled(k) for k in (1, 2, 4)]))
    assert {*STAGES, *(f"export {t}" for t in TARGETS), "peak RSS"} <= set(values)
    assert values == pytest.approx(dict.fromkeys(values, 1.0))
