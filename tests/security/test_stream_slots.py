"""Streaming calls (WatchJob, SubmitJob, DownloadArtifact, Health/Watch, reflection) each hold
one of the API's RPC threads while they stay open. Tried as an attacker would: a tenant opening
every stream it can, on its own job that never ends, or a caller with no token opening health and
reflection streams, must leave other tenants' calls and the health check served. Before the
limits, 64 WatchJob streams from one tenant (the default thread count) left every other call,
the liveness probe's included, waiting until those streams closed.

The server here is the real API on a loopback port with the real Redis, and no worker on its
queue, so jobs stay QUEUED and their watches stay open."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client import REGISTRY

from fxport.client import Client, ServerBusy
from fxport.config import Settings
from fxport.service.auth import new_token, token_entry
from fxport.service.limits import StreamSlots
from fxport.service.server import create_server
from fxport.v1 import conversion_pb2 as pb
from fxport.v1 import conversion_pb2_grpc as pb_grpc
from tests.fixtures.servers import scaled

THREADS, PER_TENANT = 8, 3
SLOTS = THREADS - 2  # a quarter of the threads, at least 2, are kept for short calls and health checks
SPEC = {"targets": ["onnx"]}
ADMITTED = ("fxport-stream", "admitted")


@dataclass
class SlotsServer:
    address: str
    tokens: dict[str, str]
    model: Path
    channel: grpc.Channel
    slots: StreamSlots
    streams: list[Any] = field(default_factory=list)

    def metadata(self, tenant: str) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.tokens[tenant]}"),)

    @property
    def stub(self) -> pb_grpc.ConversionServiceStub:
        return pb_grpc.ConversionServiceStub(self.channel)

    def watch(self, tenant: str, job_id: str) -> Any:
        # the deadline only ends a stream a broken limit would have let through (it would never end)
        return self.stub.WatchJob(pb.WatchJobRequest(job_id=job_id), metadata=self.metadata(tenant),
                                  timeout=scaled(60))

    def admitted(self, call: Any) -> Any:
        """`call`, which the server must have admitted (an admitted stream sends its headers at
        once, marked); it is closed at the end of the test."""
        self.streams.append(call)
        assert ADMITTED in tuple(call.initial_metadata() or ()), call.details()
        return call

    def hold(self, tenant: str, job_id: str, n: int) -> list[Any]:
        """n admitted WatchJob streams of `tenant`. A stream the test closed frees its slot once
        the server sees it go, so a refusal is retried until a deadline."""
        held: list[Any] = []
        deadline = time.monotonic() + scaled(20)
        while len(held) < n:
            call = self.watch(tenant, job_id)
            if ADMITTED in tuple(call.initial_metadata() or ()):
                self.streams.append(call)
                held.append(call)
                continue
            err = _refused(call)
            assert time.monotonic() < deadline, f"{tenant}: a stream slot never freed up: {err.details()}"
            time.sleep(0.05)
        return held

    def close_all(self) -> None:
        """Close every stream the test opened, and wait until the server has seen each go."""
        for call in self.streams:
            call.cancel()
        self.streams.clear()
        deadline = time.monotonic() + scaled(20)
        while self.slots.open_streams():
            assert time.monotonic() < deadline, f"{self.slots.open_streams()} streams still hold a slot"
            time.sleep(0.02)


def _refused(call: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        next(call)
    err = info.value
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
    assert ("fxport-retry", "streams") in tuple(err.trailing_metadata() or ()), err.trailing_metadata()
    return err


def _refusals(limit: str) -> float:
    return REGISTRY.get_sample_value("fxport_streams_refused_total", {"limit": limit}) or 0.0


def _served(server: SlotsServer, tenant: str, job_id: str) -> None:
    """The calls that must never wait behind streams: health, and a tenant's short calls."""
    health = health_pb2_grpc.HealthStub(server.channel).Check(health_pb2.HealthCheckRequest(), timeout=scaled(10))
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    job = server.stub.GetJob(pb.GetJobRequest(job_id=job_id), metadata=server.metadata(tenant), timeout=scaled(10))
    assert job.id == job_id


@pytest.fixture(scope="module")
def slots_server(redis_server, tmp_path_factory) -> Iterator[SlotsServer]:
    tmp = tmp_path_factory.mktemp("stream-slots")
    tokens = {t: new_token() for t in ("alice", "bob", "carol")}
    (tmp / "tokens").write_text("".join(token_entry(t, tok) + "\n" for t, tok in tokens.items()))
    broker = redis_server.url.rsplit("/", 1)[0] + "/11"  # no worker listens here: jobs stay QUEUED
    settings = Settings(home=tmp / "home", listen="127.0.0.1:0", broker_url=broker, store=f"file://{tmp / 'store'}",
                        tokens_file=tmp / "tokens", grpc_max_workers=THREADS, max_streams_per_tenant=PER_TENANT,
                        log_format="text")
    assert settings.stream_slots == SLOTS
    srv, port = create_server(settings)
    srv.start()
    model = tmp / "model.pt2"
    model.write_bytes(b"bytes the worker would look at; no worker listens here")
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        assert srv.stream_slots is not None
        server = SlotsServer(f"127.0.0.1:{port}", tokens, model, channel, srv.stream_slots)
        try:
            yield server
        finally:
            server.close_all()
            srv.stop(grace=0)


@pytest.fixture()
def server(slots_server: SlotsServer) -> Iterator[SlotsServer]:
    try:
        yield slots_server
    finally:
        slots_server.close_all()


def _queued_job(server: SlotsServer, tenant: str) -> str:
    with Client(server.address, token=server.tokens[tenant]) as client:
        return client.submit(server.model, SPEC).id


