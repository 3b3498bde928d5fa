"""Render a manifest (the result of a conversion) as tables a person reads at a glance."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from fxport.benchmark import rate
from fxport.benchmark import table as table_rows
from fxport.isolation import describe_layers


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def render_manifest(manifest: dict[str, Any], console: Console) -> None:
    capture = manifest.get("capture") or {}
    if capture:
        tried = ", ".join(
            f"{a['method']}{'(strict)' if a.get('strict') else ''}={'ok' if a.get('ok') else 'failed'}"
            for a in capture.get("attempts", [])
        )
        console.print(f"[bold]capture[/]: {capture.get('method')} ({capture.get('level')} level) — tried {tried}")
    for p in manifest.get("passes", []):
        mark = "✓" if p.get("changed") else ("–" if p.get("applied") else "✗")
        console.print(f"  pass {mark} {p['name']}: {p.get('notes', '')}")

    by_format: dict[str, dict[str, Any]] = {}
    for art in manifest.get("artifacts", []):
        entry = by_format.setdefault(art["format"],
                                     {"path": art["path"], "bytes": 0, "sha256": art["sha256"], "files": 0})
        entry["bytes"] += art["bytes"]
        entry["files"] += 1
        if entry["files"] > 1:
            entry["path"] = art["path"].split("/")[0] + "/"
    checks = {v["format"]: v for v in manifest.get("verification", [])}

    table = Table(title="artifacts", show_lines=False)
    # the artifact's path names its format; on an 80-column CI log every column must fit unwrapped
    for col in ("artifact", "size", "sha256", "max |Δ|", "cosine", "shapes", "parity"):
        table.add_column(col, no_wrap=col != "parity")
    for fmt, art in by_format.items():
        v = checks.get(fmt)
        if v is None:
            parity = "[yellow]not checked[/]"
            cols = ["", "", ""]
        else:
            verdict = v.get("verdict") or ("passed" if v.get("passed") else "failed")
            parity = {"passed": "[green]pass[/]",
                      "inconclusive": "[yellow]inconclusive[/] (constant output: see warnings)"}.get(
                verdict, f"[red]FAIL[/] {v.get('error', '')}")
            cols = [f"{v.get('max_abs_diff', 0):.1e}", f"{v.get('cosine', 0):.6f}",
                    str(len(v.get("shapes_checked", [])))]
        # A folder (fx_source/, triton/) has a digest per file, in manifest.json: no one of them stands for it.
        digest = art["sha256"][:10] if art["files"] == 1 else f"{art['files']} files"
        table.add_row(art["path"], _size(art["bytes"]), digest, *cols, parity)
    for missing in manifest.get("failed_targets") or []:
        table.add_row(str(missing.get("target")), "", "", "", "", "", f"[red]not built[/] {missing.get('reason', '')}")
    console.print(table)
    render_benchmark(manifest.get("benchmark") or {}, console)
    render_quantization(manifest.get("quantization") or {}, console)
    timings = manifest.get("timings_s") or {}
    if timings:
        console.print("timings: " + ", ".join(f"{k} {v:.2f}s" for k, v in timings.items()))
    for w in manifest.get("warnings", []):
        console.print(f"[yellow]warning:[/] {w}")
    box = manifest.get("sandbox")
    if isinstance(box, dict):
        have, missing = describe_layers(box)
        console.print(f"sandbox: {', '.join(have) or 'none'}"
                      + (f" [yellow](without: {', '.join(missing)})[/]" if missing else ""), highlight=False)


QUANT_ROWS = 10  # worst layers shown on the terminal; manifest.json has them all


def render_quantization(quant: dict[str, Any], console: Console) -> None:
    """int8: calibration, end-to-end fidelity, the worst layers, the fallback. fp16: what stayed fp32."""
    if not quant:
        return
    if quant.get("precision") == "fp16":
        kept = sorted({k.get("op", "") for k in quant.get("kept_fp32", [])})
        console.print(f"[bold]fp16[/]: {len(quant.get('kept_fp32', []))} ops kept in fp32"
                      + (f" ({', '.join(kept)})" if kept else ""))
        return
    cal = quant.get("calibration") or {}
    e2e = quant.get("end_to_end") or {}
    source = "[yellow]random samples[/]" if cal.get("source") == "random" else "file"
    runtime = quant.get("runtime")
    scheme = f"{runtime} scheme, " if runtime else ""
    line = (f"[bold]int8[/] ({scheme}{quant.get('observer')} observer; "
            f"calibration: {source}, {cal.get('samples')} samples, "
            f"{cal.get('held_out')} held out) — end-to-end cosine {_num(e2e.get('cosine'), '{:.5f}')}, "
            f"top-1 agreement {_num(e2e.get('top1_agreement'), '{:.3f}')}")
    if quant.get("target_cosine") is not None:
        met = e2e.get("target_met")
        line += f", target {quant['target_cosine']} " + ("[green]met[/]" if met else "[red]missed[/]")
    console.print(line)
    layers = sorted(quant.get("layers", []), key=lambda r: r.get("sqnr_db", 0.0))
    if layers:
        worst = min(len(layers), QUANT_ROWS)
        console.print(f"per-layer error on held-out data, worst {worst} of {len(layers)} layers:")
        table = Table()
        for col in ("layer", "SQNR dB", "cosine", "kept as"):
            table.add_column(col)
        for row in layers[:QUANT_ROWS]:
            table.add_row(str(row.get("node")), _num(row.get("sqnr_db"), "{:.2f}"), _num(row.get("cosine"), "{:.5f}"),
                          "[red]fp32[/]" if row.get("fallback") else "int8")
        console.print(table)
    fallback = quant.get("fallback_layers") or []
    if fallback:
        latency = (quant.get("fallback") or {}).get("latency") or {}
        cost = (f" — onnxruntime {latency['ms_all_int8']:.2f} → {latency['ms_with_fallback']:.2f} ms"
                if latency.get("ms_all_int8") is not None else
                f" — {100 * (quant.get('fallback') or {}).get('fp32_macs_share', 0):.1f}% of the multiply-adds in fp32")
        console.print(f"kept in fp32 to reach the target: {', '.join(fallback)}{cost}")
    for other, report in (quant.get("schemes") or {}).items():
        if other == runtime:
            continue
        e2e = report.get("end_to_end") or {}
        kept = report.get("fallback_layers") or []
        console.print(f"also the [bold]{other}[/] scheme (its own ONNX model, for the {other} target): end-to-end "
                      f"cosine {_num(e2e.get('cosine'), '{:.5f}')}, top-1 agreement "
                      f"{_num(e2e.get('top1_agreement'), '{:.3f}')}"
                      + (f"; kept in fp32: {', '.join(kept)}" if kept else ""))


def _num(value: Any, fmt: str) -> str:
    return fmt.format(value) if isinstance(value, (int, float)) else "–"


def render_benchmark(bench: dict[str, Any], console: Console) -> None:
    """The benchmark table (per artifact and batch) and the recommendation; nothing without one."""
    rows = table_rows(bench)
    if not rows and not bench.get("skipped"):
        return
    machine = bench.get("machine") or {}
    threads = (bench.get("settings") or {}).get("threads")
    where = ", ".join(str(x) for x in (machine.get("cpu"), f"{threads} threads" if threads else None,
                                      machine.get("gpu")) if x)
    table = Table(title=f"benchmark ({where})" if where else "benchmark")
    # on an 80-column CI log every column fits unwrapped
    for col in ("artifact", "batch", "p50 ms", "p95 ms", "throughput", "× eager", "memory"):
        table.add_column(col, no_wrap=True, justify="left" if col == "artifact" else "right")
    for r in rows:
        name = r["artifact"] + ("" if r.get("verified") else " (not verified)")
        speed = r.get("speedup_vs_eager")
        lo_hi = r.get("p50_range_ms")
        p50 = f"{r['p50_ms']:.3g}" + (f" ({lo_hi[0]:.3g}–{lo_hi[1]:.3g})" if lo_hi and lo_hi[0] != lo_hi[1] else "")
        table.add_row(name, str(r["batch"]), p50, f"{r['p95_ms']:.3g}", rate(r["throughput_per_s"]),
                      f"{speed:.2f}" if speed is not None else "", f"{r['memory_mib']:.0f} MiB"
                      if r.get("memory_mib") is not None else "")
    console.print(table)
    for s in bench.get("skipped", []):
        console.print(f"[yellow]skipped[/] {s['artifact']} at batch {s['batch']}: {s['reason']}", highlight=False)
    noise = bench.get("noise") or {}
    if noise.get("noisy") and noise.get("worst"):
        w = noise["worst"]
        console.print(f"[yellow]noisy machine[/]: {w['artifact']} at batch {w['batch']} varied {w['spread']:.1f}× "
                      f"between rounds ({', '.join(f'{x:.3g}' for x in w.get('round_p50_ms') or [])} ms): the "
                      "figures are rough; benchmark on a quiet machine before deciding", highlight=False)
    pick = bench.get("recommendation")
    unclear = bench.get("no_clear_winner") or []
    if pick:
        console.print(f"[bold]recommended[/]: {pick['artifact']} at batch {pick['batch']} — {pick['reason']}",
                      highlight=False)
    elif unclear:
        console.print("[yellow]no clear winner[/]: " + "; ".join(u["reason"] for u in unclear), highlight=False)
    elif rows:
        console.print("[yellow]no recommendation[/]: no verified artifact was measured", highlight=False)
