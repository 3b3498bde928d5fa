"""Engine benchmark (issue 2): ResNet-18-style model — time per stage, and inference latency of
eager vs fused eager (fuse_conv_bn applied) vs ONNX Runtime, measured side by side in one run;
and (issue 24) one verified conversion by fxport — the `fxport convert` CLI cold, and a warm
worker — vs a bare hand-written export script, alternated round robin (bench/_speed.py).

    python bench/bench_engine.py            # writes the "engine" and "engine-speed" sections of docs/benchmarks.md
    python bench/bench_engine.py --speed-only --rounds 3 [--no-write]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._report import machine, write_section  # noqa: E402
from bench._speed import speed_section  # noqa: E402
from fxport.spec import parse_spec  # noqa: E402
from fxport.workers.engine.pipeline import convert  # noqa: E402
from tests.models import get  # noqa: E402
from tests.workers.engine.conftest import save_pt2, spec_dict  # noqa: E402


def latency_ms(fns: dict, args, runs: int = 30) -> dict[str, float]:
    """Median ms per runtime, measured round-robin so a load change hits every runtime alike."""
    for fn in fns.values():
        for _ in range(3):
            fn(*args)
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(runs):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn(*args)
            samples[name].append((time.perf_counter() - t) * 1000)
    return {k: statistics.median(v) for k, v in samples.items()}


def engine_section() -> str:
    case = get("resnet18")
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        model_path = save_pt2(case, d / "resnet18.pt2")
        spec = parse_spec(spec_dict(case, batch=(1, 2, 8), passes=["fuse_conv_bn", "remove_dropout",
                                                                   "dead_code_elimination", "profile_nodes"]))
        t0 = time.perf_counter()
        manifest = convert(model_path, spec, d / "out")
        total = time.perf_counter() - t0

        eager = case.build()
        fused = torch.export.load(str(d / "out" / "model.pt2")).module()
        import onnxruntime as ort

        sess = ort.InferenceSession(str(d / "out" / "model.onnx"), providers=["CPUExecutionProvider"])
        name = sess.get_inputs()[0].name
        x = case.example_inputs(1)
        with torch.no_grad():
            ms = latency_ms({"eager": eager, "fused": fused, "ort": lambda a: sess.run(None, {name: a.numpy()})}, x)
        eager_ms, fused_ms, ort_ms = ms["eager"], ms["fused"], ms["ort"]
        load = os.getloadavg()[0]

    stages = manifest["timings_s"]
    fuse = next(p for p in manifest["passes"] if p["name"] == "fuse_conv_bn")
    lines = [
        "## Engine (issue 2): ResNet-18-style, TorchScript + ONNX + .pt2 + FX source, verified",
        "",
        f"Machine: {machine()}. torch {torch.__version__}, onnxruntime {ort.__version__}. "
        "Input .pt2 with a dynamic batch (1..8); verification at batch 1, 2 (x4 samples) and 8.",
        "",
        "| stage | seconds |", "|---|---|",
        *[f"| {k} | {v:.2f} |" for k, v in stages.items()],
        f"| **total (in-process `convert`)** | **{total:.2f}** |",
        "",
        f"`fuse_conv_bn`: {fuse['notes']}",
        "",
        f"Inference latency at batch 1, median of 30 round-robin runs in one process, "
        f"{torch.get_num_threads()} torch threads, 1-minute load average {load:.2f} at the end "
        "(on this 2-core machine, other work on the second core slows 2-thread torch several-fold):",
        "",
        "| runtime | ms | ratio to eager |", "|---|---|---|",
        f"| eager (original) | {eager_ms:.1f} | 1.00 |",
        f"| eager, fused graph (.pt2 module) | {fused_ms:.1f} | {fused_ms / eager_ms:.2f} |",
        f"| ONNX Runtime (CPU EP) | {ort_ms:.1f} | {ort_ms / eager_ms:.2f} |",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the speed side-by-side (best of each is reported)")
    ap.add_argument("--speed-only", action="store_true", help="run only the speed side-by-side (issue 24)")
    ap.add_argument("--no-write", action="store_true", help="print, but do not touch docs/benchmarks.md")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    if not args.speed_only:
        md = engine_section()
        print(md)
        if not args.no_write:
            write_section("engine", md)
    md = speed_section(args.rounds, machine())
    print(md)
    if not args.no_write:
        write_section("engine-speed", md)


if __name__ == "__main__":
    main()
