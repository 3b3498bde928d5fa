"""Model-bytes benchmark (issue 44 item 7): how each stage's time and the peak memory grow with the weights.

A stack of LAYERS wide Linear → ReLU blocks, its width chosen so that the float32 weights come to the
bytes asked (100 MB … 2.5 GB; the ONNX exporter writes the weights to a data file beside the model
and fxport streams them into one file, exporters/onnx.py `as_one_file`) while the graph stays the same
41 nodes; saved as .pt2 (dynamic batch), each converted by the
engine (`convert`: default passes, targets torchscript, onnx and exported_program, verified) in a
fresh subprocess, timed per stage from the manifest's `timings_s`, per target from the engine's
progress events, and the ONNX target's pieces by timing their calls (PIECES). The subprocess reports
its peak RSS (ru_maxrss) at the end of each step and its RSS before the conversion. Prints the
log-log slope of each figure and of the peak RSS against the weights' bytes (1 = linear).

One ONNX file holds at most 2 GiB (protobuf's limit), and spec.onnx.single_file is true by default:
past it fxport refuses the ONNX target (exporters/onnx.py `as_one_file`). At such a size the
conversion runs twice: ONNX alone as the spec's default asks (the refusal, recorded), and every
target with onnx.single_file false (model.onnx + model.onnx.data), which is the row in the table.

    python bench/bench_model_bytes.py --quick        # 100 and 250 MB, prints only (≤ 2 min)
    python bench/bench_model_bytes.py                # 100 MB → 2.5 GB, writes the section
    python bench/bench_model_bytes.py --sizes 1e9 --profile 25   # cProfile of the conversion, top 25
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import math
import os
import pstats
import resource
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))

from bench._sizes import STAGES, run_child, slope, timed_convert  # noqa: E402

LAYERS = 8
QUICK_SIZES = (100e6, 250e6)
FULL_SIZES = (100e6, 250e6, 500e6, 1e9, 1.8e9, 2.5e9)
TARGETS = ("torchscript", "onnx", "exported_program")
PROTOBUF_LIMIT = 2 << 30  # as exporters/onnx.py: one protobuf message, one ONNX file
GIB = 1 << 30
# What the ONNX target does within its export and verify seconds, and the artifacts' sha256 (the
# manifest's records, after the last target): each call timed in the subprocess (`Timed`)
PIECES = {
    "torch.onnx.export": ("torch.onnx", "export"),
    "onnx.checker": ("onnx.checker", "check_model"),
    "finish_onnx": ("fxport.workers.engine.exporters.interface", "finish_onnx"),
    "as_one_file": ("fxport.workers.engine.exporters.onnx", "as_one_file"),
    "sha256": ("fxport.workers.engine.pipeline", "records_of"),
    "ort session": ("onnxruntime", "InferenceSession"),
}


# --------------------------------------------------------------------------------------
# In the subprocess: the model of a size; one conversion of it
# --------------------------------------------------------------------------------------


def width_for(nbytes: float, layers: int = LAYERS) -> int:
    """The width W whose `layers` Linear(W, W) (weight and bias, float32) come nearest `nbytes`."""
    per_layer = nbytes / layers / 4  # floats: W² + W
    return max(1, round((-1 + (1 + 4 * per_layer) ** 0.5) / 2))


def wide_stack(width: int, layers: int = LAYERS) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for i in range(layers):
        blocks.append(nn.Linear(width, width))
        if i < layers - 1:
            blocks.append(nn.ReLU())
    return nn.Sequential(*blocks).eval()


def weight_bytes(model: Any) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def save_model(nbytes: float, path: Path) -> dict:
    """The stack of `nbytes` saved as a .pt2 with a dynamic batch; its width and bytes."""
    import torch

    torch.set_num_threads(1)
    width = width_for(nbytes)
    model = wide_stack(width)
    batch = torch.export.Dim("batch", min=1, max=8)
    t0 = time.perf_counter()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        ep = torch.export.export(model, (torch.randn(2, width),), dynamic_shapes=({0: batch},))
        torch.export.save(ep, str(path))
    return {"width": width, "weight_bytes": weight_bytes(model), "file_bytes": path.stat().st_size,
            "save_s": time.perf_counter() - t0}


def _rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


class Timed:
    """While entered, `module.name` is a wrapper that adds up the seconds of its calls and keeps the peak
    RSS at their end (its callers look it up on the module at each call)."""

    def __init__(self, module_name: str, name: str) -> None:
        import importlib

        self.module, self.name = importlib.import_module(module_name), name
        self.original = getattr(self.module, name)
        self.seconds, self.peak = 0.0, 0

    def __enter__(self) -> Timed:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return self.original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
                self.peak = _peak_bytes()

        setattr(self.module, self.name, timed)
        return self

    def __exit__(self, *exc: object) -> None:
        setattr(self.module, self.name, self.original)


class StageClock:
    """The engine's progress events, timed: each stage's peak RSS so far at its end, and the seconds
    of each target within the export and verify stages (from the event naming it to the next)."""

    def __init__(self) -> None:
        self.events: list[tuple[float, str, float, str, int]] = []

    def __call__(self, event: dict) -> None:
        self.events.append((time.perf_counter(), event["stage"], event["progress"], event["message"], _peak_bytes()))

    def peaks(self) -> dict[str, int]:
        return {stage: peak for _, stage, progress, message, peak in self.events
                if progress == 1.0 and message == "done"}

    def per_target(self, stage: str) -> tuple[dict[str, float], dict[str, int]]:
        """Seconds from each event of `stage` naming a target to the next event of that stage, and the peak
        RSS at that next event; before the first such event, `setup` (the verify stage's reference outputs
        and sample points)."""
        mine = [(t, message, peak) for t, name, _, message, peak in self.events if name == stage]
        seconds: dict[str, float] = {}
        peaks: dict[str, int] = {}
        for (t, message, _), (t_next, _, peak) in zip(mine, mine[1:]):
            key = message if message in TARGETS else "setup" if not seconds else None
            if key is not None:
                seconds[key] = seconds.get(key, 0.0) + t_next - t
                peaks[key] = peak
        return seconds, peaks


def measure(model_path: Path, out_dir: Path, width: int, targets: list[str], single_file: bool,
            profile_top: int = 0) -> dict:
    import torch

    from fxport.errors import FxportError
    from fxport.spec import parse_spec
    from fxport.workers.engine.warm_caches import cache_pt2_type_hints

    torch.set_num_threads(1)
    cache_pt2_type_hints()  # as a worker's zygote does
    spec = parse_spec({
        "inputs": [{"name": "input", "shape": ["batch", width], "dtype": "float32"}],
        "dynamic_dims": {"batch": {"min": 1, "opt": 2, "max": 8}},
        "targets": targets, "verify": {"samples": 2}, "onnx": {"single_file": single_file},
    })
    clock, error = StageClock(), None
    pieces = {name: Timed(*where) for name, where in PIECES.items()}
    timers = contextlib.ExitStack()
    for piece in pieces.values():
        timers.enter_context(piece)
    rss_before = _rss_bytes()
    profiler = cProfile.Profile() if profile_top else None
    t0 = time.perf_counter()
    try:
        if profiler is not None:
            profiler.enable()
        manifest, total = timed_convert(model_path, spec, out_dir, on_progress=clock)
    except FxportError as exc:
        total = time.perf_counter() - t0
        manifest = json.loads((out_dir / "manifest.json").read_text())
        error = f"{type(exc).__name__} at {exc.stage}: {exc}"
    finally:
        if profiler is not None:
            profiler.disable()
        timers.close()
    (export_s, export_peak), (verify_s, verify_peak) = clock.per_target("export"), clock.per_target("verify")
    if export_s:  # the artifacts' records (their sha256) are taken after the last target's event
        export_s[next(reversed(export_s))] -= pieces["sha256"].seconds
    result = {
        "timings_s": manifest["timings_s"], "total_s": total, "error": error,
        "export_s": export_s, "verify_s": verify_s, "pieces_s": {k: v.seconds for k, v in pieces.items()},
        "pieces_peak": {k: v.peak for k, v in pieces.items()},
        "rss_before": rss_before, "peak_rss": _peak_bytes(), "peak_by_stage": clock.peaks(),
        "peak_by_target": {"export": export_peak, "verify": verify_peak},
        "verified": {v["format"]: v["passed"] for v in manifest.get("verification") or []},
        "nodes": (manifest.get("graph_before") or {}).get("node_count"),
        "artifact_bytes": {a["path"]: a["bytes"] for a in manifest.get("artifacts") or []},
        "onnx_notes": [w for w in manifest.get("warnings") or [] if w.startswith("onnx")],
    }
    if profiler is not None:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(profile_top)
        result["profile"] = text.getvalue()
    return result


# --------------------------------------------------------------------------------------
# In the parent: the sizes, the table
# --------------------------------------------------------------------------------------


def available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def wait_for_memory(need: float, patience_s: float = 1800) -> None:
    """Wait (up to `patience_s`) until `need` bytes are available: the machine is shared."""
    deadline = time.monotonic() + patience_s
    while available_bytes() < need:
        if time.monotonic() > deadline:
            raise SystemExit(f"{available_bytes() / GIB:.1f} GiB available, {need / GIB:.1f} GiB needed: not run")
        print(f"waiting for memory: {available_bytes() / GIB:.1f} GiB available, {need / GIB:.1f} GiB needed",
              file=sys.stderr, flush=True)
        time.sleep(30)


def child(args: list[str], what: str) -> dict:
    return run_child(Path(__file__).resolve(), args, what)


def run_size(nbytes: float, tmp_dir: Path, profile_top: int) -> dict:
    wait_for_memory(1.5 * GIB + 5 * nbytes)
    model_path = tmp_dir / f"stack{int(nbytes)}.pt2"
    row = child(["--save", str(nbytes), str(model_path)], f"saving {nbytes:.0f} bytes")
    row["asked"] = nbytes
    width, over = str(row["width"]), row["weight_bytes"] >= PROTOBUF_LIMIT
    out_dir = tmp_dir / f"out{int(nbytes)}"
    if over:  # the spec's default first: ONNX alone, in one file
        row["refusal"] = child(["--measure", str(model_path), str(out_dir / "one-file"), width, "onnx", "1"],
                               f"{nbytes:.0f} bytes, onnx in one file")
        wait_for_memory(1.5 * GIB + 5 * nbytes)
    targets = ",".join(TARGETS)
    row["load_avg"] = [os.getloadavg()[0]]  # the machine is shared: how busy it was, before and after
    row["run"] = child(["--measure", str(model_path), str(out_dir / "all"), width, targets, "0" if over else "1",
                        str(profile_top)], f"{nbytes:.0f} bytes")
    row["single_file"] = not over
    row["load_avg"].append(os.getloadavg()[0])
    for path in sorted(tmp_dir.rglob("*"), reverse=True):  # the next size wants the disk and page cache
        if path.is_file() and (path == model_path or out_dir in path.parents):
            path.unlink()
    run = row["run"]
    if run["error"] or not run["verified"] or not all(run["verified"].values()):
        raise SystemExit(f"{nbytes:.0f} bytes: the conversion failed or did not verify: {run}")
    print(f"{row['weight_bytes'] / 1e6:.0f} MB (W={width}): " + ", ".join(
        f"{s} {run['timings_s'].get(s, 0):.2f}" for s in STAGES)
        + f"; peak RSS {run['peak_rss'] / GIB:.2f} GiB", file=sys.stderr, flush=True)
    if "profile" in run:
        print(run["profile"], file=sys.stderr, flush=True)
    return row


def _gib(n: float) -> str:
    return f"{n / GIB:.2f}"


def table(rows: list[dict]) -> list[str]:
    head = ("| weights MB | width | " + " | ".join(f"{s} s" for s in STAGES)
            + " | total s | peak RSS GiB | RSS before GiB | peak / weights | (peak − before) / weights "
            "| load avg before → after |")
    lines = [head, "|" + "---|" * (len(STAGES) + 8)]
    for row in rows:
        run, w = row["run"], row["weight_bytes"]
        cells = [f"{run['timings_s'].get(s, 0.0):.2f}" for s in STAGES]
        lines.append(f"| {w / 1e6:.0f}{'' if row['single_file'] else ' ¹'} | {row['width']} | " + " | ".join(cells)
                     + f" | {run['total_s']:.1f} | {_gib(run['peak_rss'])} | {_gib(run['rss_before'])} | "
                     f"{run['peak_rss'] / w:.2f} | {(run['peak_rss'] - run['rss_before']) / w:.2f} | "
                     + (" → ".join(f"{v:.1f}" for v in row["load_avg"]) if "load_avg" in row else "—") + " |")
    return lines


def figures(run: dict) -> dict[str, float]:
    """A run's seconds by label: each stage, each target's export and verify, the pieces (PIECES), the total."""
    out = {s: run["timings_s"].get(s, 0.0) for s in STAGES}
    out |= {f"export {t}": run["export_s"].get(t, 0.0) for t in TARGETS}
    out |= {f"verify {t}": run["verify_s"].get(t, 0.0) for t in ("setup", *TARGETS)}
    return out | run["pieces_s"] | {"total": run["total_s"]}


def by_target(rows: list[dict]) -> list[str]:
    labels = [*(f"export {t}" for t in TARGETS), "sha256", *(f"verify {t}" for t in ("setup", *TARGETS))]
    lines = ["| weights MB | " + " | ".join(f"{lab} s" for lab in labels) + " |", "|---|" + "---|" * len(labels)]
    for row in rows:
        got = figures(row["run"])
        lines.append(f"| {row['weight_bytes'] / 1e6:.0f} | " + " | ".join(f"{got[lab]:.2f}" for lab in labels) + " |")
    return lines


def onnx_pieces(rows: list[dict]) -> list[str]:
    pieces = [p for p in PIECES if p != "sha256"]
    lines = ["| weights MB | " + " | ".join(f"{p} s" for p in pieces) + " |", "|---|" + "---|" * len(pieces)]
    for row in rows:
        got = row["run"]["pieces_s"]
        lines.append(f"| {row['weight_bytes'] / 1e6:.0f} | " + " | ".join(f"{got[p]:.2f}" for p in pieces) + " |")
    return lines


def peaks(run: dict) -> dict[str, int]:
    """The peak RSS reached by the end of each step of a run, in the order they run."""
    export, verify = run["peak_by_target"]["export"], run["peak_by_target"]["verify"]
    calls = run["pieces_peak"]
    return {"load": run["peak_by_stage"].get("load", 0), "export torchscript": export.get("torchscript", 0),
            **{p: calls[p] for p in ("torch.onnx.export", "onnx.checker", "finish_onnx", "as_one_file")},
            "export exported_program": export.get("exported_program", 0),
            **{f"verify {t}": verify.get(t, 0) for t in TARGETS}}


def peak_setter(run: dict) -> str:
    """The step that raised the peak RSS most."""
    rises, last = {}, run["rss_before"]
    for step, peak in peaks(run).items():
        if peak:
            rises[step], last = peak - last, max(peak, last)
    return max(rises, key=lambda step: rises[step])


def peak_table(rows: list[dict]) -> list[str]:
    steps = list(peaks(rows[0]["run"]))
    lines = ["| weights MB | " + " | ".join(steps) + " | raised most by |", "|---|" + "---|" * (len(steps) + 1)]
    for row in rows:
        got = peaks(row["run"])
        lines.append(f"| {row['weight_bytes'] / 1e6:.0f} | " + " | ".join(
            _gib(got[step]) if got[step] else "—" for step in steps) + f" | {peak_setter(row['run'])} |")
    return lines


ONE_FILE_ONLY = ("as_one_file",)  # work only where the ONNX is one file


def slopes(rows: list[dict]) -> list[tuple[str, float]]:
    """Log-log slope against the weights' bytes of every figure (`figures`) and of the peak RSS; nan where a
    figure is not measured at every size, or is one file's work and not every row's ONNX is one file."""
    xs = [r["weight_bytes"] for r in rows]
    labels = list(figures(rows[0]["run"]))
    series = [(lab, [figures(r["run"])[lab] for r in rows]) for lab in labels]
    series += [("peak RSS", [r["run"]["peak_rss"] for r in rows]),
               ("peak RSS − RSS before", [r["run"]["peak_rss"] - r["run"]["rss_before"] for r in rows])]
    mixed = not all(r.get("single_file", True) for r in rows)
    return [(name, slope(xs, ys) if min(ys) > 0 and not (mixed and name in ONE_FILE_ONLY) else math.nan)
            for name, ys in series]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="100 and 250 MB; do not write the section")
    parser.add_argument("--sizes", type=float, nargs="+", help="weight bytes to run (default: 100 MB → 2.5 GB)")
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="cProfile each conversion, print top N")
    parser.add_argument("--out", type=Path, help="write the section to this file instead of docs/benchmarks.md")
    parser.add_argument("--rows", type=Path, help="also keep the measurements in this JSON file")
    parser.add_argument("--replay", type=Path, help="write the section from a --rows file; measure nothing")
    parser.add_argument("--save", nargs=2, help=argparse.SUPPRESS)  # the subprocesses' jobs
    parser.add_argument("--measure", nargs="+", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.save:
        print(json.dumps(save_model(float(opts.save[0]), Path(opts.save[1]))))
        return
    if opts.measure:
        model, out, width, targets, single, *top = opts.measure
        print(json.dumps(measure(Path(model), Path(out), int(width), targets.split(","), single == "1",
                                 int(top[0]) if top else 0)))
        return

    from bench._report import machine, write_section

    if opts.replay:
        rows = json.loads(opts.replay.read_text())
    else:
        sizes = opts.sizes or (QUICK_SIZES if opts.quick else FULL_SIZES)
        with tempfile.TemporaryDirectory() as tmp:
            rows = [run_size(n, Path(tmp), opts.profile) for n in sizes]
    if opts.rows:
        opts.rows.write_text(json.dumps(rows, indent=1))
    markdown = "\n".join(section(rows, opts, machine()))
    print(markdown)
    if opts.out:
        opts.out.write_text(f"<!-- bench:model_bytes -->\n{markdown}\n<!-- /bench:model_bytes -->\n")
    elif not opts.quick and not opts.sizes:
        write_section("model_bytes", markdown)


def section(rows: list[dict], opts: argparse.Namespace, machine: str) -> list[str]:
    one_file = [r for r in rows if r["single_file"]]
    upper = [r for r in one_file if r["asked"] >= 500e6]
    spans = [("ONNX in one file", one_file)] if 1 < len(one_file) < len(rows) else []
    spans += [("ONNX in one file, from 500 MB", upper)] if 2 < len(upper) < len(one_file) else []
    spans.append(("every row", rows))
    lines = [
        "## Model bytes: stage times and peak memory against the weights (issue 44 item 7)",
        "",
        f"Machine: {machine}; CPU only, torch 1 thread; `python bench/bench_model_bytes.py"
        f"{' --quick' if opts.quick else ''}`. {LAYERS} × Linear(W, W) with ReLU between, float32, "
        f"W chosen for the weights' bytes ({rows[0]['run']['nodes']} graph nodes at every size), saved as .pt2 "
        f"with a dynamic batch; one `convert` per size in a fresh subprocess (default passes, targets "
        f"{', '.join(TARGETS)}, 2 verification samples, every artifact verified), seconds per stage from the "
        "manifest's `timings_s`, the cyclic garbage collector off during the conversion (bench/_sizes.py "
        "`timed_convert`, as in the graph-size benchmark). Peak RSS: the subprocess's ru_maxrss; RSS before: "
        "its RSS after the imports, before `convert`. The machine was shared with other work while this ran (its "
        "1-minute load average before and after each size is in the table).",
        "",
        *table(rows),
        "",
        "By target, from the engine's progress events (from the event naming a target to the next); sha256: "
        "the manifest's records of every artifact, which come after the last target's event (timed apart).",
        "",
        *by_target(rows),
        "",
        "Within the ONNX target, each call timed in the subprocess, in the order they run: the export's "
        "torch.onnx.export, onnx.checker's full check, `finish_onnx` (exporters/interface.py), `as_one_file` "
        "(exporters/onnx.py); verify's onnxruntime session:",
        "",
        *onnx_pieces(rows),
        "",
        "Peak RSS (GiB) reached by the end of each step, in the order they run (— : the step did not run):",
        "",
        *peak_table(rows),
        "",
        "Log-log slope against the weights' bytes (1 = linear), "
        + "; ".join(f"*{name}*: {rs[0]['weight_bytes'] / 1e6:.0f} → {rs[-1]['weight_bytes'] / 1e6:.0f} MB"
                    for name, rs in spans) + ":",
        "",
        "| series | " + " | ".join(name for name, _ in spans) + " |",
        "|---|" + "---|" * len(spans),
    ]
    per_span = [dict(slopes(rs)) for _, rs in spans]
    lines += [f"| {label} | " + " | ".join("—" if math.isnan(values[label]) else f"{values[label]:.2f}"
                                          for values in per_span) + " |" for label in per_span[0]]
    for row in (r for r in rows if "refusal" in r):
        ref = row["refusal"]
        lines += ["", f"¹ {row['weight_bytes'] / 1e6:.0f} MB is past one ONNX file's 2 GiB: with the spec's default "
                  f"(onnx.single_file true) fxport refused the ONNX target after {ref['total_s']:.1f} s (export "
                  f"{ref['timings_s'].get('export', 0.0):.1f} s, peak RSS {_gib(ref['peak_rss'])} GiB): "
                  f"`{ref['error']}`. The row is the conversion with onnx.single_file false (model.onnx + "
                  "model.onnx.data)."]
    notes = {n for r in rows for n in r["run"]["onnx_notes"]}
    if notes:
        lines += ["", "ONNX notes in the manifests: " + "; ".join(sorted(notes)) + "."]
    return lines + ["", *findings(rows, per_span)]


def findings(rows: list[dict], per_span: list[dict[str, float]]) -> list[str]:
    """What the figures come from: each found by timing the calls inside the subprocess (PIECES, `peaks`)."""
    def over(row: dict) -> str:
        return f"{(row['run']['peak_rss'] - row['run']['rss_before']) / row['weight_bytes']:.1f}×"

    one_file = [r for r in rows if r["single_file"]]
    split = [r for r in rows if not r["single_file"]]
    steepest = max(values[stage] for values in per_span for stage in STAGES)
    lines = [
        "Why:",
        "",
        f"- Every stage grows linearly with the bytes or slower (slope at most {steepest:.2f} in any column). "
        "capture and passes do not touch the weights (the same small graph at every size): constant. load "
        "(torch.export.load of a file just written, then `ep.module()`) has a fixed cost of about half a second.",
        "- The ONNX exporter always writes the weights to a data file beside the model; the checker and "
        "`finish_onnx` (names, provenance) read and rewrite the model without them, and `as_one_file` then "
        "streams the data into model.onnx, each tensor copied by the kernel (os.copy_file_range), so no step "
        "of the ONNX target holds the weights in memory"
        + (f": {one_file[-1]['run']['pieces_s']['as_one_file']:.1f} s at {one_file[-1]['weight_bytes'] / 1e6:.0f} MB"
           if one_file else "") + ".",
        "- The pieces whose slope passes 1.2 in a column, if any, are single calls into onnxruntime and onnx's "
        "protobuf, one per conversion, with no fxport loop around them; their cost per byte moved by up to 2× "
        "between runs of this benchmark on the shared machine.",
        f"- Peak RSS: the RSS before + {over(one_file[-1])} the weights at {one_file[-1]['weight_bytes'] / 1e6:.0f} "
        "MB (the *raised most by* column says which step set it). Each runner drops its artifact when its "
        "verification ends, so no two artifacts' weights are loaded at once.",
    ]
    if split:
        lines.append(f"- With onnx.single_file false ({split[-1]['weight_bytes'] / 1e6:.0f} MB): + {over(split[-1])}.")
    return lines


if __name__ == "__main__":
    main()
