"""Capacity every tenant of an API process shares, tried as an attacker would.

Its RPC threads: streaming calls (WatchJob, SubmitJob, DownloadArtifact, Health/Watch,
reflection) each hold one while they stay open. A tenant opening every stream it can, on its own
job that never ends, or a caller with no token opening health and reflection streams, must leave
other tenants' calls and the health check served. Before the limits, 64 WatchJob streams from one
tenant (the default thread count) left every other call, the liveness probe's included, waiting
until those streams closed.

Its upload spool: a tenant streaming uploads it never finishes must not fill it, where every
other tenant's upload would fail on a full disk (and Kubernetes evicts a pod whose spool emptyDir
passes its size limit).

The server here is the real API on a loopback port with the real Redis, and no worker on its
queue, so jobs stay QUEUED and their watches stay open."""

from __future__ import annotations

import json
import os
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
from fxport.service.limits import UPLOADS, CallSlots, SpoolBudget, StreamSlots
from fxport.service.server import create_server
from fxport.v1 import conversion_pb2 as pb
from fxport.v1 import conversion_pb2_grpc as pb_grpc
from tests.fixtures.servers import scaled, wait_until

THREADS, PER_TENANT, CALLS_PER_TENANT, UPLOADS_PER_TENANT = 8, 3, 2, 2
SLOTS = THREADS - 2  # a quarter of the threads, at least 2, are kept for short calls and health checks
MIB = 1 << 20
MAX_UPLOAD, SPOOL = MIB, 2 * MIB  # a tenant may spool half: one maximal upload
SPEC = {"targets": ["onnx"]}
ADMITTED = ("fxport-stream", "admitted")


@dataclass
class SlotsServer:
    address: str
    tokens: dict[str, str]
    model: Path
    channel: grpc.Channel
    slots: StreamSlots
    spool: SpoolBudget
    calls: CallSlots
    streams: list[Any] = field(default_factory=list)
    stop_uploads: threading.Event = field(default_factory=threading.Event)

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

    def hold_upload(self, tenant: str, size: int, stop: threading.Event | None = None) -> Any:
        """A SubmitJob of `tenant` declaring `size` bytes (none: 0) that sends 1 KiB and then waits
        for `stop` (or the end of the test): the spool it reserved stays taken meanwhile."""
        stop = stop or self.stop_uploads

        def requests() -> Iterator[pb.SubmitJobRequest]:
            yield pb.SubmitJobRequest(header=pb.SubmitHeader(spec=json.dumps(SPEC), model=pb.FileHeader(
                filename="never-finished.pt2", size=size)))
            yield pb.SubmitJobRequest(model_chunk=b"\0" * 1024)
            stop.wait(scaled(60))

        call = self.stub.SubmitJob.future(requests(), metadata=self.metadata(tenant), timeout=scaled(60))
        self.streams.append(call)
        return call

    def wait_spool(self, tenant: str, held: int) -> None:
        deadline = time.monotonic() + scaled(20)
        while self.spool.held(tenant) != held:
            assert time.monotonic() < deadline, f"{tenant} spools {self.spool.held(tenant)} bytes, not {held}"
            time.sleep(0.02)

    def close_all(self) -> None:
        """Close every stream the test opened, and wait until the server has seen each go."""
        self.stop_uploads.set()
        for call in self.streams:
            call.cancel()
        self.streams.clear()
        deadline = time.monotonic() + scaled(20)
        while self.slots.held() or self.spool.held():
            assert time.monotonic() < deadline, (f"{self.slots.held()} streams still hold a slot, "
                                                 f"{self.spool.held()} bytes still spooled")
            time.sleep(0.02)
        self.stop_uploads.clear()


def _refused(call: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        next(call)
    err = info.value
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
    assert ("fxport-retry", "busy") in tuple(err.trailing_metadata() or ()), err.trailing_metadata()
    return err


def _refusals(resource: str, limit: str = "tenant") -> float:
    return REGISTRY.get_sample_value("fxport_busy_refusals_total", {"resource": resource, "limit": limit}) or 0.0


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
                        max_calls_per_tenant=CALLS_PER_TENANT, max_uploads_per_tenant=UPLOADS_PER_TENANT,
                        max_upload_bytes=MAX_UPLOAD, max_spool_bytes=SPOOL, log_format="text")
    assert settings.stream_slots == SLOTS
    srv, port = create_server(settings)
    srv.start()
    model = tmp / "model.pt2"
    model.write_bytes(b"bytes the worker would look at; no worker listens here")
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        assert srv.stream_slots is not None and srv.spool is not None and srv.call_slots is not None
        server = SlotsServer(f"127.0.0.1:{port}", tokens, model, channel, srv.stream_slots, srv.spool, srv.call_slots)
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
    refused_before = _refusals("streams")
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
    while _refusals("streams") == refused_before and waiter.is_alive():  # its watch was refused: it polls
        assert time.monotonic() < deadline, "the waiting client's watch was never refused"
        time.sleep(0.02)
    with Client(server.address, token=server.tokens["alice"]) as alice:
        assert alice.cancel(job_id).state == "CANCELLED"
    waiter.join(scaled(60))
    assert not waiter.is_alive()
    assert "error" not in outcome, outcome.get("error")
    assert outcome["job"].state == "CANCELLED"
    assert events and events[-1].state == "CANCELLED" and events[-1].terminal


