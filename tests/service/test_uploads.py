"""Large models reach the store without waiting for the whole upload, against real servers
(the session's Redis, SeaweedFS and workers; an API of this module's with Prometheus metrics):

- straight from the client, through a presigned PUT the API hands out (CheckUpload), which can
  store only the bytes it was signed for; where the store cannot be reached from the client,
  the bytes go through the API instead;
- through the API, on to S3 while they arrive (service/uploads.py mirror, S3Store.stream_upload);
  the object appears only if the bytes hash to the declared sha256.

The API's metrics count what passed through it (`fxport_upload_bytes_total`) and what it let
clients send past it (`fxport_direct_upload_bytes_total`).
"""

from __future__ import annotations

import hashlib
import os
import re
import urllib.request

import grpc
import pytest

import fxport.client.presigned
from fxport.client import Client
from fxport.storage import S3Store, input_key
from fxport.v1 import conversion_pb2 as pb
from fxport.v1 import conversion_pb2_grpc as pb_grpc
from tests.fixtures.servers import free_port, start_api

pytestmark = pytest.mark.slow
SIZE = 20 << 20  # above STREAM_TO_STORE_BYTES and FXPORT_DIRECT_UPLOAD_MIN_BYTES: several multipart parts
SPEC = {"targets": ["fx_source"]}  # the uploads are what matters here: each job is cancelled at once


class MeteredApi:
    def __init__(self, address: str, metrics_port: int) -> None:
        self.address, self.metrics_port = address, metrics_port

    def metric(self, name: str, kind: str = "model") -> float:
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).read().decode()
        sample = f'{name}{{kind="{kind}"}} '
        return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(sample))

    def through_api(self) -> float:
        return self.metric("fxport_upload_bytes_total")

    def past_api(self) -> float:
        return self.metric("fxport_direct_upload_bytes_total")


@pytest.fixture(scope="module")
def metered_api(tmp_path_factory, distributed_stack):
    base = tmp_path_factory.mktemp("metered-api")
    port = free_port()
    api = start_api(base, {**distributed_stack.env, "FXPORT_HOME": str(base / "home"),
                           "FXPORT_METRICS_PORT": str(port)}, name="metered-api")
    yield MeteredApi(api.address, port)
    api.stop()


def _random_file(path, size=SIZE):
    path.write_bytes(os.urandom(size))
    return path, hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_new_large_model_goes_straight_to_the_store_never_through_the_api(metered_api, distributed_stack, tmp_path):
    store = distributed_stack.artifact_store()
    model, sha = _random_file(tmp_path / "big.bin")
    through, past = metered_api.through_api(), metered_api.past_api()
    with Client(metered_api.address) as client:
        job = client.submit(model, SPEC)
        client.cancel(job.id)
        assert job.upload == {"sent_bytes": SIZE, "skipped": None, "direct": True}
        assert job.message.model.sha256 == sha and job.message.model.bytes == SIZE
        assert metered_api.through_api() == through  # not one byte through the API
        assert metered_api.past_api() == past + SIZE
        stored = store.head(input_key("default", sha))
        assert stored.sha256 == sha and stored.bytes == SIZE
        assert hashlib.sha256(b"".join(store.iter_chunks(stored.key))).hexdigest() == sha

        # The same bytes again: no URL, no bytes, the object not written again.
        again = client.submit(model, {"targets": ["onnx"]})
        client.cancel(again.id)
    assert again.upload == {"sent_bytes": 0, "skipped": "model_stored", "direct": False}
    assert metered_api.past_api() == past + SIZE and metered_api.through_api() == through
    assert store.head(input_key("default", sha)).version == stored.version


def test_an_upload_url_stores_only_the_bytes_it_was_signed_for(metered_api, distributed_stack, tmp_path):
    store = distributed_stack.artifact_store()
    model, sha = _random_file(tmp_path / "signed.bin")
    with Client(metered_api.address) as client:
        offer = client._call(client._stub.CheckUpload, pb.CheckUploadRequest(
            model_sha256=sha, model_size=SIZE, direct_upload=True, no_cache=True, spec="targets: [onnx]")).model_upload
    assert offer.url and offer.expires_at.seconds
    key = input_key("default", sha)
    tampered = tmp_path / "tampered.bin"
    tampered.write_bytes(model.read_bytes()[:-1] + b"\0")
    with pytest.raises(fxport.client.presigned.DirectUnavailable, match="400"):  # the store hashed the body: BadDigest
        fxport.client.presigned.put_file(offer.url, offer.headers, tampered)
    for name, value in (("x-amz-meta-sha256", "0" * 64), ("Content-Length", str(SIZE - 1))):
        with pytest.raises(fxport.client.presigned.DirectUnavailable, match="403"):  # not the headers it signs
            body = model if name != "Content-Length" else _random_file(tmp_path / "short.bin", SIZE - 1)[0]
            fxport.client.presigned.put_file(offer.url, {**offer.headers, name: value}, body)
    assert store.head(key) is None
    fxport.client.presigned.put_file(offer.url, offer.headers, model)
    assert store.head(key).sha256 == sha


