"""ArtifactStore: the filesystem backend and the S3 backend (a real SeaweedFS, auth on)."""

from __future__ import annotations

import hashlib
import io
import os
import urllib.request

import pytest

import fxport.storage.s3_store
from fxport.storage import (
    ArtifactStore,
    FileStore,
    InvalidKey,
    ObjectNotFound,
    S3Store,
    StoredObjectCorrupt,
    artifact_key,
    input_key,
    job_prefix,
    open_store,
)

JOB = "01m8kvr8p9r91rpbemf9nds6es"
SHA = hashlib.sha256(b"model bytes").hexdigest()


@pytest.fixture(params=["file", "s3"])
def store(request, tmp_path):
    if request.param == "file":
        return FileStore(tmp_path / "store")
    s3 = request.getfixturevalue("s3_server")
    # A small multipart threshold so the multipart path runs on a test-sized file.
    return S3Store(s3.bucket, f"unit-{os.getpid()}-{id(request)}", endpoint_url=s3.endpoint,
                   multipart_threshold=5 << 20, multipart_chunksize=5 << 20)


def test_put_get_roundtrip_records_sha256(store, tmp_path):
    data = os.urandom(11 << 20)  # above the S3 multipart threshold
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    key = artifact_key("default", JOB, "model.onnx")
    stored = store.put_file(key, src)
    assert stored.sha256 == hashlib.sha256(data).hexdigest() and stored.bytes == len(data)
    assert store.head(key) == stored and store.exists(key)
    got = store.get(key, tmp_path / "dl" / "model.onnx")
    assert got == stored and (tmp_path / "dl" / "model.onnx").read_bytes() == data

    streamed = store.put_stream(artifact_key("default", JOB, "fx_source/module.py"), io.BytesIO(b"print(1)\n"))
    assert streamed.sha256 == hashlib.sha256(b"print(1)\n").hexdigest()
    assert [o.key for o in store.list_prefix(job_prefix("default", JOB))] == [
        artifact_key("default", JOB, "fx_source/module.py"), key]

    assert store.delete_prefix(job_prefix("default", JOB)) == 2
    assert not store.exists(key) and store.list_prefix(job_prefix("default", JOB)) == []
    with pytest.raises(ObjectNotFound):
        store.get(key, tmp_path / "gone")


def test_put_refuses_a_file_that_does_not_match_the_callers_digest(store, tmp_path):
    src = tmp_path / "m"
    src.write_bytes(b"model bytes")
    with pytest.raises(StoredObjectCorrupt):
        store.put_file(input_key("default", SHA), src, sha256="0" * 64)


def test_a_snapshot_holds_the_bytes_its_digest_names_even_while_the_file_changes(store, tmp_path, monkeypatch):
    """put_snapshot (the early upload of a running sandbox's output): on S3 no private copy is
    made, the store checks the digest sent with the bytes; a file that changes between the hash
    and the send is refused and nothing is stored. Either way object and digest agree."""
    def no_copy(*a, **kw):
        raise AssertionError("S3 took the private-copy path: the store did not confirm the checksum")

    if isinstance(store, S3Store):
        monkeypatch.setattr(ArtifactStore, "put_snapshot", no_copy)
    src = tmp_path / "model.onnx"
    src.write_bytes(os.urandom(6 << 20))
    key = artifact_key("default", JOB, "model.onnx")
    stored = store.put_snapshot(key, src, spool_dir=tmp_path)
    assert stored.sha256 == hashlib.sha256(src.read_bytes()).hexdigest() == store.head(key).sha256
    store.delete_object(key)

    real = fxport.storage.s3_store.sha256_file

    def hashed_then_rewritten(path):  # the sandbox writes on right after the digest was taken
        digest = real(path)
        path.write_bytes(os.urandom(6 << 20))
        return digest

    monkeypatch.setattr(fxport.storage.s3_store, "sha256_file", hashed_then_rewritten)
    try:
        stored = store.put_snapshot(key, src, spool_dir=tmp_path)
    except StoredObjectCorrupt:
        assert isinstance(store, S3Store) and store.head(key) is None
    else:
        assert isinstance(store, FileStore)
        assert stored.sha256 == store.head(key).sha256 == hashlib.sha256(src.read_bytes()).hexdigest()


