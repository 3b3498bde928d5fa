"""The manifest's `benchmark` object: which artifact to deploy, and at what batch size.

The engine measures (workers/engine/benchmark.py); this module holds what needs no runtime,
so the worker that merges a GPU stage's rows, the CLI's table and the report share it:

    {"results": [{"artifact", "runtime", "batch", "p50_ms", "p95_ms", "mean_ms", "throughput_per_s",
                  "peak_rss_mib", "memory_mib", "threads", "runs", "verified"}],
     "skipped": [{"artifact", "batch", "reason"}],
     "recommendation": {"artifact", "batch", "reason", "per_batch": [...]} | null,
     "machine": {"cpu", "cores", "usable_cpus", "isa", "arch", "gpu"},
     "settings": {"warmup", "runs", "threads", "max_seconds", "batches"}, "seconds": ...}

The eager original ("eager") is the baseline; only artifacts whose verification passed are
recommended.
"""

from __future__ import annotations

import math
import os
import platform
from collections import Counter
from collections.abc import Iterable
from typing import Any, cast

# CPU features that decide which runtime and precision run fastest (x86, then Arm).
ISA_FEATURES = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni",
                "avx512_bf16", "avx512_fp16", "amx_tile", "amx_int8", "amx_bf16",
                "asimd", "asimdhp", "asimddp", "i8mm", "bf16", "sve", "sve2")


def machine_info(cpuinfo: str | None = None) -> dict[str, Any]:
    """The CPU this process runs on: model, cores, the ISA features above (from /proc/cpuinfo)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            cpuinfo = ""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip().lower(), value.strip())
    flags = set((fields.get("flags") or fields.get("features") or "").split())
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count() or 1
    return {"cpu": fields.get("model name") or fields.get("cpu model") or platform.processor() or "unknown",
            "cores": os.cpu_count(), "usable_cpus": usable, "arch": platform.machine(),
            "isa": [f for f in ISA_FEATURES if f in flags], "gpu": None}


def speedups(results: list[dict[str, Any]]) -> dict[tuple[str, int], float]:
    """(artifact, batch) → eager p50 ÷ its p50, where eager ran at that batch."""
    eager = {r["batch"]: r["p50_ms"] for r in results if r["artifact"] == "eager" and r.get("p50_ms")}
    return {(r["artifact"], r["batch"]): eager[r["batch"]] / r["p50_ms"]
            for r in results if r.get("p50_ms") and r["batch"] in eager}


NOISY_SPREAD = 1.5  # a row whose rounds' medians differ by more than this factor: the machine was busy


def _range(r: dict[str, Any]) -> tuple[float, float]:
    """A row's p50 interval: the range of its rounds' medians (a row of one round: its p50)."""
    lo_hi = r.get("p50_range_ms")
    return (float(lo_hi[0]), float(lo_hi[1])) if lo_hi else (float(r["p50_ms"]), float(r["p50_ms"]))


def _fastest(rows: list[dict[str, Any]]) -> dict[int, tuple[dict[str, Any], dict[str, Any] | None]]:
    """Per batch: the row with the lowest p50, and the runner-up whose interval overlaps it (None
    when the fastest's interval lies wholly below every other's: a clear winner)."""
    out: dict[int, tuple[dict[str, Any], dict[str, Any] | None]] = {}
    for batch in sorted({r["batch"] for r in rows}):
        at = sorted((r for r in rows if r["batch"] == batch), key=lambda r: r["p50_ms"])
        best = at[0]
        overlap = next((r for r in at[1:] if _range(r)[0] <= _range(best)[1]), None)
        out[batch] = (best, overlap)
    return out


def _candidates(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in results if r["artifact"] != "eager" and r.get("verified") and r.get("p50_ms")]


def no_clear_winner(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The batches where the fastest verified artifact's interval overlaps another's: no
    recommendation is made there (each with the two artifacts and their intervals)."""
    out = []
    for batch, (best, overlap) in _fastest(_candidates(results)).items():
        if overlap is not None:
            out.append({"batch": batch, "artifacts": [best["artifact"], overlap["artifact"]],
                        "p50_range_ms": [list(_range(best)), list(_range(overlap))],
                        "reason": f"at batch {batch}, {best['artifact']} ({_fmt_range(best)} ms) and "
                                  f"{overlap['artifact']} ({_fmt_range(overlap)} ms) overlap across rounds"})
    return out


def _fmt_range(r: dict[str, Any]) -> str:
    lo, hi = _range(r)
    return f"{lo:.3g}" if lo == hi else f"{lo:.3g}–{hi:.3g}"


