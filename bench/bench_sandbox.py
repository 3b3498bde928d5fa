"""Sandbox overhead per job (issue 4): warm zygote fork vs cold interpreter start, side by side.

Each mode converts the same tiny model (ONNX target, verified) several times; the in-process
engine call is the baseline the overhead is measured against.

    python bench/bench_sandbox.py      # writes the "sandbox" section of docs/benchmarks.md
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._report import machine, write_section  # noqa: E402
from fxport.spec import parse_spec  # noqa: E402
from tests.models import get  # noqa: E402
from tests.workers.engine.conftest import save_pt2, spec_dict  # noqa: E402

RUNS = 7


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    from fxport.workers import sandbox
    from fxport.workers.engine.pipeline import convert

    case = get("tiny_linear")
    spec = parse_spec(spec_dict(case, targets=("onnx",)))
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        model = save_pt2(case, d / "tiny.pt2")
        convert(model, spec, d / "warmup")  # the in-process baseline pays its imports once, up front
        results: dict[str, list[float]] = {"in-process engine (no sandbox)": [], "warm sandbox (fork)": [],
                                           "cold sandbox (new interpreter)": []}
        os.environ["FXPORT_SANDBOX_MODE"] = "warm"
        sandbox.run_engine_job(model, spec, d / "w0", job_id="warmup")  # starts the zygote once
        for i in range(RUNS):  # interleaved, so load on the machine hits every mode alike
            results["in-process engine (no sandbox)"].append(timed(lambda: convert(model, spec, d / f"e{i}")))
            os.environ["FXPORT_SANDBOX_MODE"] = "warm"
            results["warm sandbox (fork)"].append(
                timed(lambda: sandbox.run_engine_job(model, spec, d / f"w{i}", job_id=f"w{i}")))
            os.environ["FXPORT_SANDBOX_MODE"] = "cold"
            results["cold sandbox (new interpreter)"].append(
                timed(lambda: sandbox.run_engine_job(model, spec, d / f"c{i}", job_id=f"c{i}")))
    med = {k: statistics.median(v) for k, v in results.items()}
    base = med["in-process engine (no sandbox)"]
    warm_over = med["warm sandbox (fork)"] - base
    cold_over = med["cold sandbox (new interpreter)"] - base
    lines = [
        "## Sandbox overhead per job (issue 4)",
        "",
        f"Machine: {machine()}. Tiny model (Linear 8→4), ONNX target + verification, "
        f"median of {RUNS} interleaved runs per mode.",
        "",
        "| mode | seconds per job | overhead vs in-process |", "|---|---|---|",
        *[f"| {k} | {v:.3f} | {v - base:+.3f} s |" for k, v in med.items()],
        "",
        f"Warm fork overhead is **{warm_over:.3f} s** per job against **{cold_over:.3f} s** for a cold start: "
        f"the cold sandbox costs **{cold_over / max(warm_over, 1e-3):.1f}×** the warm one's overhead "
        "(an interpreter start plus `import torch, onnx, onnxruntime` per job).",
    ]
    write_section("sandbox", "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
