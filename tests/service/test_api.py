"""The API's answers to bad requests: status codes, field violations, size limits, health."""

from __future__ import annotations

import hashlib

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from fxport.cli.server import create_server
from fxport.config import Settings
from fxport.jobs import new_job_id
from fxport.v1 import conversion_pb2 as pb
from fxport.v1 import conversion_pb2_grpc as pb_grpc

MAX = 64 << 10


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    home = tmp_path_factory.mktemp("api-home")
    srv, port = create_server(Settings(home=home, listen="127.0.0.1:0", max_upload_bytes=MAX, log_format="text"))
    srv.start()
    yield srv, port
    srv.stop(grace=0)


@pytest.fixture()
def stub(server):
    with grpc.insecure_channel(f"127.0.0.1:{server[1]}") as ch:
        yield pb_grpc.ConversionServiceStub(ch)


def submit(stub, spec: str, data: bytes, *, size: int | None = None, sha: str | None = None, chunk: int = 1 << 14,
           stored: bool = False):
    header = pb.SubmitHeader(spec=spec, model=pb.FileHeader(
        filename="m.pt2", size=len(data) if size is None else size,
        sha256=hashlib.sha256(data).hexdigest() if sha is None else sha, stored=stored))

    def requests():
        yield pb.SubmitJobRequest(header=header)
        for i in range(0, len(data), chunk):
            yield pb.SubmitJobRequest(model_chunk=data[i:i + chunk])

    return stub.SubmitJob(requests(), timeout=10)


def test_invalid_spec_is_invalid_argument_with_field_violations(stub, server):
    with pytest.raises(grpc.RpcError) as info:
        submit(stub, "targets: [onnx, tflite]\npasses: [fuse_conv_bn, no_such_pass]\n", b"x" * 10)
    err = info.value
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    status = rpc_status.from_call(err)
    bad = error_details_pb2.BadRequest()
    assert status.details[0].Unpack(bad)
    fields = {v.field: v.description for v in bad.field_violations}
    assert "targets[1]" in fields and "tflite" in fields["targets[1]"]
    assert "passes[1]" in fields and "fuse_conv_bn" in fields["passes[1]"]  # lists the valid names
    assert "targets[1]" in err.details()  # readable without the details too
    # Nothing was stored for the refused submit.
    store = server[0].settings.home / "store" / "objects"
    assert not any(p.is_file() for p in store.rglob("*"))


def test_spec_syntax_error_names_the_line(stub):
    with pytest.raises(grpc.RpcError) as info:
        submit(stub, "targets: [onnx\nprecision: fp32\n", b"x")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "line" in info.value.details()


def test_oversized_upload_is_resource_exhausted(stub):
    # Declared honestly: refused from the header, before any byte is spooled.
    with pytest.raises(grpc.RpcError) as info:
        submit(stub, "", b"x" * (MAX + 1))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # Declared small, sent big: refused once the running total crosses the limit.
    with pytest.raises(grpc.RpcError) as info:
        submit(stub, "", b"y" * (MAX * 2), size=100, sha="")
    assert info.value.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT)
    with pytest.raises(grpc.RpcError) as info:
        submit(stub, "", b"y" * (MAX * 2), size=0, sha="")
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert str(MAX) in info.value.details()


def test_corrupted_upload_is_refused(stub):
    with pytest.raises(grpc.RpcError) as info:
        submit(stub, "", b"abc" * 100, sha="0" * 64)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sha256" in info.value.details()


def test_stored_flag_for_unknown_input_is_failed_precondition(stub):
    resp = stub.CheckUpload(pb.CheckUploadRequest(model_sha256="1" * 64), timeout=5)
    assert not resp.model_present and resp.max_upload_bytes == MAX
    with pytest.raises(grpc.RpcError) as info:
        submit(stub, "", b"", size=0, sha="1" * 64, stored=True)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_missing_job_is_not_found_and_malformed_id_invalid(stub):
    missing = new_job_id()
    for call, req in ((stub.GetJob, pb.GetJobRequest(job_id=missing)),
                      (stub.CancelJob, pb.CancelJobRequest(job_id=missing)),
                      (stub.GetArtifactUrl, pb.GetArtifactUrlRequest(job_id=missing, name="model.onnx"))):
        with pytest.raises(grpc.RpcError) as info:
            call(req, timeout=5)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
    for stream in (stub.WatchJob(pb.WatchJobRequest(job_id=missing), timeout=5),
                   stub.DownloadArtifact(pb.DownloadArtifactRequest(job_id=missing, name="x"), timeout=5)):
        with pytest.raises(grpc.RpcError) as info:
            list(stream)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as info:
        stub.GetJob(pb.GetJobRequest(job_id="../../etc/passwd"), timeout=5)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_bad_page_token_is_invalid_argument(stub):
    with pytest.raises(grpc.RpcError) as info:
        stub.ListJobs(pb.ListJobsRequest(page_token="garbage"), timeout=5)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_health_and_reflection(server):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{server[1]}") as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for name in ("", "fxport.v1.ConversionService"):
            assert health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status == \
                health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        resp = next(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                              timeout=5))
        names = {s.name for s in resp.list_services_response.service}
        assert {"fxport.v1.ConversionService", "grpc.health.v1.Health"} <= names


def test_server_binds_loopback_by_default():
    assert Settings().listen.startswith("127.0.0.1:")


def test_a_filtered_listing_pages_past_the_share_one_call_examines(server, monkeypatch):
    """ListJobs examines a bounded number of the tenant's jobs per call (JobStore.LIST_SCAN_LIMIT):
    a filter that matches only an old job comes back short, with a token, and `fxport jobs list`
    follows the tokens until its page is full or none are left."""
    import json as _json
    import time as _time

    from typer.testing import CliRunner

    from fxport.cli import app
    from fxport.jobs import InputRef, JobRecord, JobState, SqliteJobStore

    srv, port = server
    monkeypatch.setattr(SqliteJobStore, "LIST_SCAN_LIMIT", 5)
    store = SqliteJobStore(srv.settings.home / "jobs.db")  # the server's own job store (WAL: shared)
    marker = f"old-{new_job_id()}"
    now = _time.time()
    try:
        def made(i: float, labels: dict[str, str]) -> str:
            rec = JobRecord(id=new_job_id(now - 100 + i), tenant="default", state=JobState.CANCELLED, labels=labels,
                            model=InputRef(sha256="0" * 64, bytes=1, key="k"))
            return store.create(rec)[0].id
        wanted = made(0, {"marker": marker})
        for i in range(12):
            made(1 + i, {"marker": "other"})
    finally:
        store.close()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        first = pb_grpc.ConversionServiceStub(ch).ListJobs(pb.ListJobsRequest(labels={"marker": marker}), timeout=10)
    assert not first.jobs and first.next_page_token  # 5 examined, no match yet
    res = CliRunner().invoke(app, ["jobs", "list", "--label", f"marker={marker}", "--server", f"127.0.0.1:{port}",
                                   "--json"])
    assert res.exit_code == 0, res.output
    listed = _json.loads(res.stdout)
    assert [j["job_id"] for j in listed["jobs"]] == [wanted] and listed["next_page_token"] == ""
