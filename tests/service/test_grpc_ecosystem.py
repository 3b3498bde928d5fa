"""What generic gRPC tooling expects of the API, against one real server on 127.0.0.1 (tokens on,
metrics on): server reflection v1 and v1alpha, Health/List, and the per-RPC Prometheus
metrics (go-grpc-prometheus names) with fxport_build_info on the metrics endpoint."""

from __future__ import annotations

import hashlib
import platform
import re
import urllib.request

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2

import fxport
from fxport.cli.server import create_server
from fxport.config import Settings
from fxport.jobs import new_job_id
from fxport.service.auth import new_token, token_entry
from fxport.v1 import conversion_pb2 as pb
from fxport.v1 import conversion_pb2_grpc as pb_grpc
from tests.fixtures.servers import scaled, wait_until

SERVICES = {"fxport.v1.ConversionService", "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    home = tmp_path_factory.mktemp("ecosystem")
    token = new_token()
    (home / "tokens").write_text(token_entry("acme", token) + "\n")
    srv, port = create_server(Settings(home=home / "home", listen="127.0.0.1:0", tokens_file=home / "tokens",
                                       metrics_port=0, log_format="text"))
    srv.start()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield srv, channel, (("authorization", f"Bearer {token}"),)
    srv.stop(grace=0)


def reflect(channel: grpc.Channel, version: str, *requests: reflection_pb2.ServerReflectionRequest) -> list:
    """ServerReflectionInfo at grpc.reflection.{version} with no credentials. v1's messages are
    v1alpha's field for field (grpc-proto), so v1alpha's classes encode both."""
    call = channel.stream_stream(f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
                                 request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                                 response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
    return list(call(iter(requests), timeout=10))


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
def test_reflection_answers_as_v1_and_v1alpha_without_credentials(server, version):
    _, channel, _ = server
    listed, conversion, v1 = reflect(
        channel, version, reflection_pb2.ServerReflectionRequest(list_services=""),
        reflection_pb2.ServerReflectionRequest(file_containing_symbol="fxport.v1.ConversionService"),
        reflection_pb2.ServerReflectionRequest(file_containing_symbol="grpc.reflection.v1.ServerReflection"))
    assert {s.name for s in listed.list_services_response.service} == SERVICES
    files = {}
    for blob in conversion.file_descriptor_response.file_descriptor_proto:
        fdp = descriptor_pb2.FileDescriptorProto.FromString(blob)
        files[fdp.name] = fdp
    assert "SubmitJob" in {m.name for m in files["fxport/v1/conversion.proto"].service[0].method}
    # v1 describes itself: its own package, and v1alpha's messages field for field
    (blob,) = v1.file_descriptor_response.file_descriptor_proto
    v1_file = descriptor_pb2.FileDescriptorProto.FromString(blob)
    alpha = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(alpha)
    assert (v1_file.name, v1_file.package) == ("grpc/reflection/v1/reflection.proto", "grpc.reflection.v1")
    assert [(m.name, [(f.name, f.number, f.type) for f in m.field]) for m in v1_file.message_type] == \
        [(m.name, [(f.name, f.number, f.type) for f in m.field]) for m in alpha.message_type]


def test_health_list_reports_every_service_without_credentials(server):
    _, channel, _ = server
    resp = health_pb2_grpc.HealthStub(channel).List(health_pb2.HealthListRequest(), timeout=10)
    assert {name: s.status for name, s in resp.statuses.items()} == {
        "": health_pb2.HealthCheckResponse.SERVING,
        "fxport.v1.ConversionService": health_pb2.HealthCheckResponse.SERVING,
    }


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r"^((?:grpc_server|fxport)_[a-z_]+(?:\{[^}]*\})?) ([0-9.eE+-]+)$", text, re.M)}


def rpc(kind: str, rpc_type: str, service: str, method: str, code: str | None = None) -> str:
    code_label = f'grpc_code="{code}",' if code else ""
    return f'grpc_server_{kind}{{{code_label}grpc_method="{method}",grpc_service="{service}",grpc_type="{rpc_type}"}}'


def test_every_rpc_is_counted_by_method_and_code_and_timed(server):
    srv, channel, token = server
    stub = pb_grpc.ConversionServiceStub(channel)
    conv, health = "fxport.v1.ConversionService", "grpc.health.v1.Health"
    before = scrape(srv.metrics_port)
    # every method has its series from the first scrape
    assert rpc("started_total", "client_stream", conv, "SubmitJob") in before
    assert rpc("handled_total", "server_stream", conv, "DownloadArtifact", "OK") in before

    health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    calls = [  # (call, expected status)
        (lambda: stub.ListJobs(pb.ListJobsRequest(), timeout=10), grpc.StatusCode.UNAUTHENTICATED),
        (lambda: stub.GetJob(pb.GetJobRequest(job_id=new_job_id()), metadata=token, timeout=10),
         grpc.StatusCode.NOT_FOUND),
        (lambda: list(stub.WatchJob(pb.WatchJobRequest(job_id=new_job_id()), metadata=token, timeout=10)),
         grpc.StatusCode.NOT_FOUND),
        (lambda: stub.SubmitJob(iter([pb.SubmitJobRequest(header=pb.SubmitHeader(
            spec="targets: [tflite]", model=pb.FileHeader(filename="m.pt2", size=1,
                                                          sha256=hashlib.sha256(b"x").hexdigest())))]),
            metadata=token, timeout=10), grpc.StatusCode.INVALID_ARGUMENT),
    ]
    for call, code in calls:
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() == code
    # a stream the client walks away from ends Canceled on the server
    watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=30)
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    watch.cancel()
    canceled = rpc("handled_total", "server_stream", health, "Watch", "Canceled")
    after = wait_until(lambda: (m := scrape(srv.metrics_port)).get(canceled, 0) > before.get(canceled, 0) and m,
                       scaled(10), "the cancelled Health/Watch to be counted")

    expected = [
        ("unary", health, "Check", "OK"),
        ("unary", conv, "ListJobs", "Unauthenticated"),  # refused by auth: counted all the same
        ("unary", conv, "GetJob", "NotFound"),
        ("server_stream", conv, "WatchJob", "NotFound"),
        ("client_stream", conv, "SubmitJob", "InvalidArgument"),
        ("server_stream", health, "Watch", "Canceled"),
    ]
    for rpc_type, service, method, code in expected:
        for name in (rpc("started_total", rpc_type, service, method),
                     rpc("handled_total", rpc_type, service, method, code),
                     rpc("handling_seconds_count", rpc_type, service, method)):
            assert after.get(name, 0) - before.get(name, 0) == 1, name
        assert after[rpc("handling_seconds_sum", rpc_type, service, method)] > \
            before[rpc("handling_seconds_sum", rpc_type, service, method)]
    assert after[f'fxport_build_info{{python="{platform.python_version()}",'
                 f'torch="{_torch_version()}",version="{fxport.__version__}"}}'] == 1


def _torch_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return ""
