"""A large model goes on to S3 while it arrives (service/uploads.py mirror, S3Store.stream_upload),
against the session's real API and SeaweedFS; the object appears only if the bytes hash to the
declared sha256."""

from __future__ import annotations

import hashlib
import os

import grpc
import pytest

from fxport.client import Client
from fxport.storage import S3Store, input_key
from fxport.v1 import conversion_pb2 as pb
from fxport.v1 import conversion_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow
SIZE = 20 << 20  # above STREAM_TO_STORE_BYTES: several multipart parts


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
    with Client(distributed_stack.address) as client:
        job = client.submit(model, {"targets": ["fx_source"]})
        client.cancel(job.id)  # not a model: only the upload matters here
    assert job.upload == {"sent_bytes": SIZE, "skipped": None}
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
