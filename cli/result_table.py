"""Render a manifest (the result of a conversion) as tables a person reads at a glance.

The manifest is read through its type (fxport/manifest.py), leniently: a section of another shape
is left out of the tables, not the tables out of the terminal.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich.console import Console
from rich.table import Table

from fxport.benchmark import rate, speedups
from fxport.isolation import describe_layers
from fxport.manifest import ArtifactRecord, Manifest, VerificationRecord, read_leniently
from fxport.manifest_sections import Benchmark, BenchmarkRow, Calibration, EndToEnd, Quantization


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def render_manifest(manifest: Manifest | Mapping[str, Any], console: Console) -> None:
    m = manifest if isinstance(manifest, Manifest) else read_leniently(manifest)[0]
    if m.capture:
        tried = ", ".join(f"{a.method}{'(strict)' if a.strict else ''}={'ok' if a.ok else 'failed'}"
                          for a in m.capture.attempts)
        console.print(f"[bold]capture[/]: {m.capture.method} ({m.capture.level} level) — tried {tried}")
    for p in m.passes:
        mark = "✓" if p.changed else ("–" if p.applied else "✗")
        console.print(f"  pass {mark} {p.name}: {p.notes}")
    console.print(_artifact_table(m))
    if m.benchmark:
        render_benchmark(m.benchmark, console)
    if m.quantization:
        render_quantization(m.quantization, console)
    if m.timings_s:
        console.print("timings: " + ", ".join(f"{k} {v:.2f}s" for k, v in m.timings_s.items()))
    for w in m.warnings:
        console.print(f"[yellow]warning:[/] {w}")
    if m.sandbox is not None:
        have, missing = describe_layers(m.sandbox.as_dict())
        console.print(f"sandbox: {', '.join(have) or 'none'}"
                      + (f" [yellow](without: {', '.join(missing)})[/]" if missing else ""), highlight=False)


def _artifact_table(m: Manifest) -> Table:
    """One row per format (a folder of files is one row), with its check; then the targets not built."""
    by_format: dict[str, list[ArtifactRecord]] = {}
    for art in m.artifacts:
        by_format.setdefault(art.format, []).append(art)
    checks = {v.format: v for v in m.verification}
    table = Table(title="artifacts", show_lines=False)
    # the artifact's path names its format; on an 80-column CI log every column must fit unwrapped
    for col in ("artifact", "size", "sha256", "max |Δ|", "cosine", "shapes", "parity"):
        table.add_column(col, no_wrap=col != "parity")
    for fmt, files in by_format.items():
        path = files[0].path if len(files) == 1 else files[-1].path.split("/")[0] + "/"
        # A folder (fx_source/, triton/) has a digest per file, in manifest.json: no one of them stands for it.
        digest = files[0].sha256[:10] if len(files) == 1 else f"{len(files)} files"
        table.add_row(path, _size(sum(a.bytes for a in files)), digest, *_check_cells(checks.get(fmt)))
    for missing in m.failed_targets:
        table.add_row(missing.target, "", "", "", "", "", f"[red]not built[/] {missing.reason}")
    return table


def _check_cells(v: VerificationRecord | None) -> list[str]:
    """max |Δ|, cosine, shapes and parity of an artifact's check."""
    if v is None:
        return ["", "", "", "[yellow]not checked[/]"]
    verdict = v.verdict or ("passed" if v.passed else "failed")
    parity = {"passed": "[green]pass[/]",
              "inconclusive": "[yellow]inconclusive[/] (constant output: see warnings)"}.get(
        verdict, f"[red]FAIL[/] {v.error or ''}")
    return [f"{v.max_abs_diff or 0:.1e}", f"{v.cosine or 0:.6f}", str(len(v.shapes_checked)), parity]


QUANT_ROWS = 10  # worst layers shown on the terminal; manifest.json has them all


def render_quantization(quantization: Quantization | Mapping[str, Any], console: Console) -> None:
    """int8: calibration, end-to-end fidelity, the worst layers, the fallback. fp16: what stayed fp32."""
    quant = quantization if isinstance(quantization, Quantization) else Quantization.model_validate(quantization)
    if not quant:
        return
    if quant.precision == "fp16":
        kept = sorted({k.op or "" for k in quant.kept_fp32})
        console.print(f"[bold]fp16[/]: {len(quant.kept_fp32)} ops kept in fp32"
                      + (f" ({', '.join(kept)})" if kept else ""))
        return
    console.print(_int8_line(quant))
    layers = sorted(quant.layers, key=lambda r: r.sqnr_db or 0.0)
    if layers:
        worst = min(len(layers), QUANT_ROWS)
        console.print(f"per-layer error on held-out data, worst {worst} of {len(layers)} layers:")
        table = Table()
        for col in ("layer", "SQNR dB", "cosine", "kept as"):
            table.add_column(col)
        for row in layers[:QUANT_ROWS]:
            table.add_row(str(row.node), _num(row.sqnr_db, "{:.2f}"), _num(row.cosine, "{:.5f}"),
                          "[red]fp32[/]" if row.fallback else "int8")
        console.print(table)
    if quant.fallback_layers:
        console.print(f"kept in fp32 to reach the target: {', '.join(quant.fallback_layers)}{_fallback_cost(quant)}")
    for other, report in quant.schemes.items():
        if other == quant.runtime:
            continue
        e2e = report.end_to_end or EndToEnd()
        console.print(f"also the [bold]{other}[/] scheme (its own ONNX model, for the {other} target): end-to-end "
                      f"cosine {_num(e2e.cosine, '{:.5f}')}, top-1 agreement {_num(e2e.top1_agreement, '{:.3f}')}"
                      + (f"; kept in fp32: {', '.join(report.fallback_layers)}" if report.fallback_layers else ""))


