"""The `fxport` command line: submit and follow jobs, run the server and workers.

Exit codes (README, "Command line"): 0 ok; 1 the job failed; 2 bad usage or invalid input —
also a job that failed on invalid input (its model file, shapes), as `fxport convert` exits on
the same input; 3 timed out waiting; 4 server unreachable or auth failed. With `--json`
stdout carries exactly one JSON document; progress and messages go to stderr (a rich bar on a
terminal, plain lines otherwise). Every error line names the command that ran
(`fxport submit: error: ...`; cli/errors.py, shared with `convert`). Heavy imports (grpc
server, Celery, the engine) happen inside the commands that need them, so `fxport submit`
works from the base install.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape

from fxport.cli.errors import error_doc, job_exit_code, print_error
from fxport.cli.progress import StageProgress
from fxport.cli.spec_options import NO_FLAGS, SpecFlags, parse_labels, with_spec_flags
from fxport.client import DEFAULT_SERVER, Client, Job, JobPage
from fxport.client.errors import WaitTimeout
from fxport.errors import EXIT_FAILED, EXIT_OK, EXIT_TIMEOUT, EXIT_USAGE, FxportError, InvalidInput

app = typer.Typer(
    name="fxport", no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
    help="Turn PyTorch models into verified deployment artifacts (TorchScript, ONNX, .pt2, FX source, TensorRT).",
)
jobs_app = typer.Typer(no_args_is_help=True, help="Inspect, follow, cancel and download jobs.")
app.add_typer(jobs_app, name="jobs")

from fxport.cli.convert_command import convert_command  # noqa: E402  (the engine's own command)

app.command("convert")(convert_command)
from fxport.cli.report_command import report_command  # noqa: E402

app.command("report")(report_command)
from fxport.cli.tokens_command import tokens_app  # noqa: E402

app.add_typer(tokens_app, name="tokens")
from fxport.cli.package_command import package_app  # noqa: E402

app.add_typer(package_app, name="package")
schema_app = typer.Typer(no_args_is_help=True, help="JSON Schemas of what fxport prints.")
app.add_typer(schema_app, name="schema")


@schema_app.command("result")
def schema_result() -> None:
    """The JSON Schema of the result document `--json` prints (docs/ci.md)."""
    from fxport.results import result_schema

    _emit_json(result_schema())

SERVER = typer.Option(DEFAULT_SERVER, "--server", envvar="FXPORT_SERVER", help="fxport server address host:port.")
TOKEN = typer.Option(None, "--token", envvar="FXPORT_TOKEN", help="API token (sent as a Bearer token).")
JSON_OUT = typer.Option(False, "--json", help="Print one JSON document on stdout and nothing else (a job's: "
                        "`fxport schema result`).")
JUNIT = typer.Option(None, "--junit", help="Write a JUnit XML report here: one testcase per artifact check (implies "
                     "--wait).")
CANCEL_ON_TIMEOUT = typer.Option(False, "--cancel-on-timeout", help="Cancel the job when --timeout passes (exit 3 "
                                 "either way).")

_err = Console(stderr=True, highlight=False, soft_wrap=True)


def _emit_json(doc: Any) -> None:
    sys.stdout.write(json.dumps(doc, indent=2, default=str) + "\n")
    sys.stdout.flush()


def _run(command: str, fn: Callable[[], int], as_json: bool) -> None:
    """Run a command body; FxportError → `fxport COMMAND: error…` on stderr (+ JSON on stdout)
    and its exit code."""
    try:
        code = fn()
    except FxportError as exc:
        print_error(_err, command, exc)
        if as_json:
            _emit_json(error_doc(command, exc))
        raise typer.Exit(exc.exit_code or EXIT_FAILED) from None
    raise typer.Exit(code)


def _job_summary(job: Job, out: Path | None, console: Console, manifest: dict[str, Any] | None = None) -> None:
    """The human result: the job line, and the artifact/verification table (the error goes to
    stderr, `_finish`)."""
    colour = {"SUCCEEDED": "green", "FAILED": "red", "CANCELLED": "yellow"}.get(job.state, "cyan")
    during = f" (stage {job.stage})" if job.stage and job.state != "SUCCEEDED" else ""
    console.print(f"job [bold]{job.id}[/]: [{colour}]{job.state}[/]{during}")
    if manifest is not None:
        from fxport.cli.result_table import render_manifest

        render_manifest(manifest, console)
        if job.state == "FAILED" and manifest.get("artifacts"):
            console.print("[yellow]not kept[/]: a failed job keeps no model file; the table lists what it built")
    elif job.artifacts:
        _artifact_table(job, console)
        if job.spec.get("benchmark") is not None and any(a["name"] == "manifest.json" for a in job.artifacts):
            _benchmark_table(job, console)  # the benchmark lives in the manifest: fetch just that


def _benchmark_table(job: Job, console: Console) -> None:
    import tempfile

    from fxport.cli.result_table import render_benchmark

    with tempfile.TemporaryDirectory(prefix="fxport-manifest-") as tmp:
        job.download(tmp, names=["manifest.json"])
        render_benchmark(json.loads((Path(tmp) / "manifest.json").read_text()).get("benchmark") or {}, console)


def _artifact_table(job: Job, console: Console) -> None:
    from rich.table import Table

    table = Table(title="artifacts")
    for col in ("name", "format", "bytes", "sha256"):
        table.add_column(col)
    for a in job.artifacts:
        table.add_row(a["name"], a["format"], str(a["bytes"]), a["sha256"][:12] + "…")
    console.print(table)


def _withdraw_stale(out: Path, job: Job, manifest: dict[str, Any] | None) -> None:
    """--out holds what the job keeps and nothing else under an artifact's name, as `fxport convert`
    leaves its --out (README, "What a conversion does"): an earlier job's model files go after a
    failed job, and an earlier job's files of the targets an allow_partial job could not build."""
    from fxport.workers.engine.publish import output_names, withdraw

    if job.state == "FAILED":
        names = output_names()
    elif job.state == "SUCCEEDED":
        names = output_names(str(f.get("target")) for f in (manifest or {}).get("failed_targets") or ()
                             if isinstance(f, dict))
    else:
        return
    kept = {str(a["name"]).split("/", 1)[0] for a in job.artifacts}
    withdraw(out, [name for name in names if name not in kept])


