"""The benchmark stage: each artifact in its own runtime, and the eager original, timed per batch.

Runs in the sandbox, after verification, one runtime at a time (loaded, measured at every
batch size, unloaded) so that no two runtimes' threads or memory mix in one number. Per
artifact and batch: `warmup` untimed runs, then up to `runs` timed ones; p50/p95/mean latency,
throughput (batch ÷ p50), and the process's peak resident memory while that runtime ran that
batch (the kernel's high-water mark, reset before each: it includes the engine's own baseline,
torch and the original model, the same for every row). `max_seconds` bounds the whole stage:
each measurement gets a fair share of what is left, and what does not fit is skipped, with why.
The figures and the recommendation go to the manifest's `benchmark` (fxport/benchmark.py).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fxport.benchmark import machine_info, recommend
from fxport.spec import BenchmarkOptions
from fxport.workers.engine.inputs import InputSignature
from fxport.workers.engine.verify.runners import Runner

MIN_RUNS = 3  # fewer timed runs than this make no percentile worth the name
Emit = Callable[[str, float, str], None]


def batch_dim(sig: InputSignature) -> str | None:
    """The name of the batch dim: "batch" when the model has one, else the first input's first
    dim if it is dynamic; None when the batch is static."""
    if "batch" in sig.dynamic_dims:
        return "batch"
    first = sig.inputs[0].shape[0] if sig.inputs and sig.inputs[0].shape else None
    return first if isinstance(first, str) else None


def default_batches(sig: InputSignature) -> list[int]:
    """The batch dim's min, opt and max; the static batch of a model without one."""
    dim = batch_dim(sig)
    if dim is not None:
        r = sig.dynamic_dims[dim]
        return sorted({r.min, r.opt, r.max})
    first = sig.inputs[0].shape[0] if sig.inputs and sig.inputs[0].shape else 1
    return [first if isinstance(first, int) else 1]


def point_for(sig: InputSignature, batch: int) -> dict[str, int] | str:
    """The dims at which to measure `batch` (every other dynamic dim at its opt), or why it can't be."""
    point = {n: r.opt for n, r in sig.dynamic_dims.items()}
    dim = batch_dim(sig)
    if dim is None:
        static = default_batches(sig)[0]
        return point if batch == static else f"the model's batch is static ({static})"
    r = sig.dynamic_dims[dim]
    if not r.min <= batch <= r.max:
        return f"batch {batch} is outside the model's batch range {r.min}..{r.max}"
    point[dim] = batch
    return point


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark of this process (Linux ≥ 4.0); False where it can't."""
    try:
        fd = os.open("/proc/self/clear_refs", os.O_WRONLY | os.O_CLOEXEC)  # no O_TRUNC: Landlock grants write only
    except OSError:
        return False
    try:
        return os.write(fd, b"5") == 1
    except OSError:
        return False
    finally:
        os.close(fd)


def _status_mib(field: str) -> float | None:
    """A memory field of /proc/self/status (VmHWM: the peak resident set; VmRSS: the current one), in MiB."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return round(int(line.split()[1]) / 1024, 1)
    except (OSError, ValueError, IndexError):
        pass
    return None


def _peak_rss_mib() -> float | None:
    return _status_mib("VmHWM")


def _timed_runs(runner: Runner, args: tuple[Any, ...], opts: BenchmarkOptions, budget_s: float, deadline: float,
                clock: Callable[[], float]) -> list[float]:
    """Latencies in seconds: warm-up runs (at most a third of the budget), then timed runs until
    `opts.runs`, the budget (once MIN_RUNS are in) or the stage's deadline."""
    start = clock()
    for _ in range(opts.warmup):
        if clock() - start > budget_s / 3 or clock() > deadline:
            break
        runner.infer(args)
    times: list[float] = []
    timed_from = clock()
    for _ in range(opts.runs):
        t0 = clock()
        runner.infer(args)
        times.append(clock() - t0)
        now = clock()
        if now > deadline or (len(times) >= MIN_RUNS and now - timed_from > budget_s):
            break
    return times


