"""`fxport convert`: convert a model on this machine, no servers (the newcomer's first try).

A `.pt2`, torch.package or TorchScript file runs code when it is loaded, and a model from the
internet is no more trustworthy on a laptop than on a shared worker. So `convert` runs the
engine in the same sandbox as the workers (a child process with no sockets, reads limited to
Python, its packages and the model, writes to the output folder only; workers/sandbox/), and
this process never loads the model. `--no-sandbox` runs it in this process instead, for a
model the user trusts, and says so.

`--target tensorrt` on a machine that cannot build an engine (no TensorRT, no GPU) does the CPU
stage's part, as a worker does before the GPU queue (`deferred_targets`): it exports the ONNX
model the engine would be built from, runs the TensorRT preflight on it and verifies every other
artifact; then it fails, saying why the engine cannot be built here and where it can. A model
the preflight rejects fails with every op and node it names (exit 1, as `submit --wait` of it
would); one it accepts exits 2 (bad usage: this machine cannot do what was asked). manifest.json
records the preflight either way.

Errors and exit codes are worded and chosen as `fxport submit` words and chooses them
(cli/errors.py): `fxport convert: error during load: ...`.

A conversion that fails keeps no model file in --out, as a failed job on a server stores none
(README, "What a conversion does"): the engine withdraws what it wrote, and this process does it
again for a child that was killed before it could. manifest.json and report.html stay, and the
result document lists what was built under `withdrawn`. A target that could not be built fails
the conversion (exit 1) unless --allow-partial (spec allow_partial: true) accepts the others.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from fxport.cli.errors import CannotRunHere, error_doc, print_error
from fxport.cli.progress import StageProgress
from fxport.cli.spec_options import NO_FLAGS, SpecFlags, with_spec_flags
from fxport.errors import EXIT_FAILED, EXIT_OK, EXIT_USAGE, ConversionFailed, FxportError, InvalidInput
from fxport.spec import JobSpec, parse_spec

# Set once `convert --no-sandbox` has imported torch and run the engine in this process: the
# console entry point (cli.main) then ends the process without Python's teardown.
ENGINE_RAN_HERE = threading.Event()


@with_spec_flags
def convert_command(
    model: Path = typer.Argument(..., help="Model file: .pt2 (torch.export), torch.package, TorchScript, or ONNX."),
    flags: SpecFlags = NO_FLAGS,  # --spec, --target, --capture, ...: cli/spec_options.py, shared with `submit`
    calibration: Path | None = typer.Option(None, "--calibration", help="Calibration data (.npz/.safetensors)."),
    out: Path = typer.Option(Path("fxport-out"), "--out", "-o", help="Output folder for artifacts + manifest.json."),
    as_json: bool = typer.Option(False, "--json", help="Print the result document on stdout and nothing else "
                                 "(`fxport schema result`; the manifest is out/manifest.json)."),
    junit: Path | None = typer.Option(None, "--junit", help="Write a JUnit XML report here: one testcase per "
                                      "artifact check."),
    no_sandbox: bool = typer.Option(False, "--no-sandbox", help="Load and run the model in this process, outside "
                                    "the sandbox: only for a model you trust (it runs with your rights)."),
) -> None:
    """Convert a model in a sandbox and verify every artifact against it."""
    err = Console(stderr=True)
    try:
        job_spec = parse_spec(flags.to_spec())
        if not model.is_file():
            raise InvalidInput(f"model file {str(model)!r} not found", field="model")  # as `submit` says it
    except FxportError as exc:
        _fail(exc, err, as_json, code=EXIT_USAGE)
        return

    # No TensorRT or no GPU here: the CPU stage's part of a tensorrt job, then a clear error.
    no_engine = _engine_unavailable(job_spec)
    from fxport.workers.engine.request import EngineRequest

    request = EngineRequest(model_path=model, spec=job_spec, out_dir=out, job_id=f"local-{uuid.uuid4().hex[:12]}",
                            calibration_path=calibration, deferred_targets=("tensorrt",) if no_engine else ())
    manifest: dict[str, Any] | None = None
    started = time.time()
    try:
        # Progress goes to stderr with --json too, as `submit --wait --json` prints it.
        with StageProgress(err, enabled=True) as progress:
            if no_sandbox:
                from fxport.toolchain import configured_op_libraries
                from fxport.workers.engine.pipeline import convert_request
                from fxport.workers.sandbox.child import load_op_libraries

                err.print("[yellow]warning:[/] --no-sandbox: the model is loaded and run in this process, with your "
                          "rights (its pickles can run any code); use it only for a model you trust", highlight=False)
                ENGINE_RAN_HERE.set()
                load_op_libraries(configured_op_libraries())  # FXPORT_OP_LIBRARIES, as the sandbox loads them
                manifest = convert_request(request, on_progress=progress).to_dict()
            else:
                from fxport.workers.sandbox import run_engine_job

                # A fresh interpreter, not a warm zygote: one job pays one `import torch` either way.
                manifest = run_engine_job(request, on_progress=progress, warm=False).to_dict()
    except FxportError as exc:
        if no_engine is not None and exc.stage == "tensorrt":  # the CPU stage's only tensorrt step: the preflight
            exc = _preflight_rejected(out, exc, no_engine)
        _withdraw_outputs(out)
        written = _read_manifest(out)
        if written is not None:
            _report(written, out, exit_code=exc.exit_code or EXIT_FAILED, as_json=as_json, junit=junit,
                    started=started)
        _fail(exc, err, as_json, code=exc.exit_code, quiet_stdout=written is not None)
        return
    failure: FxportError | None = None
    if no_engine is not None:
        failure = _engine_not_built(out, no_engine, model)
        manifest = _read_manifest(out) or manifest
    assert manifest is not None
    _report(manifest, out, exit_code=failure.exit_code if failure else EXIT_OK, as_json=as_json, junit=junit,
            started=started)
    if not as_json:
        from fxport.cli.result_table import render_manifest

        render_manifest(manifest, Console())
        if failure is None:
            Console().print(f"[green]ok[/]: artifacts and manifest.json in {out}/")
    if failure is not None:
        _fail(failure, err, as_json, code=failure.exit_code, quiet_stdout=True)
    raise typer.Exit(EXIT_OK)


def _report(manifest: dict[str, Any], out: Path, *, exit_code: int, as_json: bool, junit: Path | None,
            started: float) -> None:
    """The conversion's result: as the result document (--json), a JUnit file, and the CI step summary."""
    from fxport.ci_report import append_step_summary, write_junit
    from fxport.results import from_manifest

    result = from_manifest("convert", manifest, exit_code=exit_code, manifest_path=str(out / "manifest.json"),
                           started=started, finished=time.time(), kept=_kept(out, manifest))
    if as_json:
        sys.stdout.write(result.to_json() + "\n")
    if junit is not None:
        write_junit(result, junit)
    append_step_summary(result)


