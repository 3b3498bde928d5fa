"""`fxport convert`: convert a model on this machine, no servers (the newcomer's first try).

A `.pt2`, torch.package or TorchScript file runs code when it is loaded, and a model from the
internet is no more trustworthy on a laptop than on a shared worker. So `convert` runs the
engine in the same sandbox as the workers (a child process with no sockets, reads limited to
Python, its packages and the model, writes to the output folder only; workers/sandbox/), and
this process never loads the model. `--no-sandbox` runs it in this process instead, for a
model the user trusts, and says so.
"""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console

from fxport.errors import EXIT_FAILED, EXIT_OK, EXIT_USAGE, FxportError
from fxport.spec import load_spec_file, parse_spec, spec_from_flags

STAGES = ("load", "capture", "passes", "quantize", "export", "verify", "benchmark")


class StageProgress:
    """A rich progress bar per stage on a terminal; plain lines otherwise."""

    def __init__(self, console: Console, enabled: bool) -> None:
        self.console, self.enabled = console, enabled
        self.progress = None
        self.tasks: dict[str, Any] = {}
        if enabled and console.is_terminal:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self.progress = Progress(TextColumn("{task.description:<8}"), BarColumn(), TextColumn("{task.fields[msg]}"),
                                     TimeElapsedColumn(), console=console, transient=False)

    def __enter__(self) -> "StageProgress":
        if self.progress:
            self.progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.progress:
            self.progress.stop()

    def __call__(self, event: dict[str, Any]) -> None:
        if not self.enabled:
            return
        stage, frac, msg = event.get("stage", "?"), float(event.get("progress", 0)), event.get("message", "")
        if self.progress is None:
            if frac == 0.0 or msg not in ("", "done"):
                self.console.print(f"[{stage}] {msg or 'started'}", highlight=False, markup=False)
            return
        if stage not in self.tasks:
            self.tasks[stage] = self.progress.add_task(stage, total=1.0, msg="")
        self.progress.update(self.tasks[stage], completed=frac, msg=msg)


def convert_command(
    model: Path = typer.Argument(..., help="Model file: .pt2 (torch.export), torch.package, TorchScript, or ONNX."),
    spec: Optional[Path] = typer.Option(None, "--spec", help="Job spec file (YAML or JSON)."),
    target: Optional[list[str]] = typer.Option(None, "--target", "-t", help="Artifact to produce (repeatable): "
                                               "torchscript, onnx, exported_program, fx_source."),
    input_: Optional[list[str]] = typer.Option(None, "--input", help="Input NAME:DIMS[:DTYPE], e.g. x:batch,3,224,224."),
    dynamic_batch: Optional[str] = typer.Option(None, "--dynamic-batch", help="Range of the 'batch' dim, MIN:OPT:MAX."),
    pass_: Optional[list[str]] = typer.Option(None, "--pass", help="Graph pass to run, in order (repeatable)."),
    precision: Optional[str] = typer.Option(None, "--precision", help="fp32 | fp16 | int8."),
    output: Optional[list[str]] = typer.Option(None, "--output", help="Name of the model's next output, in "
                                               "flattened order (repeatable; ONNX and TensorRT; default output_0, ...)."),
    calibration: Optional[Path] = typer.Option(None, "--calibration", help="Calibration data (.npz/.safetensors)."),
    benchmark: bool = typer.Option(False, "--benchmark", help="Also measure every artifact's latency, throughput "
                                   "and memory per batch size on this machine, and recommend one."),
    out: Path = typer.Option(Path("fxport-out"), "--out", "-o", help="Output folder for artifacts + manifest.json."),
    as_json: bool = typer.Option(False, "--json", help="Print the manifest as JSON on stdout and nothing else."),
    no_sandbox: bool = typer.Option(False, "--no-sandbox", help="Load and run the model in this process, outside "
                                    "the sandbox: only for a model you trust (it runs with your rights)."),
) -> None:
    """Convert a model in a sandbox and verify every artifact against it."""
    err = Console(stderr=True)
    try:
        base = load_spec_file(spec) if spec else {}
        job_spec = parse_spec(spec_from_flags(base, targets=target, inputs=input_, dynamic_batch=dynamic_batch,
                                              passes=pass_, precision=precision, benchmark=benchmark,
                                              outputs=output))
        if not model.is_file():
            raise FxportError(f"model file {str(model)!r} does not exist", stage="load")
    except FxportError as exc:
        _fail(exc, err, as_json, code=EXIT_USAGE)
        return

    manifest: dict[str, Any] | None = None
    try:
        with StageProgress(err, enabled=not as_json) as progress:
            if no_sandbox:
                from fxport.workers.engine.pipeline import convert

                err.print("[yellow]warning:[/] --no-sandbox: the model is loaded and run in this process, with your "
                          "rights (its pickles can run any code); use it only for a model you trust", highlight=False)
                manifest = convert(model, job_spec, out, calibration_path=calibration, on_progress=progress)
            else:
                from fxport.workers.sandbox import run_engine_job

                # A fresh interpreter, not a warm zygote: one job pays one `import torch` either way.
                manifest = run_engine_job(model, job_spec, out, job_id=f"local-{uuid.uuid4().hex[:12]}",
                                          calibration_path=calibration, on_progress=progress, warm=False)
    except FxportError as exc:
        manifest_path = out / "manifest.json"
        if as_json and manifest_path.exists():
            sys.stdout.write(manifest_path.read_text() + "\n")
        _fail(exc, err, as_json, code=exc.exit_code, quiet_stdout=True)
        return
    if as_json:
        sys.stdout.write(json.dumps(manifest, indent=2, default=str) + "\n")
    else:
        from fxport.client.result_table import render_manifest

        render_manifest(manifest, Console())
        Console().print(f"[green]ok[/]: artifacts and manifest.json in {out}/")
    raise typer.Exit(EXIT_OK)


def _fail(exc: FxportError, err: Console, as_json: bool, *, code: int, quiet_stdout: bool = False) -> None:
    stage = f" during {exc.stage}" if exc.stage else ""
    err.print(f"[red]error{stage}:[/] {exc}", highlight=False, soft_wrap=True)
    if as_json and not quiet_stdout:
        sys.stdout.write(json.dumps({"error": exc.to_dict()}) + "\n")
    raise typer.Exit(code if code else EXIT_FAILED)
