"""What the size benchmarks share (bench_graph_size, bench_model_bytes): one conversion timed the same
way, each in a fresh subprocess, and the log-log slope of a stage's seconds against a size."""

from __future__ import annotations

import gc
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

STAGES = ("load", "capture", "passes", "export", "verify")


def timed_convert(model_path: Path, spec: Any, out_dir: Path, on_progress: Any = None) -> tuple[dict, float]:
    """The engine's `convert`, its warnings silenced, with the cyclic garbage collector off. Returns the
    manifest and the wall seconds; `convert`'s own exception when it fails (manifest.json is written
    either way), the collector back on.

    A full collection costs time in proportion to the heap (here mostly the loaded program) and lands
    in whichever stage is running then: 0.23 s of a 0.40 s capture at 4,000 nodes, none at 18,000.
    Off during the conversion, in every tree and at every size alike, the stages show their own cost."""
    from fxport.workers.engine.pipeline import convert

    gc.collect()
    gc.disable()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t0 = time.perf_counter()
            manifest = convert(model_path, spec, out_dir, on_progress=on_progress)
            return manifest, time.perf_counter() - t0
    finally:
        gc.enable()


def run_child(script: Path, args: Sequence[str], what: str, env: dict[str, str] | None = None) -> dict:
    """`python -s script *args` in a fresh process, from the temporary folder (so `fxport` resolves as
    installed, or as `env`'s PYTHONPATH lays it out); its last line of output, read as JSON. Stops the run,
    naming `what`, when the process fails."""
    cmd = [sys.executable, "-s", str(script), *args]
    done = subprocess.run(cmd, env=env or dict(os.environ), cwd=tempfile.gettempdir(), capture_output=True,
                          text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the measurement on {what} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of log(y) on log(x)."""
    lx, ly = [math.log(x) for x in xs], [math.log(max(y, 1e-4)) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)
