"""BatchNorm folding benchmark (issue 21 item 2): a LeViT-style model, whose BatchNorm1d sit
behind a flatten (Linear → flatten(0, 1) → BatchNorm1d → reshape, timm's LinearNorm).

fuse_conv_bn before the look-through (`look_through=False`: only a BatchNorm right after its
Conv/Linear folds) and after, at both IR levels, against the eager model: how many BatchNorms
each folds, and inference latency measured side by side in one process, round-robin, as ratios.

    python bench/bench_fold_bn.py                  # writes the "fold_bn" section of docs/benchmarks.md
    python bench/bench_fold_bn.py --out FILE.md    # writes the section to FILE.md instead
    python bench/bench_fold_bn.py --quick          # fewer runs, prints only
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._report import machine, write_section  # noqa: E402
from bench.bench_engine import latency_ms  # noqa: E402
from fxport.pass_catalog import FuseConvBnOptions  # noqa: E402
from fxport.workers.engine.passes.fuse_conv_bn import fuse_conv_bn  # noqa: E402
from tests.workers.passes.conftest import capture, context, randomize_batchnorm  # noqa: E402
from tests.workers.passes.test_fuse_conv_bn import LeViTStyle, batchnorm_left  # noqa: E402

# levit_128s-like widths at 112x112: 196 tokens after the stride-8 stem (timm's is stride 16 at 224)
MODEL = {"img": 112, "dim": 128, "depth": 4, "heads": 4, "key_dim": 16}
BATCHES = (1, 8)


def folded(model: torch.nn.Module, args: tuple, level: str, look_through: bool):
    """The model captured at `level` with fuse_conv_bn applied; its notes; BatchNorms before, left."""
    gm = capture(model, args, level)
    before = len(batchnorm_left(gm))
    with torch.no_grad():
        result = fuse_conv_bn(gm, FuseConvBnOptions(), context(level, args), look_through=look_through)
    return result.graph_module, result.notes, before, len(batchnorm_left(result.graph_module))


def max_abs_diff(fn, model: torch.nn.Module, args: tuple) -> float:
    with torch.no_grad():
        return (fn(*args) - model(*args)).abs().max().item()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer runs; do not write the section")
    parser.add_argument("--out", type=Path, help="write the section to this file instead of docs/benchmarks.md")
    opts = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    # two cores shared with other work: one thread keeps the figures comparable
    torch.set_num_threads(1)
    runs = 5 if opts.quick else 30

    model = randomize_batchnorm(LeViTStyle(**MODEL)).eval()
    example = (torch.randn(2, 3, MODEL["img"], MODEL["img"]),)
    rows, counts, notes = [], [], {}
    for level in ("aten", "torch"):
        variants = {"eager": model}
        for look_through, label in ((False, "before"), (True, "after")):
            gm, note, before, left = folded(model, example, level, look_through)
            variants[label] = gm
            counts.append((level, label, before, before - left, left))
            notes[(level, label)] = note
        for batch in BATCHES:
            x = (torch.randn(batch, 3, MODEL["img"], MODEL["img"]),)
            with torch.no_grad():
                ms = latency_ms(variants, x, runs=runs)
            diff = max(max_abs_diff(variants[k], model, x) for k in ("before", "after"))
            rows.append((level, batch, ms["eager"], ms["before"], ms["after"], diff))
    load = os.getloadavg()[0]

    params = ", ".join(f"{k}={v}" for k, v in MODEL.items())
    lines = [
        "## BatchNorm folding through shape ops (issue 21 item 2): LeViT-style model",
        "",
        f"Machine: {machine()}. torch {torch.__version__}, 1 torch thread, 1-minute load average "
        f"{load:.2f} at the end. Model: `LeViTStyle({params})` from tests/workers/passes/test_fuse_conv_bn.py "
        "(ConvNorm stem, attention + MLP blocks built of timm-style LinearNorm: Linear → flatten(0, 1) → "
        "BatchNorm1d → reshape_as). *before* = fuse_conv_bn with `look_through=False` (the pass before this "
        "item), *after* = fuse_conv_bn as shipped. aten = `torch.export(...).module()` with a dynamic batch, "
        "torch = `torch.fx.symbolic_trace`.",
        "",
        "| level | pass | BatchNorms | folded | left |", "|---|---|---|---|---|",
        *[f"| {lvl} | {label} | {n} | {f} | {left} |" for lvl, label, n, f, left in counts],
        "",
        f"Inference latency, median of {runs} round-robin runs per batch size in one process "
        "(eager, before, after measured alternately):",
        "",
        "| level | batch | eager ms | before ms | after ms | before / eager | after / eager | after / before "
        "| max abs diff to eager |",
        "|---|---|---|---|---|---|---|---|---|",
        *[f"| {lvl} | {b} | {e:.2f} | {bf:.2f} | {af:.2f} | {bf / e:.2f} | {af / e:.2f} | {af / bf:.2f} | {d:.1e} |"
          for lvl, b, e, bf, af, d in rows],
        "",
        f"`fuse_conv_bn` notes (aten, after): {notes[('aten', 'after')]}",
        "",
        f"`fuse_conv_bn` notes (aten, before): {notes[('aten', 'before')]}",
    ]
    markdown = "\n".join(lines)
    print(markdown)
    if opts.out:
        opts.out.write_text(f"<!-- bench:fold_bn -->\n{markdown}\n<!-- /bench:fold_bn -->\n")
    elif not opts.quick:
        write_section("fold_bn", markdown)


if __name__ == "__main__":
    main()