def test_a_tenant_at_its_stream_limit_leaves_other_tenants_and_health_served(server):
    alice_job, bob_job = _queued_job(server, "alice"), _queued_job(server, "bob")
    server.hold("alice", alice_job, PER_TENANT)

    err = _refused(server.watch("alice", alice_job))
    assert (f"tenant 'alice' already holds {PER_TENANT} open streaming calls" in err.details()
            and f"the limit is {PER_TENANT} per tenant (FXPORT_MAX_STREAMS_PER_TENANT)" in err.details()), err.details()
    # Another tenant streams and calls as before, and the health check answers at once.
    server.admitted(server.watch("bob", bob_job))
    _served(server, "bob", bob_job)
    _served(server, "alice", alice_job)  # alice's own short calls too
    # A stream that ends gives its slot back.
    server.streams.pop(0).cancel()
    assert len(server.hold("alice", alice_job, 1)) == 1


def test_every_tenant_together_cannot_take_the_threads_short_calls_need(server):
    """Tenants each within their limit fill the server's stream slots: the next stream, from a
    tenant with none open, is refused naming the server's limit, and short calls still run."""
    alice_job, bob_job, carol_job = (_queued_job(server, t) for t in ("alice", "bob", "carol"))
    server.hold("alice", alice_job, PER_TENANT)
    server.hold("bob", bob_job, SLOTS - PER_TENANT)

    err = _refused(server.watch("carol", carol_job))
    assert (f"this API server has {SLOTS} streaming calls open, all of its {SLOTS} stream slots "
            f"(FXPORT_GRPC_MAX_WORKERS {THREADS} threads" in err.details()), err.details()
    _served(server, "carol", carol_job)
    # Short calls do not hold a slot: carol submits (a client stream, which needs one) once bob's end.
    server.close_all()
    assert _queued_job(server, "carol")


def test_calls_without_a_token_share_one_stream_count(server):
    """Health and reflection need no token: their streams count together, apart from any tenant's."""
    health = health_pb2_grpc.HealthStub(server.channel)
    stop = threading.Event()

    def reflection_requests() -> Iterator[reflection_pb2.ServerReflectionRequest]:
        yield reflection_pb2.ServerReflectionRequest(list_services="")
        stop.wait(scaled(60))  # the stream stays open, holding its thread, until the test ends

    try:
        reflection = reflection_pb2_grpc.ServerReflectionStub(server.channel).ServerReflectionInfo(
            reflection_requests(), timeout=scaled(60))
        server.admitted(reflection)
        for _ in range(PER_TENANT - 1):
            server.admitted(health.Watch(health_pb2.HealthCheckRequest(), timeout=scaled(60)))
        err = _refused(health.Watch(health_pb2.HealthCheckRequest(), timeout=scaled(60)))
        assert (f"callers without a token (health, reflection) already hold {PER_TENANT} open streaming calls"
                in err.details()), err.details()
        alice_job = _queued_job(server, "alice")
        server.admitted(server.watch("alice", alice_job))  # a tenant's count is its own
        _served(server, "alice", alice_job)
    finally:
        stop.set()


def test_the_client_follows_a_job_by_polling_while_its_tenant_has_no_stream_slot(server):
    job_id = _queued_job(server, "alice")
    server.hold("alice", job_id, PER_TENANT)
    refused_before = _refusals("caller")
    events: list[Any] = []
    outcome: dict[str, Any] = {}

    def wait() -> None:
        try:
            with Client(server.address, token=server.tokens["alice"]) as alice:
                outcome["job"] = alice.get(job_id).wait(timeout=scaled(60), on_event=events.append)
        except Exception as exc:  # noqa: BLE001 - reported by the assertions below
            outcome["error"] = exc

    waiter = threading.Thread(target=wait)
    waiter.start()
    deadline = time.monotonic() + scaled(20)
    while _refusals("caller") == refused_before and waiter.is_alive():  # its watch was refused: it polls
        assert time.monotonic() < deadline, "the waiting client's watch was never refused"
        time.sleep(0.02)
    with Client(server.address, token=server.tokens["alice"]) as alice:
        assert alice.cancel(job_id).state == "CANCELLED"
    waiter.join(scaled(60))
    assert not waiter.is_alive()
    assert "error" not in outcome, outcome.get("error")
    assert outcome["job"].state == "CANCELLED"
    assert events and events[-1].state == "CANCELLED" and events[-1].terminal


def test_a_submit_refused_for_want_of_a_slot_is_retried_then_named(server):
    job_id = _queued_job(server, "alice")
    held = server.hold("alice", job_id, PER_TENANT)
    with Client(server.address, token=server.tokens["alice"], retry_s=0.5) as impatient:
        with pytest.raises(ServerBusy) as info:
            impatient.submit(server.model, SPEC)
    assert "FXPORT_MAX_STREAMS_PER_TENANT" in str(info.value) and info.value.exit_code == 4

    refused_before = _refusals("caller")
    outcome: dict[str, Any] = {}

    def submit() -> None:
        try:
            with Client(server.address, token=server.tokens["alice"], retry_s=scaled(60)) as patient:
                outcome["job"] = patient.submit(server.model, SPEC)
        except Exception as exc:  # noqa: BLE001 - reported by the assertions below
            outcome["error"] = exc

    submitter = threading.Thread(target=submit)
    submitter.start()
    deadline = time.monotonic() + scaled(20)
    while _refusals("caller") == refused_before and submitter.is_alive():
        assert time.monotonic() < deadline, "the submit was never refused"
        time.sleep(0.02)
    held[0].cancel()  # a slot frees up: the retry goes through
    submitter.join(scaled(60))
    assert not submitter.is_alive()
    assert "error" not in outcome, outcome.get("error")
    assert outcome["job"].state == "QUEUED"