def _int8_line(quant: Quantization) -> str:
    """The int8 summary: scheme, observer, calibration, end-to-end fidelity against the target."""
    cal = quant.calibration or Calibration()
    e2e = quant.end_to_end or EndToEnd()
    source = "[yellow]random samples[/]" if cal.source == "random" else "file"
    scheme = f"{quant.runtime} scheme, " if quant.runtime else ""
    line = (f"[bold]int8[/] ({scheme}{quant.observer} observer; calibration: {source}, {cal.samples} samples, "
            f"{cal.held_out} held out) — end-to-end cosine {_num(e2e.cosine, '{:.5f}')}, "
            f"top-1 agreement {_num(e2e.top1_agreement, '{:.3f}')}")
    if quant.target_cosine is not None:
        line += f", target {quant.target_cosine} " + ("[green]met[/]" if e2e.target_met else "[red]missed[/]")
    return line


def _fallback_cost(quant: Quantization) -> str:
    """What the fp32 layers cost: measured in onnxruntime where it was, else their share of the multiply-adds."""
    latency = quant.fallback.latency if quant.fallback else None
    if latency is not None and latency.ms_all_int8 is not None and latency.ms_with_fallback is not None:
        return f" — onnxruntime {latency.ms_all_int8:.2f} → {latency.ms_with_fallback:.2f} ms"
    share = (quant.fallback.fp32_macs_share if quant.fallback else None) or 0
    return f" — {100 * share:.1f}% of the multiply-adds in fp32"


def _num(value: Any, fmt: str) -> str:
    return fmt.format(value) if isinstance(value, (int, float)) else "–"


def render_benchmark(benchmark: Benchmark | Mapping[str, Any], console: Console) -> None:
    """The benchmark table (per artifact and batch) and the recommendation; nothing without one."""
    bench = benchmark if isinstance(benchmark, Benchmark) else Benchmark.model_validate(benchmark)
    if not bench.results and not bench.skipped:
        return
    console.print(_benchmark_table(bench))
    for s in bench.skipped:
        console.print(f"[yellow]skipped[/] {s.artifact} at batch {s.batch}: {s.reason}", highlight=False)
    worst = bench.noise.worst if bench.noise and bench.noise.noisy else None
    if worst is not None:
        rounds = ", ".join(f"{x:.3g}" for x in worst.round_p50_ms or [])
        console.print(f"[yellow]noisy machine[/]: {worst.artifact} at batch {worst.batch} varied "
                      f"{worst.spread or 0:.1f}× between rounds ({rounds} ms): the figures are rough; benchmark on a "
                      "quiet machine before deciding", highlight=False)
    pick = bench.recommendation
    if pick:
        console.print(f"[bold]recommended[/]: {pick.artifact} at batch {pick.batch} — {pick.reason}", highlight=False)
    elif bench.no_clear_winner:
        console.print("[yellow]no clear winner[/]: " + "; ".join(u.reason for u in bench.no_clear_winner),
                      highlight=False)
    elif bench.results:
        console.print("[yellow]no recommendation[/]: no verified artifact was measured", highlight=False)


def _benchmark_table(bench: Benchmark) -> Table:
    machine = bench.machine
    threads = bench.settings.threads if bench.settings else None
    where = ", ".join(str(x) for x in (machine.cpu if machine else None, f"{threads} threads" if threads else None,
                                      machine.gpu if machine else None) if x)
    table = Table(title=f"benchmark ({where})" if where else "benchmark")
    # on an 80-column CI log every column fits unwrapped
    for col in ("artifact", "batch", "p50 ms", "p95 ms", "throughput", "× eager", "memory"):
        table.add_column(col, no_wrap=True, justify="left" if col == "artifact" else "right")
    up = speedups(bench.as_dict()["results"]) if bench.results else {}
    for r in sorted(bench.results, key=lambda r: (r.artifact != "eager", r.artifact, r.batch)):
        speed = up.get((r.artifact, r.batch))
        table.add_row(r.artifact + ("" if r.verified else " (not verified)"), str(r.batch), _p50(r),
                      f"{r.p95_ms:.3g}" if r.p95_ms is not None else "",
                      rate(r.throughput_per_s) if r.throughput_per_s is not None else "",
                      f"{speed:.2f}" if speed is not None else "",
                      f"{r.memory_mib:.0f} MiB" if r.memory_mib is not None else "")
    return table


def _p50(r: BenchmarkRow) -> str:
    lo_hi = r.p50_range_ms
    ranged = lo_hi is not None and len(lo_hi) == 2 and lo_hi[0] != lo_hi[1]
    return f"{r.p50_ms or 0:.3g}" + (f" ({lo_hi[0]:.3g}–{lo_hi[1]:.3g})" if lo_hi is not None and ranged else "")
