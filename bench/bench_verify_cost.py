"""Where verification's time goes, and what batching its samples would save (issue 44 item 7).

1. One verified conversion of the ResNet-18-style model (224x224, batch 1/2/8, all four targets,
   the default 4 samples): each stage from the manifest's `timings_s`, and inside verification the
   seconds each runner spends loading its artifact and running it, timed by wrapping the runner
   classes in this process. The original model's outputs are computed once per input and shared
   by the export stage's own checks and every artifact (`ReferenceOutputs`): its row counts each
   input once, the export stage's trace check (at the dynamic-shape extremes) included.
2. Batching: the verify stage runs its `samples` inputs one call each at the opt shape. For each
   model of the corpus, 4 calls at batch 2 against one call at batch 8 (the same rows), eager torch,
   round robin, medians: what one batched call would save where the runtime allows it.

    python bench/bench_verify_cost.py            # writes the "verify_cost" section of docs/benchmarks.md
    python bench/bench_verify_cost.py --no-write
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._report import machine, write_section  # noqa: E402
from fxport.spec import parse_spec  # noqa: E402
from fxport.workers.engine.pipeline import convert  # noqa: E402
from fxport.workers.engine.verify import runners  # noqa: E402
from tests.models import ALL_TARGETS, get  # noqa: E402
from tests.workers.engine.conftest import save_pt2, spec_dict  # noqa: E402

BATCHING_MODELS = ("cnn_bn", "hf_bert", "hf_gpt2", "hf_vit", "hf_mobilenet_v2", "resnet18")
RUNNER_CLASSES = (runners.EagerRunner,  # the original model, each input once (ReferenceOutputs keeps them)
                  runners.TorchScriptRunner, runners.ExportedProgramRunner,
                  runners.FxSourceRunner, runners.OnnxRuntimeRunner)


def timed_runners() -> dict[tuple[str, str], list[float]]:
    """Wrap each runner class's activate and infer; returns where their seconds accumulate."""
    spent: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0])
    for cls in RUNNER_CLASSES:
        for method in ("activate", "infer"):
            if method not in cls.__dict__:
                continue

            def wrapped(self: Any, *args: Any, _orig: Any = cls.__dict__[method], _m: str = method) -> Any:
                start = time.perf_counter()
                try:
                    return _orig(self, *args)
                finally:
                    entry = spent[(self.name, _m)]
                    entry[0] += 1
                    entry[1] += time.perf_counter() - start

            setattr(cls, method, wrapped)
    return spent


def conversion_section() -> list[str]:
    case = get("resnet18")
    spent = timed_runners()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        model = save_pt2(case, d / "resnet18.pt2")
        raw = spec_dict(case, batch=(1, 2, 8), targets=ALL_TARGETS)
        raw["verify"]["samples"] = 4  # the spec's default (the test helper asks for 2)
        spec = parse_spec(raw)
        convert(model, spec, d / "warm")  # per-process caches filled, as on a warm worker
        spent.clear()
        manifest = convert(model, spec, d / "out")
    stages = manifest["timings_s"]
    shapes = len(manifest["verification"][0]["shapes_checked"])
    lines = [f"ResNet-18-style, 224x224, batch 1/2/8, targets {', '.join(ALL_TARGETS)}, "
             f"verify.samples {spec.verify.samples} (each artifact runs at {shapes} shapes), the second "
             "conversion in one process.", "",
             "| stage | s |", "|---|---|"]
    lines += [f"| {name} | {seconds:.2f} |" for name, seconds in stages.items()]
    lines += ["", "| runner | load s | runs | run s |", "|---|---|---|---|"]
    for name in dict.fromkeys(n for n, _ in spent):
        load = spent.get((name, "activate"), [0, 0.0])[1]
        calls, run = spent.get((name, "infer"), [0, 0.0])
        lines.append(f"| {name} | {load:.2f} | {calls} | {run:.2f} |")
    return lines


def batching_section(rounds: int) -> list[str]:
    lines = ["| model | 4 calls at batch 2, ms | 1 call at batch 8, ms | ratio |", "|---|---|---|---|"]
    for name in BATCHING_MODELS:
        case = get(name)
        model = case.build()
        four = [case.example_inputs(2) for _ in range(4)]
        eight = case.example_inputs(8)
        calls = {"four": lambda: [model(*x) for x in four], "one": lambda: model(*eight)}
        samples: dict[str, list[float]] = {k: [] for k in calls}
        with torch.no_grad():
            for fn in calls.values():
                fn()
            for _ in range(rounds):
                for key, fn in calls.items():
                    start = time.perf_counter()
                    fn()
                    samples[key].append((time.perf_counter() - start) * 1000)
        four_ms, one_ms = statistics.median(samples["four"]), statistics.median(samples["one"])
        lines.append(f"| {name} | {four_ms:.2f} | {one_ms:.2f} | {four_ms / one_ms:.2f}x |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--rounds", type=int, default=15)
    opts = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    lines = ["## Where verification's time goes (issue 44)", "",
             f"Machine: {machine()}; torch 1 thread; `python bench/bench_verify_cost.py`.", ""]
    lines += conversion_section()
    lines += ["", f"Batching the samples: eager torch, median of {opts.rounds} round-robin rounds.", ""]
    lines += batching_section(opts.rounds)
    text = "\n".join(lines)
    print(text)
    if not opts.no_write:
        write_section("verify_cost", text)


if __name__ == "__main__":
    main()
