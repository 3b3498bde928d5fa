"""fxport.metrics: the metric set, its pre-initialised series, and the /metrics endpoint."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path

from prometheus_client import CollectorRegistry

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
