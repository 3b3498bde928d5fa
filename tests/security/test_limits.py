"""Limits that depend on state or on the worker: jobs in flight per tenant (RESOURCE_EXHAUSTED
naming the limit and the count) and per-job sandbox limits clamped to the server's maximums.
Size, spec and dims limits are in test_bad_input.py."""

from __future__ import annotations

import hashlib
import threading
import uuid
from pathlib import Path

import grpc
import pytest

from fxport.client import Client, QueueFull
from fxport.config import Settings
from fxport.jobs import InputRef, JobRecord, SqliteJobStore, new_job_id
from fxport.manifest import Manifest
from fxport.service.auth import new_token, token_entry
from fxport.service.server import create_server
from fxport.spec import parse_spec
from fxport.storage import FileStore, input_key
from fxport.workers.jobs import WorkerContext, clamp_limits, execute_job
from tests.fixtures.servers import scaled


@pytest.fixture(scope="module")
def queue_only_server(redis_server, tmp_path_factory):
    """The real API + Redis with no worker on its queue (its own Redis db): jobs stay QUEUED."""
    tmp = tmp_path_factory.mktemp("in-flight")
    tokens = {t: new_token() for t in ("alice", "bob", "carol", "dave")}
    (tmp / "tokens").write_text("".join(token_entry(t, tok) + "\n" for t, tok in tokens.items()))
    broker = redis_server.url.rsplit("/", 1)[0] + "/9"
    srv, port = create_server(Settings(home=tmp / "home", listen="127.0.0.1:0", broker_url=broker,
                                       store=f"file://{tmp / 'store'}", tokens_file=tmp / "tokens",
                                       max_jobs_in_flight=2, log_format="text"))
    srv.start()
    model = tmp / "model.pt2"
    model.write_bytes(b"bytes the worker would look at; no worker listens here")
    yield f"127.0.0.1:{port}", tokens, model, broker
    srv.stop(grace=0)


def test_jobs_in_flight_per_tenant(queue_only_server):
    address, tokens, model, _ = queue_only_server
    with Client(address, token=tokens["alice"], queue_wait_s=0) as alice, \
            Client(address, token=tokens["bob"], queue_wait_s=0) as bob:
        first = alice.submit(model, {"targets": ["onnx"]}, idempotency_key="in-flight-1")
        alice.submit(model, {"targets": ["onnx"]}, idempotency_key="in-flight-2")
        with pytest.raises(QueueFull) as info:  # the tenant's queue is full: not a request too large
            alice.submit(model, {"targets": ["onnx"]}, idempotency_key="in-flight-3")
        assert info.value.exit_code == 4
        assert "tenant 'alice' has 2 jobs queued or running; the limit is 2 (FXPORT_MAX_JOBS_IN_FLIGHT)" \
            in str(info.value)
        # A retry of a job that exists is not a new job: answered, not refused.
        assert alice.submit(model, {"targets": ["onnx"]}, idempotency_key="in-flight-1").id == first.id
        # The limit is per tenant.
        assert bob.submit(model, {"targets": ["onnx"]}).state == "QUEUED"
        # A finished (here: cancelled) job no longer counts.
        assert alice.cancel(first.id).state == "CANCELLED"
        assert alice.submit(model, {"targets": ["onnx"]}, idempotency_key="in-flight-4").state == "QUEUED"


def test_a_stale_in_flight_index_never_refuses_a_submit(queue_only_server):
    """The count comes from an index beside the records; members left in it for jobs that are no
    longer in flight are found and dropped before a submit is refused."""
    import redis

    address, tokens, model, broker = queue_only_server
    index = "fxport:tenant:dave:in-flight"
    r = redis.Redis.from_url(broker, decode_responses=True)
    r.sadd(index, "finished-job-1", "finished-job-2")  # no records: not in flight
    with Client(address, token=tokens["dave"]) as dave:
        assert dave.submit(model, {"targets": ["onnx"]}).state == "QUEUED"
    assert r.smembers(index) and not {"finished-job-1", "finished-job-2"} & r.smembers(index)


