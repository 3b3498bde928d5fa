"""Issue 24 item 4: the engine's threads when another process takes a core.

A ResNet-18-style forward at batch 8, at 1 and 2 torch threads, with the machine's other core
idle and then busy (a Python busy loop in another process), in a fresh interpreter per setting:
libgomp reads GOMP_SPINCOUNT when it starts. Settings alternate round by round; the median of
the rounds is reported.

- libgomp's default: a thread that finds no work spins 300,000 times before it sleeps;
- GOMP_SPINCOUNT=10000, what the sandbox sets (workers/sandbox/launch.py SANDBOX_GOMP_SPINCOUNT).

    python bench/bench_threads.py [--rounds 3] [--no-write]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._report import machine, write_section  # noqa: E402

PROBE = r'''
import json, subprocess, sys, time
import torch
sys.path.insert(0, sys.argv[1])
from tests.models import get
case = get("resnet18")
model = case.build().eval()
x = case.example_inputs(8)

def per_forward(threads, n=8):
    torch.set_num_threads(threads)
    with torch.no_grad():
        model(*x)
        t = time.perf_counter()
        for _ in range(n):
            model(*x)
    return (time.perf_counter() - t) / n

out = {"idle_1": per_forward(1), "idle_2": per_forward(2)}
burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
try:
    time.sleep(0.5)
    out["busy_1"], out["busy_2"] = per_forward(1), per_forward(2)
finally:
    burner.kill()
    burner.wait()
print(json.dumps(out))
'''

SETTINGS = {"libgomp default (spin 300,000)": None, "GOMP_SPINCOUNT=10000 (the sandbox's)": "10000"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-write", action="store_true", help="print, but do not touch docs/benchmarks.md")
    args = ap.parse_args()
    results: dict[str, list[dict[str, float]]] = {name: [] for name in SETTINGS}
    for r in range(args.rounds):
        for name, spin in SETTINGS.items():
            env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
            if spin is not None:
                env["GOMP_SPINCOUNT"] = spin
            proc = subprocess.run([sys.executable, "-c", PROBE, str(REPO)], env=env, capture_output=True, text=True,
                                  check=True, timeout=600)
            results[name].append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(f"  round {r + 1}/{args.rounds} {name}: {results[name][-1]}", file=sys.stderr, flush=True)

    def med(name: str, key: str) -> float:
        return statistics.median(run[key] for run in results[name]) * 1000

    rows = "\n".join(
        f"| {name} | {med(name, 'idle_1'):.0f} | {med(name, 'idle_2'):.0f} | {med(name, 'busy_1'):.0f} | "
        f"{med(name, 'busy_2'):.0f} | {med(name, 'busy_2') / med(name, 'busy_1'):.2f}× |"
        for name in SETTINGS)
    load = os.getloadavg()[0]
    md = f"""## Threads when another process takes a core (issue 24 item 4, `bench/bench_threads.py`)

Machine: {machine()}. 1-minute load average {load:.2f} at the end.

A ResNet-18-style forward at batch 8 (ms per forward, median of {args.rounds} alternated rounds), at 1 and
2 torch threads, with the other core idle, then busy with a Python loop in another process. Each
setting runs in a fresh interpreter (libgomp reads its settings when it starts).

| libgomp setting | idle, 1 thread | idle, 2 threads | busy, 1 thread | busy, 2 threads | busy: 2 ÷ 1 |
|---|---|---|---|---|---|
{rows}

With the default, torch's second thread spins for the busy core while the first waits for it, and
2 threads run slower than 1 as soon as anything else runs. A short spin makes a waiting thread
sleep almost at once, so 2 threads cost little more than 1 under contention, and nothing when the
core is free. The sandbox therefore sets `GOMP_SPINCOUNT=10000` for every child (an operator's own
value is kept), and a worker running several jobs at once gives each its share of the CPUs
(`FXPORT_WORKER_CONCURRENCY`), so fxport's own jobs do not take each other's cores.
"""
    print(md)
    if not args.no_write:
        write_section("threads", md)


if __name__ == "__main__":
    main()