def test_watches_holding_every_stream_slot_leave_the_tenants_submits_their_own(server):
    """A burst of CI pipelines each waiting on its job (a WatchJob stream each) used to take the
    slots their own submits needed: submits now count against FXPORT_MAX_UPLOADS_PER_TENANT."""
    job_id = _queued_job(server, "alice")
    server.hold("alice", job_id, PER_TENANT)  # every stream slot of alice's, watching
    with Client(server.address, token=server.tokens["alice"], retry_s=0.5) as impatient:
        assert impatient.submit(server.model, SPEC).state == "QUEUED"  # at once: not refused, not retried


def test_a_submit_refused_for_want_of_a_slot_is_retried_then_named(server):
    held = [server.hold_upload("alice", 4096) for _ in range(UPLOADS_PER_TENANT)]  # every submit slot of alice's
    wait_until(lambda: server.slots.held("alice" + UPLOADS) == UPLOADS_PER_TENANT, scaled(20),
               "alice's submits to hold their slots")
    with Client(server.address, token=server.tokens["alice"], retry_s=0.5) as impatient:
        with pytest.raises(ServerBusy) as info:
            impatient.submit(server.model, SPEC)
    assert "FXPORT_MAX_UPLOADS_PER_TENANT" in str(info.value) and info.value.exit_code == 4

    refused_before = _refusals("streams")
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
    while _refusals("streams") == refused_before and submitter.is_alive():
        assert time.monotonic() < deadline, "the submit was never refused"
        time.sleep(0.02)
    held[0].cancel()  # a submit slot frees up: the retry goes through
    submitter.join(scaled(60))
    assert not submitter.is_alive()
    assert "error" not in outcome, outcome.get("error")
    assert outcome["job"].state == "QUEUED"


def _file(path: Path, size: int) -> Path:
    path.write_bytes(os.urandom(size))
    return path


def test_a_tenant_at_its_call_limit_is_refused_busy_and_others_are_served(server):
    """Calls that answer at once hold a thread while they run, and the server takes calls in the
    order they arrive: a tenant with CALLS_PER_TENANT of them in progress (held here, as slow
    calls would) is refused its next one at once, while other tenants and health are served; the
    fxport client retries until one of its calls ends."""
    alice_job, bob_job = _queued_job(server, "alice"), _queued_job(server, "bob")
    for _ in range(CALLS_PER_TENANT):
        assert server.calls.take("alice") is None
    released = 0
    try:
        before = _refusals("calls")
        with pytest.raises(grpc.RpcError) as info:
            server.stub.GetJob(pb.GetJobRequest(job_id=alice_job), metadata=server.metadata("alice"),
                               timeout=scaled(10))
        err = info.value
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
        assert ("fxport-retry", "busy") in tuple(err.trailing_metadata() or ())
        assert (f"tenant 'alice' already has {CALLS_PER_TENANT} calls in progress" in err.details()
                and "(FXPORT_MAX_CALLS_PER_TENANT)" in err.details()), err.details()
        assert _refusals("calls") == before + 1
        _served(server, "bob", bob_job)
        # the client retries a busy refusal: alice's call goes through once one of hers ends
        timer = threading.Timer(0.5, server.calls.release, ("alice",))
        timer.start()
        with Client(server.address, token=server.tokens["alice"]) as alice:
            assert alice.get(alice_job).id == alice_job
        timer.join()
        released = 1
    finally:
        for _ in range(CALLS_PER_TENANT - released):
            server.calls.release("alice")


def test_a_flood_of_one_tenants_calls_leaves_health_and_other_tenants_served(server):
    """Many more filtered ListJobs at once than the server has threads, in a loop, from one tenant:
    it never has more than its share in progress, the rest are refused busy, and health and
    another tenant are answered meanwhile."""
    bob_job = _queued_job(server, "bob")
    stop, outcomes, most = threading.Event(), {"ok": 0, "busy": 0}, [0]
    lock = threading.Lock()

    def flood() -> None:
        stub = pb_grpc.ConversionServiceStub(server.channel)
        while not stop.is_set():
            try:
                stub.ListJobs(pb.ListJobsRequest(labels={"nope": "x"}), metadata=server.metadata("alice"),
                              timeout=scaled(30))
                kind = "ok"
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
                kind = "busy"
            with lock:
                outcomes[kind] += 1
                most[0] = max(most[0], server.calls.held("alice"))

    threads = [threading.Thread(target=flood, daemon=True) for _ in range(8 * THREADS)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: outcomes["busy"] >= 8 * THREADS, scaled(30), "alice's flood refused in part")
        for _ in range(3):
            _served(server, "bob", bob_job)
    finally:
        stop.set()
        for t in threads:
            t.join(scaled(30))
    assert outcomes["ok"] > 0 and most[0] <= CALLS_PER_TENANT, (outcomes, most)


