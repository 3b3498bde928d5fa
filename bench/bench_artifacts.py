"""Which artifact to deploy (issue 19): the benchmark stage on the ResNet-18-style model, and what it costs.

The ResNet-18-style corpus model (224×224, random weights) converted to TorchScript, ONNX and
`.pt2` with a dynamic batch 1..32 (opt 8), in the warm sandbox as a worker runs it, with the
benchmark at its defaults (10 warm-up and up to 50 timed runs per artifact and batch, batches
min/opt/max, 120 s at most). Side by side, alternated: the same conversion without the
benchmark, so the stage's cost is the difference of the two, round by round.

    python bench/bench_artifacts.py [--rounds N]   # writes the "artifact-benchmark" section of docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._report import machine, write_section  # noqa: E402

TARGETS = ["torchscript", "onnx", "exported_program"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("FXPORT_SANDBOX_MODE", "warm")

    from fxport.benchmark import rate, table
    from fxport.spec import parse_spec
    from fxport.workers.engine.request import EngineRequest
    from fxport.workers.sandbox import run_engine_job
    from tests.models import get
    from tests.workers.engine.conftest import save_pt2

    base = {"inputs": [{"name": "x", "shape": ["batch", 3, 224, 224]}],
            "dynamic_dims": {"batch": {"min": 1, "opt": 8, "max": 32}}, "targets": TARGETS}
    plain, benched = parse_spec(base), parse_spec({**base, "benchmark": True})
    walls: dict[str, list[float]] = {"without": [], "with": []}
    stage_s: list[float] = []
    manifest: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        model = save_pt2(get("resnet18"), d / "resnet18.pt2")
        run_engine_job(EngineRequest(model_path=model, spec=plain, out_dir=d / "warm-up",
                                     job_id="warm-up"))  # starts the zygote: not counted
        for i in range(args.rounds):
            for label, spec in (("without", plain), ("with", benched)):
                t = time.perf_counter()
                m = run_engine_job(EngineRequest(model_path=model, spec=spec, out_dir=d / f"{label}-{i}",
                                                 job_id=f"{label}-{i}", timeout_s=1800)).to_dict()
                walls[label].append(time.perf_counter() - t)
                print(f"round {i}: {label} benchmark {walls[label][-1]:.1f} s", flush=True)
                if label == "with":
                    manifest = m
                    stage_s.append(m["timings_s"]["benchmark"])
    bench = manifest["benchmark"]
    med = statistics.median
    added = [w - wo for w, wo in zip(walls["with"], walls["without"])]
    rows = [f"| {r['artifact']} | {r['runtime']} | {r['batch']} | {r['p50_ms']:.2f} | {r['p95_ms']:.2f} | "
            f"{rate(r['throughput_per_s'])} | {r['speedup_vs_eager']:.2f}× | {r['peak_rss_mib']:.0f} MiB | "
            f"{r['runs']} |"
            for r in table(bench)]
    pick = bench["recommendation"]
    skipped = [f"- skipped: {s['artifact']} at batch {s['batch']}: {s['reason']}" for s in bench["skipped"]]
    isa = ", ".join(bench["machine"]["isa"]) or "none listed"
    lines = [
        "## Which artifact to deploy: the benchmark stage (issue 19)", "",
        f"Machine: {machine()} (ISA: {isa}). The ResNet-18-style corpus model (224×224, random weights), "
        f"TorchScript + ONNX + `.pt2`, dynamic batch 1..32 (opt 8), converted in the warm sandbox as a worker "
        f"runs it, with `benchmark: true` (the defaults: batches min/opt/max, 10 warm-up and up to 50 timed runs "
        f"per artifact and batch, {bench['settings']['threads']} threads, at most 120 s). From the last of "
        f"{args.rounds} rounds:", "",
        "| artifact | runtime | batch | p50 ms | p95 ms | throughput | × eager | peak RSS | runs |",
        "|---|---|---|---|---|---|---|---|---|", *rows, "",
        *(skipped + [""] if skipped else []),
        f"**Recommended: {pick['artifact']} at batch {pick['batch']}** — {pick['reason']}." if pick else
        "No recommendation: no verified artifact was measured.", "",
        f"What the stage costs: the conversion took {med(walls['without']):.1f} s without the benchmark and "
        f"{med(walls['with']):.1f} s with it (medians of {args.rounds} alternated rounds); the stage itself ran "
        f"{med(stage_s):.1f} s, so it added **{med(added):.1f} s** at the defaults. Most of it is the largest "
        "batch: `max_seconds` (120 s) bounds it on a slow machine, and `benchmark.batches` / `runs` trim it. "
        "Peak RSS is the sandbox process's high-water mark while that runtime ran that batch (torch and the "
        "original model included, the same for every row).",
    ]
    write_section("artifact-benchmark", "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