def _job_manifest(job: Job, out: Path | None) -> dict[str, Any] | None:
    """The finished job's manifest.json: the one --out downloaded, else fetched alone (it holds
    the verdicts, the targets not built and the benchmark). None where the job has none."""
    if out is not None and (out / "manifest.json").is_file():
        return json.loads((out / "manifest.json").read_text())
    if not any(a["name"] == "manifest.json" for a in job.artifacts):
        return None
    import tempfile

    with tempfile.TemporaryDirectory(prefix="fxport-manifest-") as tmp:
        job.download(tmp, names=["manifest.json"])
        data = json.loads((Path(tmp) / "manifest.json").read_text())
    return data if isinstance(data, dict) else None


def _finish(command: str, job: Job, *, out: Path | None, as_json: bool, junit: Path | None,
            timed_out: bool = False, cancelled: bool = False) -> int:
    """Report a job the command followed: the result document (--json), the JUnit file, the CI
    step summary, the human summary; the job's error on stderr. Returns the exit code."""
    from fxport.ci_report import append_step_summary, write_junit
    from fxport.results import from_job

    # With --out, job.wait(download_to=out) fetched what the job lists: every artifact, or the
    # manifest.json and report.html of a failed job (Job._download_outcome, one code path).
    paths: list[Path] = list(job.downloaded or []) if out is not None else []
    manifest = _job_manifest(job, out) if job.terminal else None
    if out is not None and job.terminal:
        _withdraw_stale(out, job, manifest)
    # A job that failed on invalid input exits 2, as `fxport convert` does on the same input.
    code = EXIT_TIMEOUT if timed_out else job_exit_code(job.state, job.error)
    result = from_job(command, job.to_dict(), exit_code=code, manifest=manifest, timed_out=timed_out,
                      cancelled=cancelled, upload=job.upload, downloaded=[str(p) for p in paths],
                      manifest_path=str(out / "manifest.json") if out is not None and manifest else None)
    if junit is not None:
        write_junit(result, junit)
    append_step_summary(result)
    if as_json:
        _emit_json(result.model_dump(mode="json"))
    else:
        _job_summary(job, out, Console(), manifest)
        if out is not None and job.artifacts:
            Console().print(f"artifacts in {out}/ (sha256 verified)")
            if (out / "report.html").is_file():
                Console().print(f"report: {out / 'report.html'}")
    if timed_out:
        what = "cancelled it" if cancelled else f"it is still {job.state} (stage {job.stage or '-'})"
        print_error(_err, command, WaitTimeout(f"job {job.id} did not finish in time; {what}",
                                               hint=None if cancelled else f"fxport jobs watch {job.id}"))
    elif job.error:
        e = job.error
        print_error(_err, command, FxportError(f"job {job.id} {job.state}: {e['message']}",
                                               stage=e["stage"] or None))
    return code