def measure(runners: list[Runner], sig: InputSignature, opts: BenchmarkOptions, *, verified: set[str], seed: int,
            emit: Emit | None = None, clock: Callable[[], float] = time.perf_counter) -> dict[str, Any]:
    """Benchmark `runners` (the eager original first, as the baseline) at each batch; returns the
    manifest's `benchmark` object. A runner that fails to load or run is skipped with its error."""
    started = clock()
    deadline = started + opts.max_seconds
    threads_before = torch.get_num_threads()
    threads = opts.threads or threads_before
    torch.set_num_threads(threads)  # onnxruntime sessions take the same (verify/runners.py)
    batches = opts.batches or default_batches(sig)
    results: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    total = len(runners) * len(batches)
    done = 0
    try:
        for runner in runners:
            if clock() >= deadline:
                skipped += [{"artifact": runner.name, "batch": b,
                             "reason": f"the stage's max_seconds ({opts.max_seconds:g} s) ran out before it"}
                            for b in batches]
                done += len(batches)
                continue
            # The artifact's memory is what its runtime adds to the process: the peak during its
            # runs over the resident set before it was loaded. (The process's own peak is mostly
            # torch and every library the sandbox holds: the same ~500 MiB in every row.)
            before_load = _status_mib("VmRSS")
            try:
                runner.activate()
            except Exception as exc:  # noqa: BLE001 - a runtime that cannot load is a finding, not a crash
                skipped += [{"artifact": runner.name, "batch": b, "reason": f"could not load: {_why(exc)}"}
                            for b in batches]
                done += len(batches)
                continue
            try:
                for batch in batches:
                    if emit:
                        emit("benchmark", done / total, f"{runner.name} at batch {batch}")
                    done += 1
                    row = _measure_one(runner, sig, opts, batch, seed=seed, deadline=deadline,
                                       left=total - done + 1, clock=clock, before_load=before_load)
                    if "reason" in row:
                        skipped.append(row)
                        continue
                    results.append({**row, "verified": runner.name == "eager" or runner.name in verified,
                                    "threads": threads})
            finally:
                runner.deactivate()
    finally:
        torch.set_num_threads(threads_before)
    return {
        "results": results, "skipped": skipped, "recommendation": recommend(results), "machine": machine_info(),
        "settings": {"batches": batches, "warmup": opts.warmup, "runs": opts.runs, "threads": threads,
                     "max_seconds": opts.max_seconds},
        "seconds": round(clock() - started, 3),
    }


def _measure_one(runner: Runner, sig: InputSignature, opts: BenchmarkOptions, batch: int, *, seed: int,
                 deadline: float, left: int, clock: Callable[[], float],
                 before_load: float | None = None) -> dict[str, Any]:
    point = point_for(sig, batch)
    base = {"artifact": runner.name, "batch": batch}
    if isinstance(point, str):
        return {**base, "reason": point}
    remaining = deadline - clock()
    if remaining <= 0:
        return {**base, "reason": f"the stage's max_seconds ({opts.max_seconds:g} s) ran out before it"}
    args = sig.make_inputs(point, seed=seed)
    measured_peak = _reset_peak_rss()
    try:
        times = _timed_runs(runner, args, opts, remaining / max(left, 1), deadline, clock)
    except Exception as exc:  # noqa: BLE001
        return {**base, "reason": f"failed at this batch: {_why(exc)}"}
    if len(times) < MIN_RUNS:
        return {**base, "reason": f"only {len(times)} run(s) fit in the stage's max_seconds ({opts.max_seconds:g} s)"}
    ms = sorted(t * 1000 for t in times)
    p50 = round(statistics.median(ms), 4)  # the throughput is the manifest's own p50's, exactly
    peak = _peak_rss_mib() if measured_peak else None
    return {**base, "runtime": runner.runtime, "p50_ms": p50,
            "p95_ms": round(float(np.percentile(ms, 95)), 4), "mean_ms": round(statistics.fmean(ms), 4),
            "throughput_per_s": round(batch * 1000 / p50, 2), "runs": len(ms), "peak_rss_mib": peak,
            "memory_mib": round(max(0.0, peak - before_load), 1) if peak is not None and before_load is not None
            else None}


def _why(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}"[:300]
