"""The tensorrt stage's queue: routing to "gpu", the worker heartbeat that says whether a GPU worker
exists, and a tensorrt job waiting QUEUED — saying so — when none does (real Redis, S3, API, Celery)."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest

from fxport.config import Settings
from fxport.task_queue import BUILD_TENSORRT, RUN_JOB, STAGE_TASKS, create_celery_app, route_for
from fxport.workers.queue_consumers import ConsumerHeartbeat, queue_has_consumers, waiting_message


def _db(redis_server, n: int) -> str:
    return redis_server.url.rsplit("/", 1)[0] + f"/{n}"


def test_the_tensorrt_stage_is_routed_to_queue_gpu_on_a_real_broker(redis_server, monkeypatch):
    import redis

    from fxport.workers import tasks

    url = _db(redis_server, 5)
    app = create_celery_app(Settings(broker_url=url))
    assert STAGE_TASKS["tensorrt"] == BUILD_TENSORRT and route_for(BUILD_TENSORRT) == "gpu"
    assert app.amqp.router.route({}, BUILD_TENSORRT)["queue"].name == "gpu"
    assert app.amqp.router.route({}, RUN_JOB)["queue"].name == "cpu"
    r = redis.Redis.from_url(url)
    r.flushdb()
    monkeypatch.setattr(tasks, "app", app)
    tasks.enqueue_stage("tensorrt", "01jobid")  # what the CPU stage calls when it hands a job on
    assert r.llen("gpu") == 1 and r.llen("cpu") == 0
    message = json.loads(r.lindex("gpu", 0))
    assert message["headers"]["task"] == BUILD_TENSORRT and message["headers"]["id"] == "01jobid-tensorrt"
    app.close()


def test_heartbeat_lists_a_consumer_until_it_stops_or_expires(redis_server):
    url = _db(redis_server, 6)
    import redis

    redis.Redis.from_url(url).flushdb()
    assert queue_has_consumers(url, "gpu", cache_s=0) is False
    beat = ConsumerHeartbeat(url, "gpu-worker-1@host", lambda: ["gpu"], interval_s=0.1, ttl_s=5).start()
    try:
        deadline = time.monotonic() + 5
        while not queue_has_consumers(url, "gpu", cache_s=0) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert queue_has_consumers(url, "gpu", cache_s=0) is True
        assert queue_has_consumers(url, "cpu", cache_s=0) is False
    finally:
        beat.stop()
    assert queue_has_consumers(url, "gpu", cache_s=0) is False
    # a worker killed without a clean stop drops out when its entry expires
    crashed = ConsumerHeartbeat(url, "gpu-worker-2@host", lambda: ["gpu"], ttl_s=0.3)
    crashed.beat()
    assert queue_has_consumers(url, "gpu", cache_s=0) is True
    time.sleep(0.5)
    assert queue_has_consumers(url, "gpu", cache_s=0) is False
    # the answer is cached briefly: a burst of jobs costs one Redis read
    assert queue_has_consumers(url, "gpu", cache_s=60) is False
    crashed.beat()
    assert queue_has_consumers(url, "gpu", cache_s=60) is False
    assert queue_has_consumers(url, "gpu", cache_s=0) is True
    assert queue_has_consumers(None, "gpu") is None and queue_has_consumers("filesystem://", "gpu") is None


def test_waiting_messages():
    assert waiting_message("gpu", False) == "waiting for a GPU worker (queue gpu has no consumers)"
    assert waiting_message("gpu", True) == "queued for a GPU worker (queue gpu)"
    assert waiting_message("gpu", None) == "waiting for a GPU worker (queue gpu)"


@pytest.fixture(scope="module")
def cpu_only_stack(tmp_path_factory, redis_server, s3_server):
    """API + one cpu worker on their own Redis database; no worker consumes queue gpu."""
    import redis

    from tests.fixtures.servers import distributed_env, start_api, start_worker

    base = tmp_path_factory.mktemp("cpu_only")
    url = _db(redis_server, 7)
    redis.Redis.from_url(url).flushdb()
    env = {**distributed_env(redis_server, s3_server, base, prefix="trt-wait"), "FXPORT_BROKER_URL": url}
    api = start_api(base, env, name="api-cpu-only")
    try:
        worker = start_worker(base, env, "cpu", name="worker-cpu-only")
    except Exception:
        api.stop()
        raise
    yield SimpleNamespace(api=api, worker=worker, url=url, env=env)
    worker.stop()
    api.stop()


@pytest.mark.slow
def test_tensorrt_job_without_a_gpu_worker_stays_queued_and_says_so(cpu_only_stack, s3_server, tiny_pt2, tmp_path):
    import redis

    from fxport.client import Client
    from fxport.storage import S3Store

    with Client(cpu_only_stack.api.address) as client:
        job = client.submit(tiny_pt2, {"targets": ["torchscript", "tensorrt"]})
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            job.refresh()
            if job.terminal or (job.state == "QUEUED" and job.stage == "tensorrt"):
                break
            time.sleep(0.3)
        record = job.to_dict()
        logs = cpu_only_stack.worker.log.read_text(errors="replace")[-3000:]
        assert record["state"] == "QUEUED" and record["stage"] == "tensorrt", (record, logs)
        assert record["message"] == "waiting for a GPU worker (queue gpu has no consumers)"
        # The CPU part is done: its artifacts (the ONNX model the engine will come from) are recorded.
        names = {a["name"] for a in record["artifacts"]}
        assert {"model.onnx", "model.ts", "manifest.json"} <= names
        # The build task sits in queue gpu; the cpu worker is listed as what it is, a cpu consumer.
        r = redis.Redis.from_url(cpu_only_stack.url)
        assert r.llen("gpu") == 1
        assert queue_has_consumers(cpu_only_stack.url, "cpu", cache_s=0) is True
        assert queue_has_consumers(cpu_only_stack.url, "gpu", cache_s=0) is False
        # The preflight ran in the CPU stage and its findings are in the manifest.
        bucket, _, prefix = cpu_only_stack.env["FXPORT_STORE"][len("s3://"):].partition("/")
        store = S3Store(bucket, prefix, endpoint_url=s3_server.endpoint)
        manifest_key = next(a["key"] for a in record["artifacts"] if a["name"] == "manifest.json")
        store.get(manifest_key, tmp_path / "manifest.json")
        manifest = json.loads((tmp_path / "manifest.json").read_text())
        assert manifest["tensorrt"]["preflight"]["ok"] is True
        assert manifest["sandbox"]["memory_limit_mb"]  # the CPU stage keeps its address-space limit
        # Still waiting a moment later: nothing takes it without a GPU worker.
        time.sleep(1.0)
        assert job.refresh().state == "QUEUED"
        job.cancel()
        assert job.refresh().state == "CANCELLED"
