"""Prometheus metrics on the API and a worker, scraped while a real job runs through them."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import pytest

from tests.fixtures.servers import distributed_env, free_ports, scaled, start_api, start_worker, wait_until

pytestmark = pytest.mark.slow


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^((?:fxport|grpc_server)_[a-z_]+(?:\{[^}]*\})?) ([0-9.eE+-]+)$", line)
        if m:
            values[m.group(1)] = values.get(m.group(1), 0.0) + float(m.group(2))
    return values


def test_counters_move_during_a_real_job(tmp_path: Path, redis_server, s3_server, tiny_pt2: Path) -> None:
    from fxport.client import Client

    def moved(before: dict[str, float], after: dict[str, float], name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    submit = 'grpc_method="SubmitJob",grpc_service="fxport.v1.ConversionService",grpc_type="client_stream"'
    api_port, worker_port = free_ports(2)
    env = distributed_env(redis_server, s3_server, tmp_path, prefix="metrics")
    # a Redis database of its own: the session's other workers must not take this job
    env["FXPORT_BROKER_URL"] = env["FXPORT_BROKER_URL"].rsplit("/", 1)[0] + "/7"
    api = start_api(tmp_path, {**env, "FXPORT_METRICS_PORT": str(api_port)}, name="api-metrics")
    worker = start_worker(tmp_path, {**env, "FXPORT_METRICS_PORT": str(worker_port)}, "cpu", name="worker-metrics")
    try:
        api_before, worker_before = scrape(api_port), scrape(worker_port)
        with Client(api.address) as client:
            job = client.submit(tiny_pt2, {"targets": ["onnx"]})
            job.wait(timeout=180)
            assert job.state == "SUCCEEDED", job.error

        # The last counters the job moves: the worker's, once its task has returned, and the
        # API's for the SubmitJob call; the rest moved before them.
        def counted() -> tuple[dict[str, float], dict[str, float]] | None:
            api_now, worker_now = scrape(api_port), scrape(worker_port)
            done = (moved(worker_before, worker_now, 'fxport_job_duration_seconds_count{state="succeeded"}') >= 1
                    and moved(api_before, api_now, f'grpc_server_handled_total{{grpc_code="OK",{submit}}}') >= 1)
            return (api_now, worker_now) if done else None

        api_after, worker_after = wait_until(counted, scaled(10), "the job to be counted by the API and the worker")
    finally:
        worker.stop()
        api.stop()

    assert moved(api_before, api_after, 'fxport_jobs_total{state="queued"}') == 1
    assert moved(api_before, api_after, f'grpc_server_handled_total{{grpc_code="OK",{submit}}}') == 1
    assert moved(api_before, api_after, f'grpc_server_handling_seconds_count{{{submit}}}') == 1
    for after in (api_after, worker_after):  # each pod says what it runs
        assert [k for k in after if k.startswith("fxport_build_info{")], after
    assert moved(api_before, api_after, 'fxport_upload_bytes_total{kind="model"}') == tiny_pt2.stat().st_size
    assert 'fxport_queue_depth{queue="cpu"}' in api_after
    assert moved(worker_before, worker_after, 'fxport_jobs_total{state="running"}') >= 1
    assert moved(worker_before, worker_after, 'fxport_jobs_total{state="succeeded"}') == 1
    assert moved(worker_before, worker_after, 'fxport_stage_duration_seconds_count{stage="export"}') == 1
    assert moved(worker_before, worker_after, 'fxport_job_duration_seconds_count{state="succeeded"}') == 1