def _wait(job: Job, *, timeout: float | None, cancel_on_timeout: bool, out: Path | None) -> tuple[bool, bool]:
    """Follow `job` to its end (progress on stderr). Returns (timed out, cancelled): after a
    timeout the job is read again, so its last state is the real one, and cancelled if asked."""
    try:
        with StageProgress(_err) as progress:  # with --out, artifacts stored early come down meanwhile
            job.wait(timeout=timeout, on_event=progress.on_job_event, download_to=out)
        return False, False
    except WaitTimeout:
        job.refresh()
        if cancel_on_timeout and not job.terminal:
            job.cancel()
            return True, True
        return True, False


# ---------------------------------------------------------------------------------------
# submit
# ---------------------------------------------------------------------------------------


@app.command()
@with_spec_flags
def submit(
    model: Path = typer.Argument(..., help="Model file: .pt2 (torch.export), torch.package, TorchScript, or ONNX."),
    flags: SpecFlags = NO_FLAGS,  # --spec, --target, --capture, ...: cli/spec_options.py, shared with `convert`
    calibration: Path | None = typer.Option(None, "--calibration", help="Calibration data file."),
    idempotency_key: str | None = typer.Option(None, "--idempotency-key", help="Same key → same job (safe retries)."),
    no_cache: bool = typer.Option(False, "--no-cache", help="Convert even if the server has this result cached "
                                  "(same model, spec and toolchain); the fresh result replaces the cached one."),
    server: str = SERVER,
    token: str | None = TOKEN,
    wait: bool = typer.Option(False, "--wait", help="Wait for the job to finish (implied by --out and --junit)."),
    timeout: float | None = typer.Option(None, "--timeout", help="Seconds to wait before giving up (exit 3)."),
    cancel_on_timeout: bool = CANCEL_ON_TIMEOUT,
    out: Path | None = typer.Option(None, "--out", "-o", help="Download the artifacts here (sha256 checked)."),
    junit: Path | None = JUNIT,
    as_json: bool = JSON_OUT,
) -> None:
    """Submit a model to an fxport server; with --wait/--out, follow it and fetch the artifacts."""

    def body() -> int:
        data = flags.to_spec()  # validated by the server before any byte of the model moves (CheckUpload)
        if not model.is_file():
            raise InvalidInput(f"model file {str(model)!r} not found", field="model")
        with Client(server, token=token) as client:
            job = client.submit(model, data, calibration=calibration, idempotency_key=idempotency_key,
                                no_cache=no_cache)
            skipped = (job.upload or {}).get("skipped")
            if skipped == "cache_hit":
                _err.print(f"cache hit: job {job.id} reuses an earlier identical job's artifacts "
                           "(model upload skipped; --no-cache converts again)")
            elif skipped == "model_stored":
                _err.print(f"model already stored, upload skipped; submitted job {job.id}")
            elif (job.upload or {}).get("direct"):
                _err.print(f"model uploaded straight to the object store; submitted job {job.id}")
            else:
                _err.print(f"submitted job {job.id}")
            if not (wait or out or junit):
                if as_json:
                    from fxport.results import from_job

                    _emit_json(from_job("submit", job.to_dict(), exit_code=EXIT_OK, upload=job.upload)
                               .model_dump(mode="json"))
                else:
                    print(job.id)
                return EXIT_OK
            timed_out, cancelled = _wait(job, timeout=timeout, cancel_on_timeout=cancel_on_timeout, out=out)
            return _finish("submit", job, out=out, as_json=as_json, junit=junit, timed_out=timed_out,
                           cancelled=cancelled)

    _run("submit", body, as_json)


# ---------------------------------------------------------------------------------------
# jobs
# ---------------------------------------------------------------------------------------


