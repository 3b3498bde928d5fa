"""What Python's cyclic garbage collector costs a conversion, and whether a policy of fxport's own
would win it back (issue 44 item 7: costs that grow with the model).

The N x (Conv2d → BatchNorm2d → ReLU) programs of bench_graph_size.py, converted to TorchScript and
ONNX (verified), one fresh subprocess per (size, policy), the policies alternated per size:

- `as is`: the collector as CPython runs it (what fxport does);
- `off`: no collection during the conversion (the size benchmarks time stages this way);
- `seams`: off, with one full collection at the end of each stage, so what a stage leaves in
  reference cycles is freed before the next (what a production "off" would need to bound memory);
- `frozen`: the collector as is, with everything alive after the load stage moved out of its scans
  (gc.freeze), so later full collections skip the loaded program.

Each reports the conversion's CPU seconds (process time: it holds on a shared machine where wall time
does not), the CPU seconds inside the collector (gc.callbacks), the full collections, and peak RSS.

    python bench/bench_gc.py            # writes the "gc" section of docs/benchmarks.md
    python bench/bench_gc.py --quick    # one size, prints only
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))

from bench._sizes import run_child  # noqa: E402

POLICIES = ("as is", "off", "seams", "frozen")
BLOCKS = (222, 666, 1333)


def measure(policy: str, blocks: int) -> dict[str, Any]:
    import torch

    from bench.bench_graph_size import save_model
    from fxport.spec import parse_spec
    from fxport.workers.engine.pipeline import convert
    from fxport.workers.engine.warm_caches import cache_pt2_type_hints

    torch.set_num_threads(1)
    cache_pt2_type_hints()
    work = Path(tempfile.mkdtemp())
    save_model(blocks, work / "model.pt2")
    spec = parse_spec({"inputs": [{"name": "input", "shape": ["batch", 8, 8, 8], "dtype": "float32"}],
                       "dynamic_dims": {"batch": {"min": 1, "opt": 2, "max": 8}},
                       "targets": ["torchscript", "onnx"], "verify": {"samples": 2}})
    inside, full, started = [0.0], [0], [0.0]

    def collector(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[0] = time.process_time()
            return
        inside[0] += time.process_time() - started[0]
        full[0] += info["generation"] == 2

    def on_progress(event: dict[str, Any]) -> None:  # a stage's end: "done" at progress 1
        if event.get("progress") != 1.0:
            return
        if policy == "seams":
            gc.collect()
        elif policy == "frozen" and event.get("stage") == "load":
            gc.freeze()

    gc.collect()
    gc.callbacks.append(collector)
    if policy in ("off", "seams"):
        gc.disable()
    cpu = time.process_time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        manifest = convert(work / "model.pt2", spec, work / "out", on_progress=on_progress)
    cpu = time.process_time() - cpu
    return {"cpu_s": cpu, "gc_s": inside[0], "full": full[0], "nodes": manifest["graph_before"]["node_count"],
            "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "passed": all(v["passed"] for v in manifest["verification"])}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help=f"{BLOCKS[0]} blocks only; do not write the section")
    parser.add_argument("--measure", nargs=2, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.measure:
        print(json.dumps(measure(opts.measure[0], int(opts.measure[1]))))
        return
    from bench._report import machine, write_section

    rows = []
    for blocks in BLOCKS[:1] if opts.quick else BLOCKS:
        results = {p: run_child(Path(__file__).resolve(), ["--measure", p, str(blocks)], f"{p}, {blocks} blocks")
                   for p in POLICIES}
        rows.append((blocks, results))
        print(blocks, json.dumps(results), flush=True)
    lines = ["## The garbage collector during a conversion", "",
             f"Machine: {machine()}; torch 1 thread; `python bench/bench_gc.py`. N x (Conv2d → BatchNorm2d → ReLU) "
             "as .pt2, converted to TorchScript and ONNX (verified), one fresh process per cell. CPU seconds "
             "(process time), as the machine was shared; in the collector: CPU seconds inside collections "
             "(gc.callbacks).", "",
             "| blocks | nodes | policy | conversion CPU s | in the collector s | full collections | peak RSS MiB |",
             "|---|---|---|---|---|---|---|"]
    for blocks, results in rows:
        for policy, r in results.items():
            assert r["passed"], f"{policy} at {blocks} blocks did not verify"
            lines.append(f"| {blocks} | {r['nodes']} | {policy} | {r['cpu_s']:.2f} | {r['gc_s']:.2f} | {r['full']} "
                         f"| {r['rss_mib']:.0f} |")
    text = "\n".join(lines)
    print(text)
    if not opts.quick:
        write_section("gc", text)


if __name__ == "__main__":
    main()