def _withdraw_outputs(out: Path) -> None:
    """No model file stays in --out after a failed conversion: the engine removed what it wrote
    (pipeline.convert_request); this covers a sandbox child killed before it could (time, memory)
    and a failure found after it exited (an artifact that does not match its digest)."""
    from fxport.workers.engine.publish import output_names, withdraw

    withdraw(out, output_names())


def _kept(out: Path, manifest: dict[str, Any]) -> set[str]:
    """The paths of the manifest's artifacts that are in --out (the rest were withdrawn)."""
    paths = {a.get("path") for a in manifest.get("artifacts") or () if isinstance(a, dict)}
    return {p for p in paths if isinstance(p, str) and (out / p).is_file()}


def _fail(exc: FxportError, err: Console, as_json: bool, *, code: int, quiet_stdout: bool = False) -> None:
    """`fxport convert: error[ during STAGE]: ...` on stderr, worded as every command words it;
    with --json the error document on stdout unless the manifest went there."""
    print_error(err, "convert", exc)
    if as_json and not quiet_stdout:
        sys.stdout.write(json.dumps(error_doc("convert", exc)) + "\n")
    raise typer.Exit(code if code else EXIT_FAILED)


# ---------------------------------------------------------------------------------------
# --target tensorrt where no engine can be built
# ---------------------------------------------------------------------------------------

GPU_SERVER_HINT = "an fxport server with a GPU worker (queue gpu)"