@jobs_app.command("list")
def jobs_list(
    state: list[str] | None = typer.Option(None, "--state", help="QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED."),
    label: list[str] | None = typer.Option(None, "--label", help="KEY=VALUE; all must match."),
    limit: int = typer.Option(50, "--limit", help="Jobs to show (a page)."),
    page_token: str = typer.Option("", "--page-token", help="next_page_token of the previous page."),
    server: str = SERVER,
    token: str | None = TOKEN,
    as_json: bool = JSON_OUT,
) -> None:
    """List jobs, newest first."""

    def body() -> int:
        with Client(server, token=token) as client:
            # A filtered call may come back short, with a token, having examined its share of the
            # tenant's jobs: the next ones are asked for until the page is full or none are left.
            page = client.list(states=state, labels=parse_labels(label), page_size=limit, page_token=page_token)
            while page.next_page_token and len(page.jobs) < limit:
                more = client.list(states=state, labels=parse_labels(label), page_size=limit - len(page.jobs),
                                   page_token=page.next_page_token)
                page = JobPage(page.jobs + more.jobs, more.next_page_token)
        if as_json:
            from fxport.results import from_job

            # each job as the result document (without the manifest's checks: one call per job would fetch it)
            _emit_json({"jobs": [from_job("jobs list", j.to_dict(), exit_code=EXIT_OK).model_dump(mode="json")
                                 for j in page.jobs], "next_page_token": page.next_page_token})
            return EXIT_OK
        import time as _time

        rows = []
        for j in page.jobs:
            d = j.to_dict()
            created = _time.strftime("%Y-%m-%d %H:%M:%S", _time.localtime(d["created_at"])) if d["created_at"] else ""
            rows.append([j.id, j.state, j.stage, created, ",".join(j.spec.get("targets", [])),
                         ",".join(f"{k}={v}" for k, v in d["labels"].items())])
        for line in _columns(["id", "state", "stage", "created", "targets", "labels"], rows):
            print(line)
        if page.next_page_token:
            _err.print(f"more: --page-token {page.next_page_token}")
        return EXIT_OK

    _run("jobs list", body, as_json)


def _columns(header: list[str], rows: list[list[str]]) -> list[str]:
    """One line per row, columns aligned, nothing cut or wrapped: a job id is whole at any width
    (a rich table on an 80-column pipe ellipsized it) and a line is one job, for grep and awk."""
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in (header, *rows)]


@jobs_app.command("get")
def jobs_get(job_id: str, server: str = SERVER, token: str | None = TOKEN, as_json: bool = JSON_OUT) -> None:
    """Show one job."""

    def body() -> int:
        with Client(server, token=token) as client:
            job = client.get(job_id)
            if as_json:
                from fxport.results import from_job

                manifest = _job_manifest(job, None) if job.terminal else None
                _emit_json(from_job("jobs get", job.to_dict(), exit_code=EXIT_OK, manifest=manifest)
                           .model_dump(mode="json"))
            else:
                _job_summary(job, None, Console())
        return EXIT_OK

    _run("jobs get", body, as_json)


@jobs_app.command("watch")
def jobs_watch(
    job_id: str,
    timeout: float | None = typer.Option(None, "--timeout", help="Seconds to wait (exit 3 after)."),
    cancel_on_timeout: bool = CANCEL_ON_TIMEOUT,
    junit: Path | None = JUNIT,
    server: str = SERVER,
    token: str | None = TOKEN,
    as_json: bool = JSON_OUT,
) -> None:
    """Follow a job until it ends; exit 0 if it succeeded, 2 if it failed on invalid input, 1 if not."""

    def body() -> int:
        with Client(server, token=token) as client:
            job = client.get(job_id)
            timed_out, cancelled = _wait(job, timeout=timeout, cancel_on_timeout=cancel_on_timeout, out=None)
            return _finish("jobs watch", job, out=None, as_json=as_json, junit=junit, timed_out=timed_out,
                           cancelled=cancelled)

    _run("jobs watch", body, as_json)


@jobs_app.command("cancel")
def jobs_cancel(job_id: str, server: str = SERVER, token: str | None = TOKEN, as_json: bool = JSON_OUT) -> None:
    """Cancel a queued or running job (a finished job is left as it is)."""

    def body() -> int:
        with Client(server, token=token) as client:
            job = client.cancel(job_id)
        if as_json:
            from fxport.results import from_job

            _emit_json(from_job("jobs cancel", job.to_dict(), exit_code=EXIT_OK).model_dump(mode="json"))
        else:
            print(f"job {job.id}: {job.state}")
        return EXIT_OK

    _run("jobs cancel", body, as_json)


