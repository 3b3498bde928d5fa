"""The benchmark stage: each artifact in its own runtime, and the eager original, timed per batch.

Runs in the sandbox, after verification, one runtime at a time (loaded, measured at every
batch size, unloaded) so that no two runtimes' threads or memory mix in one number, in
`rounds` rounds that take the runtimes in turn, so that a spell of load on a shared machine
falls on all of them. Per artifact and batch: `warmup` untimed runs each round, then its share
of `runs` timed ones; p50 over every run with the range of the rounds' medians, p95, mean,
throughput (batch ÷ p50), and the memory the runtime adds to the process (its peak over the
resident memory before the artifact loaded; the process's own peak is kept too). `max_seconds`
bounds the whole stage: each measurement gets a fair share of what is left, and what does not
fit is skipped, with why.
The figures and the recommendation go to the manifest's `benchmark` (fxport/benchmark.py).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fxport.benchmark import machine_info, no_clear_winner, noise, recommend
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


def _timed_runs(runner: Runner, args: tuple[Any, ...], opts: BenchmarkOptions, runs: int, budget_s: float,
                deadline: float, clock: Callable[[], float], min_runs: int = 1) -> list[float]:
    """Latencies in seconds: warm-up runs (at most a third of the budget), then timed runs until
    `runs`, the budget (once `min_runs` are in) or the stage's deadline."""
    start = clock()
    for _ in range(opts.warmup):
        if clock() - start > budget_s / 3 or clock() > deadline:
            break
        runner.infer(args)
    times: list[float] = []
    timed_from = clock()
    for _ in range(runs):
        t0 = clock()
        runner.infer(args)
        times.append(clock() - t0)
        now = clock()
        if now > deadline or (len(times) >= min_runs and now - timed_from > budget_s):
            break
    return times


