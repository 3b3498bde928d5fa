"""The model card of a package (its README.md): what the model is, what it takes and returns, how
each artifact was verified, how fast each ran, which to deploy, and the digests that tie it all
to the job. Everything comes from the job's manifest; what fxport could not decide is listed."""

from __future__ import annotations

from typing import Any

from fxport.manifest import Manifest
from fxport.serving.signature import model_signature
from fxport.serving.triton import BACKENDS, TritonPackage


def _cell(value: Any) -> str:
    text = "—" if value is None or value == "" else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(_cell(c) for c in row) + " |" for row in rows), ""]


def _num(value: Any, spec: str) -> str | None:
    return None if value is None else format(value, spec)


def model_card(manifest: Manifest, package: TritonPackage) -> str:
    sig = manifest.signature or model_signature(manifest.inputs, manifest.outputs)
    assert sig is not None  # plan_repository refused a manifest without one
    lines = [f"# {package.name}", "",
             f"A Triton Inference Server model repository written by fxport {manifest.fxport_version or ''} from a "
             f"{manifest.input.format or 'model'} upload (sha256 `{manifest.input.sha256}`), converted with precision "
             f"`{manifest.spec.get('precision', 'fp32')}`. The job that made it is named in its manifest.json.", "",
             "## Models", ""]
    lines += _table(["model", "platform", "instance", "max_batch_size", "artifact sha256", "samples", ""],
                    [[f"`{m.name}`", BACKENDS[m.artifact].platform, m.kind, m.max_batch_size, f"`{m.sha256}`",
                      "samples.npz" if m.samples else None, "**recommended**" if m.recommended else None]
                     for m in package.models])
    for fmt, why in package.skipped.items():
        lines.append(f"- `{fmt}` is not served: {why}.")
    lines += ["", "## Signature", ""]
    rows = [["input", t.name, t.dtype, f"[{', '.join(map(str, t.shape or []))}]"] for t in sig.inputs]
    rows += [["output", t.name, t.dtype, f"[{', '.join(map(str, t.shape or []))}]" if t.shape is not None else None]
             for t in sig.outputs]
    lines += _table(["", "name", "dtype", "shape"], rows)
    if sig.dynamic_dims:
        lines.append("Dynamic dims: " + ", ".join(f"`{n}` {r.get('min')}..{r.get('max')} (opt {r.get('opt')})"
                                                  for n, r in sig.dynamic_dims.items()) + ".")
    lines += [f"Batch axis: {sig.batch.note or 'none'}.", ""]
    if any(m.artifact == "torchscript" for m in package.models):
        lines += ["The TorchScript model's tensors are named `<name>__<index>`, as Triton's PyTorch backend binds "
                  "them by position.", ""]
    lines += ["## Verification", "",
              "Each artifact against the original model, in its own runtime, at the shapes listed:", ""]
    lines += _table(["artifact", "runtime", "verdict", "max abs diff", "cosine", "shapes checked"],
                    [[v.format, v.runtime, v.verdict or ("passed" if v.passed else "failed"),
                      _num(v.max_abs_diff, ".3g"), _num(v.cosine, ".7f"), len(v.shapes_checked)]
                     for v in manifest.verification])
    tolerances = next((getattr(v, "tolerances", None) for v in manifest.verification
                       if getattr(v, "tolerances", None)), None)
    if isinstance(tolerances, dict) and tolerances.get("rule"):
        lines += [f"Rule: {tolerances['rule']} (atol {tolerances.get('atol')}, rtol {tolerances.get('rtol')}, "
                  f"min cosine {tolerances.get('min_cosine')}).", ""]
    if any(m.samples for m in package.models):
        lines += ["`samples.npz` in each model folder holds sample inputs (`inputs/<tensor>`) and the original "
                  "model's outputs for them (`outputs/<tensor>`), under the names that model serves. They are "
                  "the first input verification checked each artifact with, so each model reproduces them "
                  "within the rule above.", ""]
    bench = manifest.benchmark.as_dict() if manifest.benchmark else {}
    if bench.get("results"):
        lines += ["## Benchmark", "", f"On {((bench.get('machine') or {}).get('cpu')) or 'the worker'}:", ""]
        lines += _table(["artifact", "batch", "p50 ms", "p95 ms", "throughput /s"],
                        [[r.get("artifact"), r.get("batch"), _num(r.get("p50_ms"), ".3f"), _num(r.get("p95_ms"), ".3f"),
                          _num(r.get("throughput_per_s"), ".1f")] for r in bench["results"]])
        rec = bench.get("recommendation") or {}
        if rec:
            lines += [f"Recommended: **{rec.get('artifact')}** at batch {rec.get('batch')}: {rec.get('reason', '')}",
                      ""]
    lines += ["## Validated here", "", f"- Every `config.pbtxt` parses into {package.validated_with}, and passes "
              "the checks Triton makes at load on names, data types, dims, batching and warm-up.",
              "- Every model file matches the sha256 the job recorded.",
              "- Not validated here: loading the repository in a running Triton server.", ""]
    if package.notes:
        lines += ["## Not decided by fxport", "", *(f"- {note}" for note in package.notes), ""]
    lines += ["## Provenance", ""]
    lines += _table(["what", "sha256"], [["model upload", f"`{manifest.input.sha256}`"],
                                         *[[a.path, f"`{a.sha256}`"] for a in manifest.artifacts
                                           if a.format in BACKENDS]])
    toolchain = ", ".join(f"{k} {v}" for k, v in sorted(manifest.toolchain.items()) if isinstance(v, str))
    if toolchain:
        lines += [f"Toolchain: {toolchain}.", ""]
    return "\n".join(lines)