@jobs_app.command("download")
def jobs_download(
    job_id: str,
    out: Path = typer.Option(Path("artifacts"), "--out", "-o", help="Destination folder."),
    name: list[str] | None = typer.Option(None, "--name", help="Only this artifact (repeatable)."),
    server: str = SERVER,
    token: str | None = TOKEN,
    as_json: bool = JSON_OUT,
) -> None:
    """Download a job's artifacts, checking every sha256."""

    def body() -> int:
        with Client(server, token=token) as client:
            job = client.get(job_id)
            paths = job.download(out, names=name)
        if as_json:
            _emit_json({"job_id": job.id, "downloaded": [str(p) for p in paths]})
        else:
            for p in paths:
                print(p)
        return EXIT_OK

    _run("jobs download", body, as_json)


# ---------------------------------------------------------------------------------------
# serve / worker
# ---------------------------------------------------------------------------------------


@app.command()
def serve(
    listen: str | None = typer.Option(None, "--listen",
                                      help="host:port to serve on (default 127.0.0.1:50051; port 0 = any)."),
    broker: str | None = typer.Option(None, "--broker",
                                      help="Celery broker + job store, redis://… (unset = embedded)."),
    store: str | None = typer.Option(None, "--store", help="Artifact store: s3://BUCKET\\[/prefix] or file:///dir."),
    home: Path | None = typer.Option(None, "--home", help="State folder of the embedded mode (default ./.fxport)."),
    ready_file: Path | None = typer.Option(None, "--ready-file", help="Write host:port here once serving."),
    insecure_no_auth: bool = typer.Option(False, "--insecure-no-auth",
                                          help="Serve a non-loopback address with no tokens and no mTLS."),
) -> None:
    """Run the API server. No flags: embedded (in-process workers, files under ./.fxport)."""
    from fxport.config import Settings
    from fxport.logs import configure_logging

    overrides: dict[str, Any] = {k: v for k, v in
                                 {"listen": listen, "broker_url": broker, "store": store, "home": home,
                                  "insecure_no_auth": insecure_no_auth or None}.items()
                                 if v is not None}
    try:
        settings = Settings(**overrides)
    except Exception as exc:
        _err.print(f"[red]fxport serve: error:[/] invalid settings: {escape(str(exc))}")
        raise typer.Exit(EXIT_USAGE) from None
    configure_logging(settings.log_level, settings.log_format)
    from fxport import tracing
    from fxport.cli.server import create_server

    try:
        tracing.configure(settings.otlp_endpoint, "fxport-api")
    except RuntimeError as exc:
        _err.print(f"[red]fxport serve: error:[/] {escape(str(exc))}")
        raise typer.Exit(EXIT_USAGE) from None

    try:
        server, port = create_server(settings)
    except (OSError, ValueError, FxportError) as exc:
        _err.print(f"[red]fxport serve: error:[/] cannot start the server: {escape(str(exc))}")
        raise typer.Exit(EXIT_USAGE) from None
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    from fxport.metrics import MetricsPortUnavailable

    try:
        server.start()
    except MetricsPortUnavailable as exc:
        server.stop(grace=0)
        _err.print(f"[red]fxport serve: error:[/] {escape(str(exc))}; choose another FXPORT_METRICS_PORT (0 = any "
                   "free port, logged)", highlight=False)
        raise typer.Exit(EXIT_USAGE) from None
    mode = "embedded" if settings.embedded else "distributed"
    print(f"fxport serving on {server.address} ({mode}; store {settings.store_url()})", flush=True)
    if ready_file is not None:
        tmp = ready_file.with_name(ready_file.name + ".tmp")
        tmp.write_text(server.address)
        os.replace(tmp, ready_file)
    stop.wait()
    server.stop()  # grace: FXPORT_SHUTDOWN_GRACE_S
    raise typer.Exit(EXIT_OK)