def test_concurrent_submits_cannot_overshoot(queue_only_server):
    address, tokens, model, _ = queue_only_server
    outcomes: list[str] = []

    def submit(i: int) -> None:
        with Client(address, token=tokens["carol"], queue_wait_s=0) as carol:
            try:
                carol.submit(model, {"targets": ["onnx"]}, idempotency_key=f"race-{i}-{uuid.uuid4().hex}")
                outcomes.append("ok")
            except QueueFull:
                outcomes.append("refused")

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(scaled(60))
        assert not t.is_alive(), "a submit got no answer"
    assert sorted(outcomes) == ["ok", "ok", "refused", "refused", "refused"]
    # On the wire: RESOURCE_EXHAUSTED, refused from the header before the bytes are stored.
    from fxport.v1 import conversion_pb2 as pb
    from fxport.v1 import conversion_pb2_grpc as pb_grpc

    data = model.read_bytes()
    header = pb.SubmitHeader(spec="", model=pb.FileHeader(filename="m.pt2", size=len(data),
                                                          sha256=hashlib.sha256(data).hexdigest()))
    with grpc.insecure_channel(address) as ch:
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.ConversionServiceStub(ch).SubmitJob(
                iter([pb.SubmitJobRequest(header=header), pb.SubmitJobRequest(model_chunk=data)]),
                metadata=(("authorization", f"Bearer {tokens['carol']}"),), timeout=10)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "tenant 'carol' has 2 jobs queued or running; the limit is 2" in info.value.details()


# -- per-job sandbox limits, clamped in the worker ---------------------------------------------


def test_clamp_limits_keeps_what_is_within_the_maximums():
    settings = Settings(max_job_memory_mb=4096, max_job_timeout_s=600)
    spec = parse_spec({"limits": {"memory_mb": 2048, "timeout_s": 60}})
    assert clamp_limits(spec, settings) == (spec, [])
    big = parse_spec({"limits": {"memory_mb": 65536, "timeout_s": 7200}})
    clamped, notes = clamp_limits(big, settings)
    assert (clamped.limits.memory_mb, clamped.limits.timeout_s) == (4096, 600)
    assert notes == ["limits.memory_mb 65536 lowered to the server maximum 4096",
                     "limits.timeout_s 7200 lowered to the server maximum 600"]
    assert big.limits.memory_mb == 65536  # the record's spec is not mutated


def test_the_worker_runs_the_sandbox_within_the_server_maximums(tmp_path: Path):
    store, jobs = FileStore(tmp_path / "store"), SqliteJobStore(tmp_path / "jobs.db")
    seen = {}

    def engine(request, **_):
        spec = request.spec
        seen.update(memory_mb=spec.limits.memory_mb, spec_timeout=spec.limits.timeout_s, timeout_s=request.timeout_s)
        (request.out_dir / "model.onnx").write_bytes(b"onnx")
        return Manifest()

    ctx = WorkerContext(jobs=jobs, artifacts=store, engine=engine, worker_id="t",
                        settings=Settings(home=tmp_path, work_dir=tmp_path / "work", max_job_memory_mb=1024,
                                          max_job_timeout_s=120))
    data = b"model"
    sha = hashlib.sha256(data).hexdigest()
    (tmp_path / "m").write_bytes(data)
    store.put_file(input_key("default", sha), tmp_path / "m")
    spec = parse_spec({"targets": ["onnx"], "limits": {"memory_mb": 1 << 20, "timeout_s": 24 * 3600}})
    rec, _ = jobs.create(JobRecord(id=new_job_id(), tenant="default", spec=spec,
                                   spec_digest=spec.digest(),
                                   model=InputRef(sha256=sha, bytes=len(data), filename="m.pt2",
                                                  key=input_key("default", sha))))
    done = execute_job(rec.id, ctx)
    assert done.state.value == "SUCCEEDED"
    assert seen == {"memory_mb": 1024, "spec_timeout": 120, "timeout_s": 120}
    messages = [e.message for e in jobs.read_events(rec.id)]
    assert "limits.memory_mb 1048576 lowered to the server maximum 1024; " \
           "limits.timeout_s 86400 lowered to the server maximum 120" in messages
    jobs.close()