def test_a_store_the_client_cannot_reach_gets_the_bytes_through_the_api(metered_api, distributed_stack, tmp_path,
                                                                       monkeypatch):
    model, sha = _random_file(tmp_path / "internal.bin")
    real = fxport.client.presigned.put_file
    # The store's endpoint is cluster-internal: from the client, nothing answers there.
    monkeypatch.setattr(fxport.client.presigned, "put_file",
                        lambda url, headers, path: real(re.sub(r"//[^/]+/", "//127.0.0.1:1/", url, count=1),
                                                        headers, path))
    through, past = metered_api.through_api(), metered_api.past_api()
    with Client(metered_api.address) as client:
        job = client.submit(model, SPEC)
        client.cancel(job.id)
        assert client._direct_upload_works is False  # and it stops asking for URLs
    assert job.upload == {"sent_bytes": SIZE, "skipped": None, "direct": False}
    assert metered_api.through_api() == through + SIZE
    assert metered_api.past_api() == past + SIZE  # the URL was handed out, then not used
    assert distributed_stack.artifact_store().head(input_key("default", sha)).sha256 == sha


def test_a_stored_model_that_does_not_match_its_digest_fails_the_job_and_is_removed(distributed_stack, tmp_path):
    """A direct upload to a store that does not check x-amz-checksum-sha256 could leave other
    bytes under a model's content address: the worker's fetch finds out, fails the job as
    invalid input, and removes them, so that the next submit uploads the model again."""
    model, sha = _random_file(tmp_path / "claimed.bin", 1 << 20)
    s3, store = distributed_stack.s3, distributed_stack.artifact_store()
    key = input_key("default", sha)
    s3.client().put_object(Bucket=s3.bucket, Key=store.prefix + key, Body=os.urandom(1 << 20),
                           Metadata={"sha256": sha})  # not the bytes the digest names
    with Client(distributed_stack.address) as client:
        job = client.submit(model, SPEC)
        assert job.upload["skipped"] == "model_stored"
        job.wait(timeout=120)
    assert job.state == "FAILED"
    assert job.error["code"] == "invalid_input" and job.error["stage"] == "load", job.error
    assert "does not hash to its sha256" in job.error["message"] and "submit the job again" in job.error["message"]
    assert store.head(key) is None


def test_stream_upload_completes_with_the_declared_digest_or_leaves_nothing(s3_server):
    store = S3Store(s3_server.bucket, f"stream-{os.getpid()}", endpoint_url=s3_server.endpoint)
    data = os.urandom(SIZE + 12345)
    sha = hashlib.sha256(data).hexdigest()
    up = store.stream_upload(input_key("default", sha), sha)
    for i in range(0, len(data), 1 << 20):
        up.write(data[i:i + (1 << 20)])
    stored = up.complete()
    assert store.head(stored.key) == stored and stored.bytes == len(data)
    assert hashlib.sha256(b"".join(store.iter_chunks(stored.key))).hexdigest() == sha

    other = "0" * 64
    up = store.stream_upload(input_key("default", other), other)
    up.write(data[: 9 << 20])
    up.abort()
    assert store.head(input_key("default", other)) is None


def test_large_upload_is_stored_while_it_arrives_and_a_corrupt_one_leaves_nothing(distributed_stack, tmp_path):
    store = distributed_stack.artifact_store()
    model = tmp_path / "big.bin"
    model.write_bytes(os.urandom(SIZE))
    sha = hashlib.sha256(model.read_bytes()).hexdigest()
    with Client(distributed_stack.address, direct_upload=False) as client:  # through the API
        job = client.submit(model, {"targets": ["fx_source"]})
        client.cancel(job.id)  # not a model: only the upload matters here
    assert job.upload == {"sent_bytes": SIZE, "skipped": None, "direct": False}
    assert store.head(input_key("default", sha)).sha256 == sha
    assert "received_s" in distributed_stack.api.process.log.read_text()

    # Declared digest ≠ the bytes: refused, and nothing appears under the declared key.
    wrong = hashlib.sha256(b"something else").hexdigest()
    header = pb.SubmitHeader(spec='{"targets": ["fx_source"]}',
                             model=pb.FileHeader(filename="big.bin", size=SIZE, sha256=wrong))

    def requests():
        yield pb.SubmitJobRequest(header=header)
        with open(model, "rb") as f:
            while chunk := f.read(1 << 20):
                yield pb.SubmitJobRequest(model_chunk=chunk)

    with grpc.insecure_channel(distributed_stack.address) as channel:
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.ConversionServiceStub(channel).SubmitJob(requests(), timeout=120)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "corrupted in transit" in err.value.details()
    assert store.head(input_key("default", wrong)) is None


def test_no_upload_url_for_a_tenant_at_its_in_flight_limit(redis_server, s3_server, tmp_path):
    """SubmitJob refuses a tenant at FXPORT_MAX_JOBS_IN_FLIGHT before any byte moves; CheckUpload
    hands it no URL either, so no bytes go to the store for a submit that will be refused."""
    from fxport.config import Settings
    from fxport.service.server import create_server

    broker = redis_server.url.rsplit("/", 1)[0] + "/10"  # no worker listens here: jobs stay QUEUED
    srv, port = create_server(Settings(home=tmp_path / "home", listen="127.0.0.1:0", broker_url=broker,
                                       store=f"s3://{s3_server.bucket}/in-flight-{os.getpid()}",
                                       max_jobs_in_flight=1, log_format="text"))
    srv.start()
    try:
        first, _ = _random_file(tmp_path / "first.bin")
        second, sha = _random_file(tmp_path / "second.bin")
        with Client(f"127.0.0.1:{port}") as client:
            assert client.submit(first, SPEC).upload["direct"]  # the tenant's one job in flight
            check = client._call(client._stub.CheckUpload, pb.CheckUploadRequest(
                model_sha256=sha, model_size=SIZE, direct_upload=True, no_cache=True, spec="targets: [onnx]"))
        assert not check.model_present and not check.HasField("model_upload")
    finally:
        srv.stop(grace=0)
