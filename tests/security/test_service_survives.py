"""After the barrage (this file runs last in tests/security): the API and the worker are still
up, a normal job succeeds, and every digest the manifest records matches the object stored
for it; a stored object that changes is refused on download, never handed out."""

from __future__ import annotations

import hashlib
import json

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fxport.client import FxportError

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def normal_job(secure_stack, tiny_pt2):
    with secure_stack.client("alice") as alice:
        job = alice.submit(tiny_pt2, {"targets": ["onnx", "torchscript"]})
        job.wait(timeout=240)
        assert job.state == "SUCCEEDED", (job.error, secure_stack.logs())
        yield alice, job


def test_service_is_still_serving(secure_stack, normal_job):
    with grpc.insecure_channel(secure_stack.address) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        assert health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status == \
            health_pb2.HealthCheckResponse.SERVING
    assert secure_stack.api.process.alive()
    assert secure_stack.stack.workers["cpu"].alive()


def test_manifest_digests_match_the_stored_objects(secure_stack, normal_job, tmp_path):
    _, job = normal_job
    paths = {p.relative_to(tmp_path).as_posix(): p for p in job.download(tmp_path)}
    manifest = json.loads(paths["manifest.json"].read_text())
    records = {a["name"]: a for a in job.artifacts}
    store = secure_stack.stack.artifact_store()
    assert manifest["artifacts"], manifest
    for art in manifest["artifacts"]:
        data = paths[art["path"]].read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        rec = records[art["path"]]
        stored = store.head(rec["key"])
        assert digest == art["sha256"] == rec["sha256"] == stored.sha256
        assert len(data) == art["bytes"] == rec["bytes"] == stored.bytes
    box = manifest["sandbox"]
    assert box["no_new_processes"] and box["filesystem_writes_confined"] and box["capabilities_dropped"]


def test_a_changed_stored_artifact_is_refused(secure_stack, normal_job, tmp_path):
    alice, job = normal_job
    rec = next(a for a in job.artifacts if a["name"] == "model.ts")
    stack = secure_stack.stack
    bucket, _, prefix = stack.env["FXPORT_STORE"][len("s3://"):].partition("/")
    s3 = stack.s3.client()
    key = f"{prefix}/{rec['key']}" if prefix else rec["key"]
    original = s3.get_object(Bucket=bucket, Key=key)
    body, metadata = original["Body"].read(), original.get("Metadata", {})
    s3.put_object(Bucket=bucket, Key=key, Body=body[:-1] + bytes([body[-1] ^ 1]), Metadata=metadata)
    try:
        # Straight from the store (presigned URL): the client's own check refuses the bytes.
        with pytest.raises(FxportError) as info:
            job.download(tmp_path / "out", names=["model.ts"])
        assert "model.ts: downloaded" in str(info.value) and rec["sha256"] in str(info.value)
        # Relayed by the API: the server's check refuses them before the client sees a byte.
        with secure_stack.client("alice", direct_download=False) as relayed:
            with pytest.raises(FxportError) as info:
                relayed.get(job.id).download(tmp_path / "out", names=["model.ts"])
        assert "does not match its sha256" in str(info.value)
        assert not (tmp_path / "out" / "model.ts").exists()
        assert not list((tmp_path / "out").glob("*.part"))
    finally:
        s3.put_object(Bucket=bucket, Key=key, Body=body, Metadata=metadata)