def _engine_unavailable(spec: JobSpec) -> str | None:
    """Why this machine cannot build the TensorRT engine the spec asks for; None when it can
    (or when the spec asks for none)."""
    if "tensorrt" not in spec.targets:
        return None
    from fxport.workers.engine.tensorrt.builder import tensorrt_unavailable

    return tensorrt_unavailable()


def _read_manifest(out: Path) -> dict[str, Any] | None:
    """out/manifest.json as the engine (or the sandboxed model) left it: read without following
    a link and within the sandbox's bound; None when there is none to read."""
    from fxport.workers.sandbox import beneath
    from fxport.workers.sandbox.run import MAX_MANIFEST_BYTES

    try:
        with beneath.opened_dir(out) as fd:
            data = json.loads(beneath.read_bounded(fd, "manifest.json", MAX_MANIFEST_BYTES, "manifest.json"))
    except (OSError, ValueError, RecursionError, FxportError):
        return None
    return data if isinstance(data, dict) else None


def _record_failure(out: Path, manifest: dict[str, Any], exc: FxportError) -> None:
    """The command's own failure into manifest.json (never written through a link), and report.html redrawn."""
    from fxport.workers.sandbox import beneath
    from fxport.workers.sandbox.run import draw_report

    manifest["status"] = "failed"
    manifest["error"] = exc.to_dict()
    try:
        with beneath.opened_dir(out) as fd:
            beneath.replace_file(fd, "manifest.json", json.dumps(manifest, indent=2, default=str).encode())
    except (OSError, FxportError):
        return
    draw_report(out)


def _preflight_rejected(out: Path, exc: FxportError, why: str) -> FxportError:
    """The preflight rejected the ONNX model: every op and node it names, then why the engine
    could not be built here anyway. A conversion failure (exit 1), as on a server."""
    from fxport.workers.engine.tensorrt.preflight import Finding

    manifest = _read_manifest(out)
    pre = ((manifest or {}).get("tensorrt") or {}).get("preflight") or {}
    findings = []
    for item in pre.get("errors") or ():
        if isinstance(item, dict):
            fields: dict[str, Any] = {k: str(item.get(k) or "") for k in ("severity", "node", "op_type", "reason",
                                                                          "where")}
            findings.append(Finding(**fields))
    if manifest is None or not findings:
        return exc  # not the preflight's failure after all: as the engine said it
    listed = "\n".join(f"  {f.describe()}" for f in findings)
    failure = ConversionFailed(
        f"TensorRT preflight against the {pre.get('checked_against') or 'TensorRT ONNX parser'}: {len(findings)} "
        f"problem(s) in the ONNX model the engine would be built from:\n{listed}\n"
        f"and the engine cannot be built on this machine either: {why}",
        stage="tensorrt", field="targets",
        hint="change the model so the ops above are not exported (an equivalent torch op that exports to a "
             f"supported ONNX op), or drop tensorrt from targets; the engine itself builds on {GPU_SERVER_HINT}",
        detail=exc.detail,
    )
    _record_failure(out, manifest, failure)
    return failure


def _engine_not_built(out: Path, why: str, model: Path) -> FxportError:
    """The CPU stage passed (ONNX model exported and preflighted, the rest verified): the engine
    is all that is left, and this machine cannot build it. Bad usage here (exit 2)."""
    manifest = _read_manifest(out) or {}
    pre = (manifest.get("tensorrt") or {}).get("preflight") or {}
    paths = {a.get("path") for a in manifest.get("artifacts") or () if isinstance(a, dict)}
    onnx_name = "model.tensorrt.onnx" if "model.tensorrt.onnx" in paths else "model.onnx"
    warned = len(pre.get("warnings") or ())
    checked = (f"passed the TensorRT preflight against the {pre.get('checked_against')}: {pre.get('nodes')} node(s)"
               + (f", {warned} warning(s) in manifest.json" if warned else ", no warnings")) if pre else "was written"
    failure = CannotRunHere(
        f"the TensorRT engine cannot be built on this machine: {why}. The ONNX model it would be built from, "
        f"{out / onnx_name}, {checked}; the other artifacts are in {out}/",
        stage="tensorrt", field="targets",
        hint=f"build the engine on {GPU_SERVER_HINT}: fxport submit {model} --target tensorrt "
             "--server HOST:PORT with the same spec flags; or drop tensorrt from targets",
    )
    if manifest:
        _record_failure(out, manifest, failure)
    return failure
