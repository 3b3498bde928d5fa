"""fxport.metrics: the metric set, its pre-initialised series, and the /metrics endpoint."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path

from prometheus_client import REGISTRY, CollectorRegistry

from fxport.config import Settings
from fxport.metrics import (
    JOB_STATES,
    SANDBOX_FAILURE_REASONS,
    STAGES,
    build_metrics,
    start_metrics_server,
)

REPO = Path(__file__).resolve().parents[2]

# The names deploy/README.md promises operators (dashboards and alerts depend on them).
DOCUMENTED_METRICS = (
    "fxport_jobs_total",
    "fxport_jobs_running",
    "fxport_queue_depth",
    "fxport_stage_duration_seconds",
    "fxport_job_duration_seconds",
    "fxport_cache_hits_total",
    "fxport_cache_misses_total",
    "fxport_sandbox_failures_total",
    "fxport_upload_bytes_total",
    "fxport_job_failures_total",
    "fxport_build_info",
    "grpc_server_started_total",
    "grpc_server_handled_total",
    "grpc_server_handling_seconds",
)


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


def test_every_label_value_exists_at_zero_before_any_job():
    registry = CollectorRegistry()
    build_metrics(registry)
    for state in JOB_STATES:
        assert registry.get_sample_value("fxport_jobs_total", {"state": state}) == 0
    for stage in STAGES:
        assert registry.get_sample_value("fxport_stage_duration_seconds_count", {"stage": stage}) == 0
    for reason in SANDBOX_FAILURE_REASONS:
        assert registry.get_sample_value("fxport_sandbox_failures_total", {"reason": reason}) == 0


def test_recorded_values_are_served_on_the_metrics_port():
    registry = CollectorRegistry()
    metrics = build_metrics(registry)
    server, port = start_metrics_server(0, addr="127.0.0.1", registry=registry)
    try:
        metrics.jobs_total.labels("succeeded").inc()
        metrics.stage_duration_seconds.labels("export").observe(2.0)
        metrics.upload_bytes_total.labels("model").inc(1234)
        metrics.cache_hits_total.inc()
        metrics.queue_depth.labels("gpu").set(7)
        metrics.record_sandbox_failure("memory")
        metrics.record_sandbox_failure("Traceback (most recent call last): ...")
        text = _scrape(port)
    finally:
        server.shutdown()
        server.server_close()
    for name in DOCUMENTED_METRICS:
        assert f"# HELP {name} " in text, name
    assert 'fxport_jobs_total{state="succeeded"} 1.0' in text
    assert 'fxport_stage_duration_seconds_bucket{le="2.5",stage="export"} 1.0' in text
    assert 'fxport_upload_bytes_total{kind="model"} 1234.0' in text
    assert "fxport_cache_hits_total 1.0" in text
    assert 'fxport_queue_depth{queue="gpu"} 7.0' in text
    assert 'fxport_sandbox_failures_total{reason="memory"} 1.0' in text
    # free-form text is folded into "other": label cardinality stays bounded
    assert 'fxport_sandbox_failures_total{reason="other"} 1.0' in text
    assert "Traceback" not in text


def test_multiprocess_mode_serves_values_recorded_in_pool_children(tmp_path):
    """Celery prefork: a forked child records, the parent's endpoint shows it."""
    script = textwrap.dedent(
        """
        import os, sys, urllib.request
        from fxport import metrics
        metrics.reset_multiprocess_dir()
        pid = os.fork()
        if pid == 0:
            metrics.METRICS.jobs_total.labels("running").inc(3)
            metrics.METRICS.jobs_running.labels("cpu").inc()
            os._exit(0)
        os.waitpid(pid, 0)  # the child has exited; its counters must survive it
        server, port = metrics.start_metrics_server(0, addr="127.0.0.1")
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        metrics.mark_process_dead(pid)
        text_after = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        server.shutdown()
        assert 'fxport_jobs_total{state="running"} 3.0' in text, text
        assert 'fxport_jobs_running{queue="cpu"} 1.0' in text, text
        # a dead child's live gauge is dropped, its counters are kept
        assert 'fxport_jobs_running{queue="cpu"} 1.0' not in text_after, text_after
        assert 'fxport_jobs_total{state="running"} 3.0' in text_after, text_after
        """
    )
    stale = tmp_path / "counter_999999.db"
    stale.write_bytes(b"stale file of a previous container")
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert not stale.exists()


def test_the_metrics_endpoint_stays_on_loopback_outside_kubernetes():
    from fxport.config import Settings

    worker = Settings()
    assert worker.metrics_bind_address(api=False, env={}) == "127.0.0.1"
    assert worker.metrics_bind_address(api=False, env={"KUBERNETES_SERVICE_HOST": "10.0.0.1"}) == "0.0.0.0"
    assert Settings(listen="127.0.0.1:50051").metrics_bind_address(api=True, env={}) == "127.0.0.1"
    assert Settings(listen="0.0.0.0:50051").metrics_bind_address(api=True, env={}) == "0.0.0.0"
    assert Settings(metrics_host="10.1.2.3").metrics_bind_address(api=False, env={"KUBERNETES_SERVICE_HOST": "x"}) \
        == "10.1.2.3"


