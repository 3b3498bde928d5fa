"""Does uploading artifacts during export/verify pay on this machine? (FXPORT_EARLY_UPLOAD)

The same full-stack ResNet-18 job (TorchScript + ONNX, verified; a model with its own weights
each run, so nothing is cached) through two worker configurations, one after the other on one
Redis and one SeaweedFS: artifacts uploaded while the engine works on (the default), and
uploaded after the job. Each stack run is paired with an in-process engine run just before it,
so the comparison is between ratios measured side by side.

    python bench/bench_early_upload.py [--repeats 4] [--no-write]

Writes the "early-upload" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._report import machine, write_section  # noqa: E402
from bench.bench_cache import engine_in_process, full_stack, save_variant, seaweed_write_cost  # noqa: E402

MODES = (("during export and verify (default)", "true"), ("after the job", "false"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=4, help="runs per mode, after one warm-up run each")
    ap.add_argument("--no-write", action="store_true", help="print, but do not touch docs/benchmarks.md")
    args = ap.parse_args()
    os.environ["FXPORT_SANDBOX_THREADS"] = "1"

    import torch

    torch.set_num_threads(1)
    from fxport.client import Client
    from tests.fixtures.servers import start_distributed, start_redis, start_seaweed

    results: dict[str, list[tuple[float, dict]]] = {}
    with tempfile.TemporaryDirectory(prefix="fxport-bench-early-") as tmp, contextlib.ExitStack() as running:
        work = Path(tmp)
        models = iter([save_variant("resnet18", work / f"r{i}.pt2", 200 + i, 8)
                       for i in range(len(MODES) * (args.repeats + 1))])
        redis = start_redis(work / "redis")
        running.callback(redis.stop)
        s3 = start_seaweed(work / "seaweed")
        running.callback(s3.stop)
        os.environ.update(s3.env())
        weed_ms_per_mib = seaweed_write_cost(s3, None, work)["ms_per_mib"]
        for label, flag in MODES:
            stack = start_distributed(work / f"stack-{flag}", redis, s3,
                                      env_overrides={"FXPORT_SANDBOX_THREADS": "1", "FXPORT_EARLY_UPLOAD": flag})
            try:
                runs = []
                with Client(stack.address) as client:
                    for i in range(args.repeats + 1):  # run 0 warms both paths: not counted
                        model = next(models)
                        t, _ = engine_in_process(model, work / f"in-{flag}-{i}")
                        s = full_stack(client, model, work / f"stack-{flag}-{i}")
                        print(f"  {flag} run {i}: in-process {t:.2f} s, full stack {s['total']:.2f} s", flush=True)
                        if i:
                            runs.append((t, s))
            finally:
                stack.stop()
            results[label] = runs

    rows = []
    for label, runs in results.items():
        ratio = statistics.median(s["total"] / t for t, s in runs)
        stage = {k: statistics.median(s["stages"].get(k, 0.0) for _, s in runs) for k in ("export", "verify", "upload")}
        rows.append(f"| {label} | {statistics.median(t for t, _ in runs):.2f} | "
                    f"{statistics.median(s['total'] for _, s in runs):.2f} | **{ratio:.2f}×** | "
                    f"{stage['export']:.2f} / {stage['verify']:.2f} / {stage['upload']:.2f} |")
    md = f"""## Early artifact upload on or off (`bench/bench_early_upload.py`)

Machine: {machine()}. ResNet-18-style model (46 MiB `.pt2`), TorchScript + ONNX, verified; one
torch (and onnxruntime) thread. {args.repeats} runs per mode after a warm-up, each full-stack run
paired with an in-process engine run just before it; the ratio is the median of the pairs.

| artifacts go up | in-process s | full stack s | full stack ÷ in-process | export / verify / upload stage s |
|---|---|---|---|---|
{chr(10).join(rows)}

Uploading after the job puts the artifacts' S3 writes on the critical path (SeaweedFS, on the
same two cores, spent {weed_ms_per_mib:.1f} ms of CPU per MiB written in this run: ~0.4 s per
45 MiB artifact); overlapped, they take the core the single-threaded engine
leaves free, at the price of that CPU beside the engine (each file is hashed, then sent with its
digest for the store to check, since the sandbox may still write to it).
"""
    print(md)
    if not args.no_write:
        write_section("early-upload", md)


if __name__ == "__main__":
    main()