def test_get_detects_corruption(tmp_path):
    store = FileStore(tmp_path / "store")
    src = tmp_path / "m"
    src.write_bytes(b"model bytes")
    key = input_key("default", SHA)
    store.put_file(key, src)
    (tmp_path / "store" / "objects" / key).write_bytes(b"model bytez")  # bit rot
    with pytest.raises(StoredObjectCorrupt, match="corrupt"):
        store.get(key, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_s3_get_detects_an_object_overwritten_behind_our_back(s3_server, tmp_path):
    store = S3Store(s3_server.bucket, "tamper", endpoint_url=s3_server.endpoint)
    src = tmp_path / "m"
    src.write_bytes(b"model bytes")
    key = input_key("default", SHA)
    store.put_file(key, src)
    s3_server.client().put_object(Bucket=s3_server.bucket, Key="tamper/" + key, Body=b"evil bytes!",
                                  Metadata={"sha256": SHA})
    with pytest.raises(StoredObjectCorrupt):
        store.get(key, tmp_path / "out")


def test_presigned_url_s3_serves_the_object_and_file_store_has_none(s3_server, tmp_path):
    src = tmp_path / "m"
    src.write_bytes(b"model bytes")
    s3 = S3Store(s3_server.bucket, "presign", endpoint_url=s3_server.endpoint)
    key = input_key("default", SHA)
    s3.put_file(key, src)
    url = s3.presigned_url(key, 60)
    assert "X-Amz-Signature" in url  # SigV4, not SigV2
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert resp.read() == b"model bytes"
    assert FileStore(tmp_path / "fs").presigned_url(key) is None


def test_s3_with_wrong_credentials_is_refused(s3_server, tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret")
    store = S3Store(s3_server.bucket, "auth", endpoint_url=s3_server.endpoint)
    src = tmp_path / "m"
    src.write_bytes(b"x")
    with pytest.raises(Exception, match="(?i)denied|signature|forbidden|403"):
        store.put_file(input_key("default", SHA), src)


@pytest.mark.parametrize("bad", [
    lambda: input_key("Default", SHA),          # upper case tenant
    lambda: input_key("../x", SHA),
    lambda: input_key("default", "abc"),        # not a sha256
    lambda: artifact_key("default", "../../etc", "model.onnx"),
    lambda: artifact_key("default", JOB, "../model.onnx"),
    lambda: artifact_key("default", JOB, "/abs"),
    lambda: artifact_key("default", JOB, ".hidden"),
    lambda: artifact_key("default", JOB, "a//b"),
    lambda: artifact_key("default", JOB, "a/b/c/d/e"),
])
def test_key_builders_reject_anything_not_an_id(bad):
    with pytest.raises(InvalidKey):
        bad()


def test_key_layout():
    assert input_key("default", SHA) == f"default/inputs/{SHA}"
    assert artifact_key("team-a", JOB, "fx_source/module.py") == f"team-a/jobs/{JOB}/fx_source/module.py"


def test_delete_prefix_refuses_broad_prefixes(tmp_path):
    store = FileStore(tmp_path / "s")
    for prefix in ("", "default", "default/"):
        with pytest.raises(InvalidKey):
            store.delete_prefix(prefix)


def test_open_store_urls(tmp_path):
    fs = open_store(f"file://{tmp_path}/a")
    assert isinstance(fs, FileStore) and fs.root == (tmp_path / "a").resolve()
    s3 = open_store("s3://bucket/some/prefix")
    assert isinstance(s3, S3Store) and s3.bucket == "bucket" and s3.prefix == "some/prefix/"
    with pytest.raises(Exception, match="s3://BUCKET"):
        open_store("ftp://x")


def test_s3_unreachable_past_the_retry_budget_names_endpoint_tries_and_time(tmp_path, monkeypatch):
    import re
    import time

    from fxport.storage import StoreUnreachable
    from tests.fixtures.servers import free_port

    for k, v in {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    dead = f"http://127.0.0.1:{free_port()}"
    # One attempt against a dead endpoint took 0.15-2.7 s here (40 tries; botocore's inner
    # retry sleeps at random), so a 5 s budget always leaves room for a second attempt.
    store = S3Store("bucket", "p", endpoint_url=dead, retry_s=5.0)
    src = tmp_path / "m"
    src.write_bytes(b"x")
    t0 = time.monotonic()
    with pytest.raises(StoreUnreachable) as err:
        store.put_file(input_key("default", SHA), src)
    took = time.monotonic() - t0
    m = re.search(r"unreachable at (\S+) after (\d+) attempts over ([\d.]+) s", str(err.value))
    assert m and m.group(1) == dead and int(m.group(2)) >= 2
    assert float(m.group(3)) <= took + 0.05  # the reported time is the time it took
    assert took < 5.0 + 5  # it gave up: the budget plus at most one more attempt (up to ~3 s here)
    assert err.value.code == "store_unreachable"


def test_no_retry_starts_past_the_budget_whatever_the_jitter(monkeypatch):
    """The budget is checked against the pause actually taken: with the jitter at its largest
    (1.2x), a check against the bare delay (0.2 s, then 0.4 s) would let a third attempt start
    at ~0.72 s, past a 0.65 s budget. Attempts here fail at once, so the time taken is the
    pauses'."""
    import random
    import time

    from botocore.exceptions import EndpointConnectionError

    from fxport.storage import StoreUnreachable

    for k, v in {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    store = S3Store("bucket", "p", endpoint_url="http://127.0.0.1:1", retry_s=0.65)
    monkeypatch.setattr(random, "uniform", lambda lo, hi: hi)
    attempts = []

    def refused() -> None:
        attempts.append(time.monotonic())
        raise EndpointConnectionError(endpoint_url="http://127.0.0.1:1")

    t0 = time.monotonic()
    with pytest.raises(StoreUnreachable, match=r"after 2 attempts"):
        store._retry("upload x", refused)
    assert attempts[-1] - t0 <= 0.65 and len(attempts) == 2


def test_only_connection_failures_and_5xx_are_retried():
    from boto3.exceptions import S3UploadFailedError
    from botocore.exceptions import ClientError, EndpointConnectionError

    from fxport.storage.s3_store import _transient

    def client_error(status: int, code: str) -> ClientError:
        return ClientError({"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")

    assert _transient(EndpointConnectionError(endpoint_url="http://x"))
    assert _transient(client_error(503, "SlowDown")) and _transient(client_error(500, "InternalError"))
    assert not _transient(client_error(403, "AccessDenied")) and not _transient(client_error(404, "NoSuchKey"))
    try:  # boto3's transfer manager wraps the ClientError
        try:
            raise client_error(503, "ServiceUnavailable")
        except ClientError as inner:
            raise S3UploadFailedError("Failed to upload") from inner
    except S3UploadFailedError as wrapped:
        assert _transient(wrapped)
    assert not _transient(ValueError("bad argument"))


def test_a_request_body_that_shrinks_while_sent_fails_at_once(tmp_path) -> None:  # noqa: ANN001
    """S3Store.put_snapshot's body: a file rewritten shorter while it is sent (a sandboxed model
    rewriting its output during an early upload) raised nothing, sent fewer bytes than the
    request's Content-Length, and the store waited 60 s for the rest."""
    from fxport.storage.s3_store import _Exactly

    path = tmp_path / "model.onnx"
    path.write_bytes(b"x" * (256 << 10))
    with path.open("rb") as f:
        body = _Exactly(f, 256 << 10, path)
        assert body.read(64 << 10) == b"x" * (64 << 10)
        path.write_bytes(b"TAMPERED")  # truncated beneath the open file, past what was buffered
        with pytest.raises(StoredObjectCorrupt, match="changed while it was being stored"):
            body.read(192 << 10)
    with path.open("rb") as f:
        body = _Exactly(f, 8, path)
        assert body.read() == b"TAMPERED" and body.read() == b""
        assert body.seek(2) == 2 and body.read(3) == b"MPE" and body.tell() == 5