def test_the_readme_metrics_table_lists_every_metric():
    """deploy/README.md's table keeps up with fxport/metrics.py (names are the operator contract)."""
    registry = CollectorRegistry()
    build_metrics(registry)
    names = {m.name for m in registry.collect()}  # counters without their _total suffix
    table = re.findall(r"^\| `([a-z_]+)` \|", (REPO / "deploy" / "README.md").read_text(), re.M)
    missing = [n for n in sorted(names) if n not in table and f"{n}_total" not in table]
    assert not missing, f"deploy/README.md's metrics table does not list {missing}"


def test_build_info_names_the_versions_without_importing_torch():
    """The API image has no torch and the API process must never import it: the torch label
    comes from package metadata. Set when the metrics endpoint starts, in any process."""
    script = textwrap.dedent(
        """
        import json, sys, urllib.request
        from fxport import metrics
        server, port = metrics.start_metrics_server(0, addr="127.0.0.1")
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        server.shutdown()
        print(json.dumps({"lines": [l for l in text.splitlines() if l.startswith("fxport_build_info")],
                          "torch_imported": "torch" in sys.modules}))
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    from importlib import metadata

    import fxport

    try:
        torch = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch = ""
    assert out["lines"] == [f'fxport_build_info{{python="{platform.python_version()}",torch="{torch}",'
                            f'version="{fxport.__version__}"}} 1.0']
    assert out["torch_imported"] is False


def _sample(name: str, labels: dict[str, str]) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_a_job_counts_as_running_while_its_worker_runs_it_and_a_failure_names_stage_and_code(tmp_path):
    """workers/jobs.py through a metered SQLite job store and a FileStore: fxport_jobs_running
    is one higher exactly while the worker executes the job (CPU part: queue cpu, TensorRT
    stage: queue gpu), and each FAILED job is counted with its error's stage and code, so a
    verification failure and a store outage are two different series."""
    from fxport.errors import ConversionFailed, VerificationFailed
    from fxport.jobs import InputRef, JobRecord, SqliteJobStore, new_job_id
    from fxport.manifest import Manifest
    from fxport.metrics import MeteredJobStore
    from fxport.spec import parse_spec
    from fxport.storage import FileStore, StoreUnreachable, input_key
    from fxport.workers.jobs import WorkerContext, execute_job, execute_stage

    store = SqliteJobStore(tmp_path / "jobs.db")
    ctx = WorkerContext(jobs=MeteredJobStore(store), artifacts=FileStore(tmp_path / "store"),
                        settings=Settings(home=tmp_path, work_dir=tmp_path / "work"), worker_id="test-worker")
    model = b"pretend this is a .pt2"
    sha = hashlib.sha256(model).hexdigest()
    (tmp_path / "model.pt2").write_bytes(model)
    ctx.artifacts.put_file(input_key("default", sha), tmp_path / "model.pt2")

    def new_job(targets: list[str]) -> str:
        spec = parse_spec({"targets": targets})
        rec, _ = ctx.jobs.create(JobRecord(
            id=new_job_id(), tenant="default", spec=spec, spec_digest=spec.digest(),
            model=InputRef(sha256=sha, bytes=len(model), filename="m.pt2", key=input_key("default", sha))))
        return rec.id

    running = {q: _sample("fxport_jobs_running", {"queue": q}) for q in ("cpu", "gpu")}
    seen: list[tuple[str, float]] = []

    def failing(queue: str, stage: str, error: Exception):
        def engine(request, *, on_progress=None, **_):
            seen.append((queue, _sample("fxport_jobs_running", {"queue": queue})))
            on_progress({"stage": stage, "progress": 0.0, "message": ""})
            raise error
        return engine

    def failures(stage: str, code: str) -> float:
        return _sample("fxport_job_failures_total", {"stage": stage, "code": code})

    before = {k: failures(*k) for k in (("verify", "verification_failed"), ("export", "store_unreachable"),
                                        ("tensorrt", "conversion_failed"))}
    try:
        ctx.engine = failing("cpu", "verify", VerificationFailed("onnx differs", stage="verify"))
        assert execute_job(new_job(["onnx"]), ctx).error.code == "verification_failed"
        ctx.engine = failing("cpu", "export", StoreUnreachable("the object store did not answer"))
        assert execute_job(new_job(["onnx"]), ctx).error.code == "store_unreachable"

        # TensorRT: the CPU part makes model.onnx and hands on; the gpu stage then fails
        def onnx_engine(request, **_):
            out_dir = request.out_dir
            (out_dir / "model.onnx").write_bytes(b"onnx")
            art = {"format": "onnx", "path": "model.onnx", "bytes": 4, "sha256": hashlib.sha256(b"onnx").hexdigest()}
            manifest = {"artifacts": [art], "verification": [{"format": "onnx", "passed": True}]}
            (out_dir / "manifest.json").write_text(json.dumps(manifest))
            return Manifest.model_validate(manifest)

        trt = new_job(["tensorrt"])
        ctx.enqueue_stage = lambda stage, job_id: None
        ctx.engine = onnx_engine
        execute_job(trt, ctx)
        ctx.engine = failing("gpu", "tensorrt", ConversionFailed("engine build failed", stage="tensorrt"))
        assert execute_stage("tensorrt", trt, ctx).error.code == "conversion_failed"
    finally:
        store.close()
    assert seen == [("cpu", running["cpu"] + 1), ("cpu", running["cpu"] + 1), ("gpu", running["gpu"] + 1)]
    assert {q: _sample("fxport_jobs_running", {"queue": q}) for q in ("cpu", "gpu")} == running
    for key, value in before.items():
        assert failures(*key) == value + 1, key
