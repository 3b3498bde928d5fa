"""A burst of 100 CI pipelines of one tenant, each `submit` then `wait` (issue 42, item 8).

Tried with 100 pipelines against the defaults (32 streams per tenant, 100 jobs in flight), 12
failed at submit with ServerBusy: a submit is a client stream, and the pipelines already waiting
held every stream slot with their WatchJob calls; past 100 jobs in flight the rest failed as
TooLarge. Now a tenant's submits have their own budget (FXPORT_MAX_UPLOADS_PER_TENANT), waiters
past the stream limit follow their jobs by polling, and a full queue is QueueFull with a
retry-after, which the client honours by submitting again. Here: 100 pipelines against a stack
whose limits are lower than the defaults (4 streams, 2 submits, 5 jobs in flight per tenant), so
every limit is met many times over, on one real worker; every pipeline must succeed.
"""

from __future__ import annotations

import threading

import pytest

from tests.fixtures.servers import distributed_env, scaled, start_api, start_worker

pytestmark = pytest.mark.slow
PIPELINES = 100
REDIS_DB = 15  # a queue and job store of this test's own
SPEC = {"targets": ["onnx"], "verify": {"samples": 1}}


def test_every_pipeline_of_a_burst_submits_and_finishes(redis_server, s3_server, tiny_pt2, tmp_path):
    from fxport.client import Client

    env = {**distributed_env(redis_server, s3_server, tmp_path, prefix="burst"),
           "FXPORT_BROKER_URL": f"redis://127.0.0.1:{redis_server.port}/{REDIS_DB}",
           "FXPORT_MAX_STREAMS_PER_TENANT": "4", "FXPORT_MAX_UPLOADS_PER_TENANT": "2",
           "FXPORT_MAX_JOBS_IN_FLIGHT": "5"}
    api = start_api(tmp_path, env, name="burst-api")
    worker = None
    outcomes: dict[int, str] = {}
    try:
        worker = start_worker(tmp_path, env, "cpu", name="burst-worker")
        start = threading.Barrier(PIPELINES)

        def pipeline(i: int) -> None:
            try:
                with Client(api.address) as client:
                    start.wait()
                    job = client.submit(tiny_pt2, {**SPEC, "labels": {"pipeline": str(i)}})
                    job.wait(timeout=scaled(600))
                    outcomes[i] = job.state
            except Exception as exc:  # noqa: BLE001 - what failed is the outcome
                outcomes[i] = f"{type(exc).__name__}: {exc}"

        threads = [threading.Thread(target=pipeline, args=(i,)) for i in range(PIPELINES)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(scaled(900))
        assert not any(t.is_alive() for t in threads), "a pipeline never ended"
    finally:
        if worker is not None:
            worker.stop()
        api.stop()
    failed = {i: o for i, o in outcomes.items() if o != "SUCCEEDED"}
    assert len(outcomes) == PIPELINES and not failed, failed
