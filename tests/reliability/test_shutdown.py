"""Graceful shutdown (SIGTERM, what Kubernetes sends): the API turns NOT_SERVING first and
ends its streams; a worker finishes its job within worker_soft_shutdown_s, or else cuts it
and the job is requeued at once and completes elsewhere."""

from __future__ import annotations

import math
import os
import signal
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fxport.jobs import InputRef, JobRecord, new_job_id
from fxport.v1 import conversion_pb2 as pb
from fxport.v1 import conversion_pb2_grpc as pb_grpc
from tests.fixtures.servers import scaled, start_api
from tests.reliability.conftest import (
    REDELIVERY_BOUND_S,
    SPEC,
    assert_like_clean_run,
    attempt_history,
    deadline,
    submit_frozen,
    wait_terminal,
    wait_until,
    worker_running,
)

pytestmark = pytest.mark.slow

GRACE_S = 3


def test_api_sigterm_turns_not_serving_then_ends_streams(fault_stack):
    api = start_api(fault_stack.base, {**fault_stack.env, "FXPORT_SHUTDOWN_GRACE_S": str(GRACE_S)}, name="api-drain")
    jobs = fault_stack.job_store()
    idle = JobRecord(id=new_job_id(), tenant="default", model=InputRef(sha256="0" * 64, bytes=1, key="k"))
    jobs.create(idle)  # QUEUED with no message: a WatchJob on it stays open until the server ends it
    seen: dict[str, list] = {"health": [], "watch": []}
    try:
        channel = grpc.insecure_channel(api.address)
        health = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
        watch = pb_grpc.ConversionServiceStub(channel).WatchJob(pb.WatchJobRequest(job_id=idle.id))

        def follow(name: str, stream) -> None:  # noqa: ANN001
            try:
                for msg in stream:
                    seen[name].append((time.monotonic(), msg))
                seen[name].append((time.monotonic(), "end"))
            except grpc.RpcError as err:
                seen[name].append((time.monotonic(), err.code()))

        threads = [threading.Thread(target=follow, args=("health", health), daemon=True),
                   threading.Thread(target=follow, args=("watch", watch), daemon=True)]
        for t in threads:
            t.start()
        wait_until(lambda: seen["health"] and seen["watch"], scaled(10), "both streams to start")
        assert seen["health"][0][1].status == health_pb2.HealthCheckResponse.SERVING

        t0 = time.monotonic()
        os.kill(api.process.pid, signal.SIGTERM)
        assert api.process.proc.wait(GRACE_S + scaled(10)) == 0
        exited = time.monotonic()
        for t in threads:  # the server is gone: both streams end now
            t.join(timeout=scaled(5))
            assert not t.is_alive(), "a stream outlived the server"
        channel.close()
    finally:
        api.stop()
    statuses = [m.status for _, m in seen["health"] if isinstance(m, health_pb2.HealthCheckResponse)]
    assert health_pb2.HealthCheckResponse.NOT_SERVING in statuses, seen["health"]
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
    not_serving_at = next(t for t, m in seen["health"]
                          if isinstance(m, health_pb2.HealthCheckResponse) and m.status == not_serving)
    assert t0 <= not_serving_at <= exited
    # The open WatchJob ended (cleanly or cut), so a client resumes it elsewhere; no event was invented.
    assert len(seen["watch"]) >= 2 and not any(isinstance(m, pb.JobEvent) and m.state != pb.JOB_STATE_QUEUED
                                               for _, m in seen["watch"])
    assert exited - t0 <= GRACE_S + scaled(5)


def soft_shutdown_s() -> int:
    """The soft-shutdown window w2 gets in these tests: a whole reference job fits in it with
    room to spare (the fault stack's 5 s does not on a busy machine), so what is left of a job
    thawed a second after SIGTERM surely does."""
    return max(5, math.ceil(deadline(1)))


def _sigterm_w2_mid_job(stack, queue_control, tiny_pt2, frozen_for_s: float, soft_s: int):  # noqa: ANN001, ANN202
    """w2, restarted with a soft shutdown of `soft_s`, gets a job and SIGTERM while the job's
    sandbox is frozen for `frozen_for_s`."""
    stack.stop_worker("w2")
    # a job waits for the restarted worker's sandbox to start: wait for it here, by its measured start
    stack.start_worker("w2", {"FXPORT_WORKER_SOFT_SHUTDOWN_S": str(soft_s)}, sandbox_ready=True)
    queue_control.pause("w1")
    with stack.client() as client:  # frozen once its zygote has started: what is left is the job
        job, frozen = submit_frozen(stack, lambda: client.submit(tiny_pt2, SPEC))
    assert worker_running(stack, stack.job_store().get(job.id)) == "w2"
    t0 = time.monotonic()
    os.kill(stack.workers["w2"].pid, signal.SIGTERM)
    try:
        time.sleep(frozen_for_s)
        frozen.thaw()
        rc = stack.workers["w2"].proc.wait(soft_s + scaled(15))
        exited = time.monotonic()
    finally:
        frozen.kill()  # if the cut attempt's pool process left it behind
    return job, rc, exited - t0, exited


def test_worker_sigterm_lets_the_running_job_finish(fault_stack, clean_run, tiny_pt2, queue_control):
    soft_s = soft_shutdown_s()
    try:
        job, rc, took, _ = _sigterm_w2_mid_job(fault_stack, queue_control, tiny_pt2, frozen_for_s=1, soft_s=soft_s)
        (rec,) = wait_terminal(fault_stack, [job.id], timeout=scaled(5)).values()  # it ended before w2 did
    finally:
        fault_stack.start_worker("w2")
    assert rc == 0 and took <= soft_s + scaled(5)
    assert rec.state.value == "SUCCEEDED" and rec.attempts == 1, (rec.error, fault_stack.logs())
    assert_like_clean_run(fault_stack, job.id, clean_run)


def test_worker_sigterm_requeues_a_job_longer_than_the_soft_shutdown(fault_stack, clean_run, tiny_pt2,
                                                                     queue_control):
    soft_s = soft_shutdown_s()
    try:
        job, rc, took, exited = _sigterm_w2_mid_job(fault_stack, queue_control, tiny_pt2,
                                                    frozen_for_s=soft_s + 2, soft_s=soft_s)
        assert took <= soft_s + scaled(10)
        queue_control.resume("w1")
        wait_until(lambda: fault_stack.job_store().get(job.id).attempts == 2, REDELIVERY_BOUND_S + scaled(10),
                   "the requeued job to start again")
        requeued_after = time.monotonic() - exited
        (rec,) = wait_terminal(fault_stack, [job.id], timeout=deadline(2)).values()
    finally:
        fault_stack.start_worker("w2")
    assert rec.state.value == "SUCCEEDED" and rec.attempts == 2, (rec.error, fault_stack.logs())
    assert [a for a, _ in attempt_history(fault_stack, job.id)] == [1, 2]
    assert_like_clean_run(fault_stack, job.id, clean_run)
    # Requeued at once by the worker leaving, not after the visibility timeout, and its lease
    # released on the way out.
    assert requeued_after < REDELIVERY_BOUND_S, f"took {requeued_after:.1f} s"