def measure(runners: list[Runner], sig: InputSignature, opts: BenchmarkOptions, *, verified: set[str], seed: int,
            emit: Emit | None = None, clock: Callable[[], float] = time.perf_counter) -> dict[str, Any]:
    """Benchmark `runners` (the eager original first, as the baseline) at each batch; returns the
    manifest's `benchmark` object. A runner that fails to load or run is skipped with its error.

    In `opts.rounds` rounds, each runner in turn (loaded, every batch, unloaded), so that a spell
    of load on a shared machine lands on every runtime rather than on one: a row's p50 is over
    all its runs, its interval the range of its rounds' medians, and a spread past NOISY_SPREAD
    marks the machine noisy. The recommendation is made only where intervals separate."""
    started = clock()
    threads_before = torch.get_num_threads()
    threads = opts.threads or threads_before
    torch.set_num_threads(threads)  # onnxruntime sessions take the same (verify/runners.py)
    batches = opts.batches or default_batches(sig)
    # Rounds of at least MIN_RUNS each: `runs: 3` is one round (a p50 without an interval).
    rounds = max(1, min(opts.rounds, opts.runs // MIN_RUNS))
    plan = _Plan(sig, opts, batches, rounds, seed, deadline=started + opts.max_seconds, clock=clock, emit=emit)
    tally = _Tally(total=rounds * len(runners) * len(batches))
    try:
        for rnd in range(rounds):
            for runner in runners:
                _measure_runner(plan, tally, runner, rnd)
    finally:
        torch.set_num_threads(threads_before)
    results, skipped = _rows(plan, tally, runners, verified, threads)
    return {
        "results": results, "skipped": skipped, "recommendation": recommend(results), "machine": machine_info(),
        "noise": noise(results), "no_clear_winner": no_clear_winner(results),
        "settings": {"batches": batches, "warmup": opts.warmup, "runs": opts.runs, "rounds": rounds,
                     "threads": threads, "max_seconds": opts.max_seconds},
        "seconds": round(clock() - started, 3),
    }


@dataclass(frozen=True)
class _Plan:
    """What every measurement of one benchmark stage shares."""

    sig: InputSignature
    opts: BenchmarkOptions
    batches: list[int]
    rounds: int
    seed: int
    deadline: float
    clock: Callable[[], float]
    emit: Emit | None


@dataclass
class _Tally:
    """What the rounds measured so far, per (artifact, batch), and how many measurements are done."""

    total: int
    done: int = 0
    times: dict[tuple[str, int], list[list[float]]] = field(default_factory=dict)  # each round's latencies
    memory: dict[tuple[str, int], float] = field(default_factory=dict)
    peaks: dict[tuple[str, int], float] = field(default_factory=dict)
    why_not: dict[tuple[str, int], str] = field(default_factory=dict)
    runtime_of: dict[str, str | None] = field(default_factory=dict)

    def add(self, key: tuple[str, int], got: tuple[list[float], float | None, float | None] | str) -> None:
        if isinstance(got, str):
            if not self.times.get(key):  # a later round's shortfall keeps what earlier rounds measured
                self.why_not[key] = got
            return
        latencies, mib, peak = got
        self.times.setdefault(key, []).append(latencies)
        if mib is not None:
            self.memory[key] = max(self.memory.get(key, 0.0), mib)
        if peak is not None:
            self.peaks[key] = max(self.peaks.get(key, 0.0), peak)


def _measure_runner(plan: _Plan, tally: _Tally, runner: Runner, rnd: int) -> None:
    """Round `rnd` of one runner: loaded, measured at every batch, unloaded."""
    batches, opts, rounds = plan.batches, plan.opts, plan.rounds
    keys = [(runner.name, b) for b in batches]
    if all(k in tally.why_not for k in keys):
        tally.done += len(batches)
        return
    before_load = _status_mib("VmRSS")  # memory: what the runtime adds over this
    try:
        runner.activate()
    except Exception as exc:  # noqa: BLE001 - a runtime that cannot load is a finding, not a crash
        for k in keys:
            tally.why_not.setdefault(k, f"could not load: {_why(exc)}")
        tally.done += len(batches)
        return
    tally.runtime_of[runner.name] = runner.runtime
    try:
        for batch in batches:
            key = (runner.name, batch)
            tally.done += 1
            if key in tally.why_not:
                continue
            if plan.emit:
                plan.emit("benchmark", (tally.done - 1) / tally.total, f"{runner.name} at batch {batch}"
                          + (f" (round {rnd + 1} of {rounds})" if rounds > 1 else ""))
            # the runs split over the rounds; the first round's MIN_RUNS come whatever the
            # budget, so a stage cut short still has a p50 for what it reached
            tally.add(key, _measure_one(runner, plan.sig, opts, batch, seed=plan.seed, deadline=plan.deadline,
                                        left=tally.total - tally.done + 1, clock=plan.clock,
                                        runs=opts.runs // rounds + (1 if rnd < opts.runs % rounds else 0),
                                        min_runs=MIN_RUNS if rnd == 0 else 1, before_load=before_load))
    finally:
        runner.deactivate()


def _rows(plan: _Plan, tally: _Tally, runners: list[Runner], verified: set[str], threads: int
          ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The manifest's result rows (runner × batch with MIN_RUNS runs or more) and the skipped ones, with why."""
    results, skipped = [], []
    for runner in runners:
        for batch in plan.batches:
            key = (runner.name, batch)
            pooled = [t for round_times in tally.times.get(key, []) for t in round_times]
            if len(pooled) < MIN_RUNS:
                reason = tally.why_not.get(key) or (f"only {len(pooled)} run(s) fit in the stage's max_seconds "
                                                    f"({plan.opts.max_seconds:g} s)")
                skipped.append({"artifact": runner.name, "batch": batch, "reason": reason})
                continue
            results.append({**_row(runner.name, tally.runtime_of.get(runner.name), batch, tally.times[key],
                                   tally.memory.get(key)),
                            "peak_rss_mib": tally.peaks.get(key),
                            "verified": runner.name == "eager" or runner.name in verified, "threads": threads})
    return results, skipped


def _row(name: str, runtime: str | None, batch: int, rounds: list[list[float]], memory_mib: float | None
         ) -> dict[str, Any]:
    ms = sorted(t * 1000 for r in rounds for t in r)
    p50 = round(statistics.median(ms), 4)  # the throughput is the manifest's own p50's, exactly
    medians = [round(statistics.median(r) * 1000, 4) for r in rounds if r]
    return {"artifact": name, "batch": batch, "runtime": runtime, "p50_ms": p50,
            "p50_range_ms": [min(medians), max(medians)], "round_p50_ms": medians,
            "p95_ms": round(float(np.percentile(ms, 95)), 4), "mean_ms": round(statistics.fmean(ms), 4),
            "throughput_per_s": round(batch * 1000 / p50, 2), "runs": len(ms), "rounds": len(medians),
            "memory_mib": memory_mib}


def _measure_one(runner: Runner, sig: InputSignature, opts: BenchmarkOptions, batch: int, *, seed: int,
                 deadline: float, left: int, clock: Callable[[], float], runs: int, min_runs: int = 1,
                 before_load: float | None = None) -> tuple[list[float], float | None, float | None] | str:
    """One round of `runner` at `batch`: its latencies (s), the memory it added and the process's
    peak (MiB), or why none."""
    point = point_for(sig, batch)
    if isinstance(point, str):
        return point
    remaining = deadline - clock()
    if remaining <= 0:
        return f"the stage's max_seconds ({opts.max_seconds:g} s) ran out before it"
    args = sig.make_inputs(point, seed=seed)
    measured_peak = _reset_peak_rss()
    try:
        latencies = _timed_runs(runner, args, opts, runs, remaining / max(left, 1), deadline, clock, min_runs)
    except Exception as exc:  # noqa: BLE001
        return f"failed at this batch: {_why(exc)}"
    peak = _peak_rss_mib() if measured_peak else None
    added = round(max(0.0, peak - before_load), 1) if peak is not None and before_load is not None else None
    return latencies, added, peak


def _why(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}"[:300]
