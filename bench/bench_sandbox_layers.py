"""What a change to the sandbox's per-job layers costs a tiny job, against an earlier revision, side
by side (issue 40: a warm job's overhead must stay within 10 ms of what it was).

Rounds alternate: the sandbox as checked out, then the sandbox files of `--base` put in place (git
show), then back, each in a fresh process: a warm zygote, one warm-up job, then RUNS tiny jobs
(TorchScript target, verified) interleaved with the same conversion in-process. The checkout is
restored whatever happens.

    python bench/bench_sandbox_layers.py --base 9eb6fca   # writes the "sandbox-layers" section
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._report import machine, write_section  # noqa: E402

SANDBOX_FILES = [f"workers/sandbox/{name}.py" for name in
                 ("confine", "child", "zygote", "launch", "layers", "spare", "run")]

PROBE = r"""
import json, os, statistics, sys, tempfile
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from bench.bench_sandbox import start_zygote, timed
from fxport.spec import parse_spec
from fxport.workers.engine.pipeline import convert
from fxport.workers.engine.request import EngineRequest
from fxport.workers.sandbox import launch as sandbox, run_engine_job
from tests.models import get
from tests.workers.engine.conftest import save_pt2, spec_dict
case = get("tiny_linear")
spec = parse_spec(spec_dict(case, targets=("torchscript",)))
runs = int(sys.argv[2])
with tempfile.TemporaryDirectory() as tmp:
    d = Path(tmp)
    model = save_pt2(case, d / "tiny.pt2")
    convert(model, spec, d / "warmup")
    zygote = start_zygote()
    sandbox._warm = zygote
    os.environ["FXPORT_SANDBOX_MODE"] = "warm"
    run_engine_job(EngineRequest(model_path=model, spec=spec, out_dir=d / "w0", job_id="warmup"))
    inproc, warm, setup = [], [], []
    for i in range(runs):
        inproc.append(timed(lambda: convert(model, spec, d / f"e{i}")))
        done = []
        request = EngineRequest(model_path=model, spec=spec, out_dir=d / f"w{i}", job_id=f"w{i}")
        warm.append(timed(lambda: done.append(run_engine_job(request))))
        setup.append(done[0]["sandbox"]["setup_ms"])
    zygote.close()
print(json.dumps({"overhead_ms": (statistics.median(warm) - statistics.median(inproc)) * 1000,
                  "setup_ms": statistics.median(setup)}))
"""


def run_round(runs: int) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", PROBE, str(ROOT), str(runs)], capture_output=True, text=True,
                         check=True, timeout=600, cwd=ROOT).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", required=True, help="the revision whose sandbox files to compare against")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    current = {f: (ROOT / f).read_bytes() for f in SANDBOX_FILES}
    base = {f: subprocess.run(["git", "show", f"{args.base}:{f}"], capture_output=True, check=True, cwd=ROOT).stdout
            for f in SANDBOX_FILES}
    results: dict[str, list[dict[str, float]]] = {"this checkout": [], f"base {args.base}": []}
    try:
        for _ in range(args.rounds):
            results["this checkout"].append(run_round(args.runs))
            for f, data in base.items():
                (ROOT / f).write_bytes(data)
            try:
                results[f"base {args.base}"].append(run_round(args.runs))
            finally:
                for f, data in current.items():
                    (ROOT / f).write_bytes(data)
    finally:
        for f, data in current.items():
            (ROOT / f).write_bytes(data)
    rows = {k: (statistics.median(r["overhead_ms"] for r in v), statistics.median(r["setup_ms"] for r in v),
                [round(r["overhead_ms"], 1) for r in v]) for k, v in results.items()}
    (now_over, now_setup, _), (base_over, base_setup, _) = rows.values()
    lines = [
        "## The sandbox's per-job layers, against an earlier revision (issue 40, `bench/bench_sandbox_layers.py`)",
        "",
        f"Machine: {machine()}. Tiny model (Linear 8→4), TorchScript target + verification, warm sandbox with its "
        f"spare child; {args.rounds} alternating rounds of {args.runs} jobs, each round a fresh process; overhead "
        "is the median job against the median in-process conversion of the same round.",
        "",
        "| sandbox files | overhead per job (median of rounds) | rounds | layers' setup in the child (`setup_ms`) |",
        "|---|---|---|---|",
        *[f"| {k} | {over:.1f} ms | {', '.join(map(str, each))} | {setup:.2f} ms |"
          for k, (over, setup, each) in rows.items()],
        "",
        f"The layers added since `{args.base}` (the caller-only filter for same-uid calls, refused inotify and "
        "fanotify, a pids cgroup per job joined by the spare child while it waits, the worker's disk watch and "
        f"bounded manifest checks) cost **{now_over - base_over:+.1f} ms** per job ({now_setup - base_setup:+.2f} ms "
        "of it in the child's setup; issue 40's bound: 10 ms).",
    ]
    write_section("sandbox-layers", "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
