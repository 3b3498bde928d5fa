"""The ONNX exporter's decomposition skipped where it has nothing to do (issue 24,
`workers/engine/exporters/onnx_ready.py`), over the test corpus.

Each model is converted to ONNX in this process (default passes and verification), alternately
with the fast path and with the exporter's own decomposition, after one untimed conversion of
each; the export stage's seconds (manifest.json `timings_s`) are compared as medians, and the two
ONNX files are run on the same input.

    python bench/bench_onnx_ready.py              # writes the "onnx_ready" section of docs/benchmarks.md
    python bench/bench_onnx_ready.py --quick      # 2 rounds, prints only
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import uuid
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._report import machine, write_section  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="2 rounds; do not write the section")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("models", nargs="*", help="corpus names (default: all)")
    opts = parser.parse_args()
    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    rounds = 2 if opts.quick else opts.rounds

    import numpy as np
    import onnxruntime as ort

    import tests.models as corpus
    from fxport.spec import parse_spec
    from fxport.workers.engine.exporters import onnx_ready
    from fxport.workers.engine.pipeline import convert_request
    from fxport.workers.engine.request import EngineRequest
    from tests.workers.engine.conftest import save_pt2, spec_dict

    wrapper = onnx_ready.install()
    assert wrapper is not None, "onnx_ready does not know this torch's exporter"
    names = opts.models or [c.name for c in corpus._CASES]
    rows = []
    with tempfile.TemporaryDirectory(prefix="fxport-onnx-ready-") as tmp:
        for name in names:
            case = corpus.get(name)
            spec = parse_spec(spec_dict(case, targets=("onnx",)))
            model = save_pt2(case, Path(tmp) / f"{name}.pt2")
            export: dict[str, list[float]] = {"ready": [], "decomposed": []}
            outcome = onnx_ready.Readiness(None)
            for r in range(rounds + 1):  # round 0 is the untimed warm-up
                for mode in ("ready", "decomposed") if r % 2 else ("decomposed", "ready"):
                    wrapper.enabled = mode == "ready"
                    out = Path(tmp) / f"{name}-{mode}-{r}"
                    convert_request(EngineRequest(model_path=model, spec=spec, out_dir=out,
                                                  job_id=f"bench-{uuid.uuid4().hex[:8]}"))
                    if mode == "ready":
                        outcome = wrapper.last
                    if r:
                        export[mode].append(json.loads((out / "manifest.json").read_text())["timings_s"]["export"])
            wrapper.enabled = True
            x = [t.numpy() for t in case.example_inputs(3)]
            results = []
            for mode in ("ready", "decomposed"):
                session = ort.InferenceSession(str(Path(tmp) / f"{name}-{mode}-1" / "model.onnx"),
                                               providers=["CPUExecutionProvider"])
                results.append(session.run(None, {i.name: v for i, v in zip(session.get_inputs(), x)}))
            diff = max(float(np.abs(a.astype(np.float64) - b).max()) for a, b in zip(*results))
            ready, decomposed = statistics.median(export["ready"]), statistics.median(export["decomposed"])
            rows.append((name, outcome, ready, decomposed, diff))
            print(f"{name}: {ready:.2f} s vs {decomposed:.2f} s, {outcome.declined or 'ready'}", file=sys.stderr)
    load = os.getloadavg()[0]

    lines = [
        "## ONNX without a needless decomposition (issue 24, `bench/bench_onnx_ready.py`)",
        "",
        f"Machine: {machine()}. 1-minute load average {load:.2f} at the end.",
        "",
        "Every model of the test corpus converted to ONNX in one process (default passes and "
        "verification), alternately with fxport's fast path (`exporters/onnx_ready.py`: the program "
        "handed to the exporter as it is, after a few rewrites, when every node has an ONNX "
        "translation) and with the exporter's own decomposition (torch.export's re-trace of the "
        f"whole program); {rounds} rounds after one untimed conversion of each, medians of the "
        "export stage. The last column runs both ONNX files on the same batch-3 input. A declined "
        "model does the same work both ways (the check takes 0.2-3 ms), so its ratio is this "
        "machine's noise.",
        "",
        "| model | fast path | export s, fast path | export s, decomposition | ratio | max abs diff, file to file |",
        "|---|---|---|---|---|---|",
    ]
    for name, outcome, ready, decomposed, diff in rows:
        taken = (f"taken, {outcome.nodes_changed} node(s) rewritten" if outcome.program is not None
                 else f"declined: {outcome.declined}")
        lines.append(f"| {name} | {taken} | {ready:.2f} | {decomposed:.2f} | {ready / decomposed:.2f}x | {diff:.2g} |")
    section = "\n".join(lines)
    print(section)
    if not opts.quick:
        write_section("onnx_ready", section)


if __name__ == "__main__":
    main()