@app.command()
def worker(
    queues: str = typer.Option("cpu", "--queues", "-Q", help="Comma-separated queues: cpu, gpu."),
    concurrency: int = typer.Option(1, "--concurrency", "-c", help="Jobs run at once by this worker."),
    broker: str | None = typer.Option(None, "--broker", help="redis://… (default FXPORT_BROKER_URL)."),
    store: str | None = typer.Option(None, "--store", help="Artifact store (default FXPORT_STORE)."),
    pool: str = typer.Option("prefork", "--pool", help="prefork (cancel can interrupt a job) or solo."),
    hostname: str | None = typer.Option(None, "--hostname", "-n", help="Worker node name."),
    loglevel: str = typer.Option("INFO", "--loglevel", "-l"),
) -> None:
    """Run a Celery worker for the given queues (needs the \\[worker] extra)."""
    # Flags become environment so the pool's child processes read the same settings.
    os.environ["FXPORT_WORKER_CONCURRENCY"] = str(concurrency)  # each job's share of the CPUs (sandbox threads)
    if broker:
        os.environ["FXPORT_BROKER_URL"] = broker
    if store:
        os.environ["FXPORT_STORE"] = store
    wanted = [q.strip() for q in queues.split(",") if q.strip()]
    bad = [q for q in wanted if q not in ("cpu", "gpu")]
    if bad or not wanted:
        _err.print(f"[red]fxport worker: error:[/] --queues {escape(repr(queues))}: valid queues are cpu, gpu")
        raise typer.Exit(EXIT_USAGE)
    from fxport.config import Settings

    if not Settings().broker_url:
        _err.print("[red]fxport worker: error:[/] a worker needs a broker: --broker redis://… or FXPORT_BROKER_URL")
        raise typer.Exit(EXIT_USAGE)
    settings = Settings()
    from fxport.logs import configure_logging

    # Before Celery starts: its warnings (running as root, ...) are log records from the first one.
    configure_logging(settings.log_level, settings.log_format)
    if settings.log_format == "json":
        import celery.apps.worker

        # Celery prints its shutdown notices ("Warm shutdown", ...) to stderr as plain text: log them instead.
        celery.apps.worker.safe_say = lambda msg, f=None: logging.getLogger("celery.worker").info(msg.strip())
    metrics_port, port_setting = settings.worker_metrics
    if metrics_port is not None:
        # Tasks run in pool child processes: they record into files that the main process's
        # /metrics sums. The directory must be chosen before prometheus_client is imported.
        import tempfile

        os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", tempfile.mkdtemp(prefix="fxport-metrics-"))
        from fxport.metrics import MetricsPortUnavailable, reset_multiprocess_dir, start_metrics_server

        reset_multiprocess_dir()
        try:
            start_metrics_server(metrics_port, addr=settings.metrics_bind_address(api=False))
        except MetricsPortUnavailable as exc:
            _err.print(f"[red]fxport worker: error:[/] {escape(str(exc))}; choose another {port_setting} (0 = any free "
                       "port, logged; FXPORT_WORKER_METRICS_PORT sets the worker's apart from the API's)",
                       highlight=False)
            raise typer.Exit(EXIT_USAGE) from None
    import fxport.workers.tasks  # noqa: F401  (registers the tasks)
    from fxport.workers.celery_app import app as celery_app

    argv = ["worker", "-Q", ",".join(wanted), "-c", str(concurrency), "--pool", pool, "-l", loglevel,
            "--without-mingle", "--without-gossip", "-n", hostname or f"fxport-{'-'.join(wanted)}-{os.getpid()}@%h"]
    if settings.log_format == "json":
        argv.insert(0, "--quiet")  # Celery's own option: no startup banner, every line on stderr a JSON record
    celery_app.worker_main(argv)


def main() -> None:
    """Console entry point `fxport`."""
    try:
        app()
    except SystemExit as end:
        from fxport.cli.convert_command import ENGINE_RAN_HERE

        if ENGINE_RAN_HERE.is_set():
            # Everything is written and printed. Python's teardown of what torch and the exporters
            # built costs a second or so (docs/benchmarks.md, "Costs the code is shaped around"), and a non-daemon
            # thread the model left would keep the process alive for good: end it here instead.
            _exit_now(end.code)
        raise


def _exit_now(code: object) -> NoReturn:
    """os._exit with sys.exit's meaning of `code` (None: 0; an int: itself; else printed, 1)."""
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0 if code is None else code if isinstance(code, int) else 1)