def test_one_tenant_cannot_fill_the_upload_spool(server, tmp_path):
    stalled = server.hold_upload("alice", MAX_UPLOAD)  # alice's whole share, never finished
    server.wait_spool("alice", MAX_UPLOAD)

    with Client(server.address, token=server.tokens["alice"], retry_s=0.5) as impatient:
        with pytest.raises(ServerBusy) as info:
            impatient.submit(_file(tmp_path / "small.pt2", 100 << 10), SPEC)
    assert (f"tenant 'alice' already has {MAX_UPLOAD} bytes of uploads in this API server's spool" in str(info.value)
            and "half of FXPORT_MAX_SPOOL_BYTES" in str(info.value)), info.value
    assert info.value.exit_code == 4
    # An upload that declares no size is counted as its bytes arrive: refused at its first chunk.
    err = _refused_future(server.hold_upload("alice", 0))
    assert "tenant 'alice' already has" in err.details(), err.details()
    # Other tenants upload as before, up to the whole spool.
    with Client(server.address, token=server.tokens["bob"]) as bob:
        assert bob.submit(_file(tmp_path / "big.pt2", MAX_UPLOAD), SPEC).state == "QUEUED"
    # An unfinished upload gives its share back when it ends.
    server.stop_uploads.set()
    with pytest.raises(grpc.RpcError) as ended:
        stalled.result(timeout=scaled(30))
    assert ended.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "ended after 1024" in ended.value.details()
    server.wait_spool("alice", 0)


def test_tenants_together_cannot_pass_the_spool_limit(server, tmp_path):
    release_bob = threading.Event()
    server.hold_upload("alice", MAX_UPLOAD)
    bobs = server.hold_upload("bob", MAX_UPLOAD, release_bob)
    server.wait_spool("alice", MAX_UPLOAD)
    server.wait_spool("bob", MAX_UPLOAD)
    model = _file(tmp_path / "carol.pt2", 100 << 10)

    with Client(server.address, token=server.tokens["carol"], retry_s=0.5) as impatient:
        with pytest.raises(ServerBusy) as info:
            impatient.submit(model, SPEC)
    assert (f"this API server's spool holds {SPOOL} bytes of uploads in flight" in str(info.value)
            and "FXPORT_MAX_SPOOL_BYTES" in str(info.value)), info.value

    refused_before = _refusals("spool", "server")
    outcome: dict[str, Any] = {}

    def submit() -> None:
        try:
            with Client(server.address, token=server.tokens["carol"], retry_s=scaled(60)) as patient:
                outcome["job"] = patient.submit(model, SPEC)
        except Exception as exc:  # noqa: BLE001 - reported by the assertions below
            outcome["error"] = exc

    submitter = threading.Thread(target=submit)
    submitter.start()
    deadline = time.monotonic() + scaled(20)
    while _refusals("spool", "server") == refused_before and submitter.is_alive():
        assert time.monotonic() < deadline, "carol's submit was never refused"
        time.sleep(0.02)
    release_bob.set()  # bob's upload ends (incomplete): its bytes leave the spool and carol's retry goes in
    with pytest.raises(grpc.RpcError):
        bobs.result(timeout=scaled(30))
    submitter.join(scaled(60))
    assert not submitter.is_alive()
    assert "error" not in outcome, outcome.get("error")
    assert outcome["job"].state == "QUEUED"


def test_an_upload_no_spool_share_could_hold_is_refused_as_too_large(server, tmp_path):
    """A model and a calibration file each within the upload limit, together past a tenant's spool
    share, could never be taken: refused at once as too large, not as busy (no retry would help)."""
    header = pb.SubmitHeader(spec=json.dumps(SPEC), model=pb.FileHeader(filename="m.pt2", size=MAX_UPLOAD),
                             calibration=pb.FileHeader(filename="c.npz", size=MAX_UPLOAD))
    with pytest.raises(grpc.RpcError) as info:
        server.stub.SubmitJob(iter([pb.SubmitJobRequest(header=header)]), metadata=server.metadata("alice"),
                              timeout=scaled(30))
    err = info.value
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert ("fxport-retry", "busy") not in tuple(err.trailing_metadata() or ())
    assert (f"this upload needs {2 * MAX_UPLOAD} bytes of the API server's spool, more than one tenant may hold, "
            f"{MAX_UPLOAD}" in err.details()), err.details()
    assert server.spool.held() == 0


def _refused_future(call: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call.result(timeout=scaled(30))
    err = info.value
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
    assert ("fxport-retry", "busy") in tuple(err.trailing_metadata() or ()), err.trailing_metadata()
    return err


def test_an_upload_limit_no_tenant_could_spool_is_refused_at_start():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=r"max_upload_bytes \(7516192768\) is more than half of max_spool_bytes "
                                              r"\(12884901888\).*raise FXPORT_MAX_SPOOL_BYTES"):
        Settings(max_upload_bytes=7 << 30)
    assert Settings(max_upload_bytes=7 << 30, max_spool_bytes=14 << 30).max_upload_bytes == 7 << 30