def noise(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Whether the machine was noisy while the benchmark ran: some row's rounds' medians differ by
    more than NOISY_SPREAD ×. The worst row is named."""
    spreads = [(r["p50_range_ms"][1] / r["p50_range_ms"][0], r) for r in results
               if r.get("p50_range_ms") and r["p50_range_ms"][0] > 0 and (r.get("rounds") or 0) > 1]
    if not spreads:
        return {"noisy": False, "threshold": NOISY_SPREAD, "worst": None}
    spread, worst = max(spreads, key=lambda x: x[0])
    return {"noisy": spread > NOISY_SPREAD, "threshold": NOISY_SPREAD,
            "worst": {"artifact": worst["artifact"], "batch": worst["batch"], "spread": round(spread, 3),
                      "round_p50_ms": worst.get("round_p50_ms")}}


def recommend(results: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The fastest verified artifact at each batch (lowest p50) where it is a clear winner (its
    interval below every other's), and one overall pick: the artifact that wins the most batches
    (ties: the least slower than the best, geometric mean over batches), deployed at the batch,
    among those it wins, where it has the most throughput. None when no verified artifact was
    measured, or no batch has a clear winner (`no_clear_winner` says why)."""
    rows = _candidates(results)
    if not rows:
        return None
    up = speedups(results)
    best = {batch: winner for batch, (winner, overlap) in _fastest(rows).items() if overlap is None}
    if not best:
        return None
    wins = Counter(r["artifact"] for r in best.values())
    top = max(wins.values())

    def slowdown(artifact: str) -> float:  # geometric mean of p50 ÷ the batch's best p50
        ratios = [r["p50_ms"] / best[r["batch"]]["p50_ms"] for r in rows if r["artifact"] == artifact
                  and r["batch"] in best]
        return math.exp(sum(math.log(x) for x in ratios) / len(ratios)) if ratios else math.inf

    pick = min((a for a, w in wins.items() if w == top), key=lambda a: (slowdown(a), a))
    mine = sorted((r for r in rows if r["artifact"] == pick), key=lambda r: r["batch"])
    # at a batch where it is the fastest: the one where it moves the most samples per second
    deploy = max((r for r in mine if best[r["batch"]]["artifact"] == pick),
                 key=lambda r: (r["throughput_per_s"], -r["batch"]))
    vs_eager = [f"{up[(pick, r['batch'])]:.1f}× at {r['batch']}" for r in mine if (pick, r["batch"]) in up]
    if vs_eager:
        vs_eager[0] = vs_eager[0].replace("× at", "× eager at batch", 1)
    reason = (f"{pick}: " + (", ".join(vs_eager) + "; " if vs_eager else "")
              + f"fastest at {wins[pick]} of {len(best)} batch size(s) with a clear winner; most throughput at batch "
              f"{deploy['batch']} "
              f"({rate(deploy['throughput_per_s'])})")
    return {
        "artifact": pick, "batch": deploy["batch"], "reason": reason,
        "per_batch": [{"batch": b, "artifact": r["artifact"], "p50_ms": r["p50_ms"],
                       "speedup_vs_eager": round(up[(r["artifact"], b)], 3) if (r["artifact"], b) in up else None}
                      for b, r in sorted(best.items())],
    }


def merge(first: dict[str, Any] | None, second: dict[str, Any] | None) -> dict[str, Any] | None:
    """One benchmark from two stages' (the CPU stage's and the TensorRT stage's): rows side by
    side, the GPU named, the recommendation made again over all of them."""
    if not first or not second:
        return first or second
    merged = {**first, "results": [*first.get("results", []), *second.get("results", [])],
              "skipped": [*first.get("skipped", []), *second.get("skipped", [])],
              "seconds": round(float(first.get("seconds") or 0) + float(second.get("seconds") or 0), 3)}
    machine = dict(first.get("machine") or {})
    if (second.get("machine") or {}).get("gpu"):
        machine["gpu"] = second["machine"]["gpu"]
    merged["machine"] = machine
    merged["recommendation"] = recommend(merged["results"])
    merged["no_clear_winner"] = no_clear_winner(merged["results"])
    merged["noise"] = noise(merged["results"])
    return merged


def rate(per_s: float) -> str:
    """A throughput, short: 812/s, 12.4k/s, 2.93M/s."""
    for div, unit in ((1e6, "M"), (1e3, "k")):
        if per_s >= div:
            return f"{per_s / div:.3g}{unit}/s"
    return f"{per_s:.3g}/s"


def table(bench: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows as a person reads them: per artifact, per batch, with the speed-up over eager."""
    up = speedups(bench.get("results", []))
    rows = [{**r, "speedup_vs_eager": up.get((r["artifact"], r["batch"]))} for r in bench.get("results", [])]
    return sorted(rows, key=lambda r: (r["artifact"] != "eager", r["artifact"], r["batch"]))


def verified_formats(verification: Iterable[dict[str, Any]]) -> set[str]:
    # every verification record names its format
    return {cast(str, v.get("format")) for v in verification if v.get("passed")}
