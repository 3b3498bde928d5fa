"""The CLI's quantization summary (cli/result_table.py) from a manifest's "quantization" section."""

from __future__ import annotations

import io

from rich.console import Console

from fxport.cli.result_table import render_manifest

MANIFEST = {
    "artifacts": [], "verification": [], "warnings": ["int8 calibration used 64 seeded random samples, not real data"],
    "quantization": {
        "precision": "int8", "observer": "minmax", "target_cosine": 0.99,
        "calibration": {"source": "random", "samples": 64, "held_out": 16},
        "end_to_end": {"cosine": 0.9931, "top1_agreement": 0.94, "target_met": True},
        "layers": [{"node": f"layer{i}", "sqnr_db": 30.0 + i, "cosine": 0.999, "fallback": False} for i in range(14)]
        + [{"node": "layer1.0.conv2", "sqnr_db": 7.7, "cosine": 0.93, "fallback": True}],
        "fallback_layers": ["layer1.0.conv2"],
        "fallback": {"fp32_macs_share": 0.05, "latency": {"ms_all_int8": 1.5, "ms_with_fallback": 1.62}},
    },
}


def _render(manifest: dict) -> str:
    out = io.StringIO()
    render_manifest(manifest, Console(file=out, width=160, color_system=None))
    return out.getvalue()


def test_int8_summary_worst_layers_first_and_the_fallback() -> None:
    text = _render(MANIFEST)
    assert "int8 (minmax observer; calibration: random samples, 64 samples, 16 held out)" in text
    assert "end-to-end cosine 0.99310" in text and "target 0.99 met" in text
    assert "worst 10 of 15 layers" in text and text.index("layer1.0.conv2") < text.index("layer0")
    assert "layer13" not in text  # only the worst rows on a terminal
    assert "kept in fp32 to reach the target: layer1.0.conv2 — onnxruntime 1.50 → 1.62 ms" in text
    assert "warning: int8 calibration used 64 seeded random samples" in text


def test_fp16_summary() -> None:
    text = _render({"artifacts": [], "quantization": {"precision": "fp16", "kept_fp32": [
        {"node": "layer_norm", "op": "layer_norm.default"}, {"node": "softmax", "op": "softmax.int"}]}})
    assert "fp16: 2 ops kept in fp32 (layer_norm.default, softmax.int)" in text
