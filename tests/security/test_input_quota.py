"""The object store, tried as an attacker would through the real API: a tenant storing bytes.

Before the input ledger, a tenant could fill the store without limit: CheckUpload handed out a
presigned PUT for any digest and size, with no submit to follow, and no input was ever deleted.
Now (fxport/retention.py):
- a tenant's stored inputs count against FXPORT_MAX_INPUT_BYTES_PER_TENANT, and a submit or an
  upload offer past it is refused before any byte moves, naming the setting; other tenants are
  unaffected;
- a presigned PUT is handed out only with the spec of the submit that follows, validated;
- what such a URL stored for a submit that never came is deleted once the URL has expired (plus
  PENDING_INPUT_S), and an input no QUEUED or RUNNING job names is deleted
  FXPORT_INPUT_RETENTION_S after its last submit; its bytes then no longer count.

The API is the real server on a loopback port, with the session's Redis (a database of its own,
emptied first) and SeaweedFS S3 (a prefix of its own); no worker listens on its queue, so jobs
stay QUEUED until cancelled. It runs no sweep of its own: the test sweeps with a clock it sets,
so "a week later" takes no waiting."""

from __future__ import annotations

import hashlib
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

import fxport.client.presigned
from fxport.client import Client
from fxport.client.errors import InvalidInput, TooLarge
from fxport.config import Settings
from fxport.jobs import RedisJobStore
from fxport.retention import RetentionPolicy, sweep_finished
from fxport.service.auth import new_token, token_entry
from fxport.service.server import create_server
from fxport.service.servicer import DEFAULT_URL_EXPIRY_S, PENDING_INPUT_S
from fxport.storage import S3Store, input_key
from fxport.v1 import conversion_pb2 as pb

REDIS_DB = 14  # no other test uses it; emptied first
MiB = 1 << 20
QUOTA = 5 * MiB
SIZE = 3 * MiB  # two of them pass the quota; above FXPORT_DIRECT_UPLOAD_MIN_BYTES (set to 1 MiB here)
SPEC = {"targets": ["onnx"]}
RETENTION_S = 7 * 86400.0


@dataclass
class QuotaServer:
    address: str
    tokens: dict[str, str]
    jobs: RedisJobStore
    store: S3Store
    tmp: Path

    def client(self, tenant: str, *, direct: bool = True) -> Client:
        return Client(self.address, token=self.tokens[tenant], direct_upload=direct)

    def model(self, name: str) -> tuple[Path, str]:
        path = self.tmp / name
        path.write_bytes(os.urandom(SIZE))
        return path, hashlib.sha256(path.read_bytes()).hexdigest()

    def stored(self, tenant: str, sha: str) -> bool:
        return self.store.head(input_key(tenant, sha)) is not None

    def sweep(self, later_s: float) -> list[str]:
        """A full retention round `later_s` seconds from now on the store's clock: the inputs it deleted."""
        return sweep_finished(self.jobs, self.store, RetentionPolicy(0, 0), now=self.jobs.clock() + later_s
                              ).deleted_inputs


@pytest.fixture()
def server(redis_server, s3_server, tmp_path, monkeypatch) -> Iterator[QuotaServer]:
    for key, value in s3_server.env().items():  # the API's S3Store and the test's: the session's SeaweedFS
        monkeypatch.setenv(key, value)
    tokens = {t: new_token() for t in ("alice", "bob")}
    (tmp_path / "tokens").write_text("".join(token_entry(t, tok) + "\n" for t, tok in tokens.items()))
    url = redis_server.url.rsplit("/", 1)[0] + f"/{REDIS_DB}"
    jobs = RedisJobStore(url)
    jobs.r.flushdb()
    prefix = f"input-quota-{uuid.uuid4().hex[:8]}"
    settings = Settings(home=tmp_path / "home", listen="127.0.0.1:0", broker_url=url,
                        store=f"s3://{s3_server.bucket}/{prefix}", tokens_file=tmp_path / "tokens",
                        max_upload_bytes=4 * MiB, max_input_bytes_per_tenant=QUOTA, input_retention_s=RETENTION_S,
                        direct_upload_min_bytes=MiB, retention_sweep_interval_s=0, log_format="text")
    srv, port = create_server(settings)
    srv.start()
    try:
        yield QuotaServer(f"127.0.0.1:{port}", tokens, jobs, S3Store(s3_server.bucket, prefix,
                                                                       endpoint_url=s3_server.endpoint), tmp_path)
    finally:
        srv.stop(grace=0)
        jobs.close()


def _through_api() -> float:
    return REGISTRY.get_sample_value("fxport_upload_bytes_total", {"kind": "model"}) or 0.0


def test_a_tenant_cannot_store_more_input_bytes_than_its_quota(server):
    first, first_sha = server.model("first.bin")
    second, second_sha = server.model("second.bin")
    with server.client("alice") as alice, server.client("alice", direct=False) as alice_via_api, \
            server.client("bob") as bob:
        job = alice.submit(first, SPEC)
        alice.cancel(job.id)
        assert job.upload["direct"]  # through a presigned PUT: counted when the URL was handed out
        assert server.jobs.input_bytes("alice") == SIZE

        through = _through_api()
        for client in (alice, alice_via_api):  # an upload offer, and a stream through the API
            with pytest.raises(TooLarge) as refused:
                client.submit(second, SPEC)
            assert "FXPORT_MAX_INPUT_BYTES_PER_TENANT" in str(refused.value)
            assert f"tenant alice has {SIZE} bytes of stored inputs" in str(refused.value)
        assert _through_api() == through  # refused before any byte moved
        assert not server.stored("alice", second_sha) and server.jobs.input_bytes("alice") == SIZE

        again = alice.submit(first, SPEC)  # bytes already counted take no more of the quota
        alice.cancel(again.id)
        assert again.upload["skipped"] == "model_stored"
        theirs = bob.submit(second, SPEC)  # one tenant's quota is not another's
        bob.cancel(theirs.id)
    assert server.stored("bob", second_sha) and server.jobs.input_bytes("bob") == SIZE
    assert server.jobs.input_bytes("alice") == SIZE


def test_an_upload_url_comes_only_with_a_submit_and_goes_when_none_follows(server):
    model, sha = server.model("orphan.bin")
    ask = pb.CheckUploadRequest(model_sha256=sha, model_size=SIZE, direct_upload=True, no_cache=True)
    with server.client("alice") as alice:
        bare = alice._call(alice._stub.CheckUpload, ask)
        assert not bare.HasField("model_upload")  # no spec, no submit to follow: no URL
        ask.spec = "targets: [onnxx]"
        with pytest.raises(InvalidInput, match="onnxx"):
            alice._call(alice._stub.CheckUpload, ask)
        ask.spec = "targets: [onnx]"
        offer = alice._call(alice._stub.CheckUpload, ask).model_upload
    assert offer.url
    assert server.jobs.input_bytes("alice") == SIZE  # counted from the moment the URL exists
    fxport.client.presigned.put_file(offer.url, offer.headers, model)  # ... and no submit follows
    assert server.stored("alice", sha)

    assert server.sweep(DEFAULT_URL_EXPIRY_S) == []  # its URL may still be in use
    assert server.stored("alice", sha)
    assert server.sweep(DEFAULT_URL_EXPIRY_S + PENDING_INPUT_S + 1) == [input_key("alice", sha)]
    assert not server.stored("alice", sha) and server.jobs.input_bytes("alice") == 0


def test_an_input_stays_while_a_job_in_flight_names_it_and_goes_after_the_retention_time(server):
    queued_model, queued_sha = server.model("queued.bin")
    with server.client("alice", direct=False) as alice:
        queued = alice.submit(queued_model, SPEC)
        assert server.sweep(RETENTION_S + 60) == []  # a week on, its job is still QUEUED: kept
        assert server.stored("alice", queued_sha)

        alice.cancel(queued.id)
        assert server.sweep(RETENTION_S - 60) == []  # finished, but its retention time has not passed
        assert server.sweep(RETENTION_S + 60) == [input_key("alice", queued_sha)]
        assert not server.stored("alice", queued_sha) and server.jobs.input_bytes("alice") == 0

        # Submitting it again sends the bytes again, and the job names a stored input.
        again = alice.submit(queued_model, SPEC)
        alice.cancel(again.id)
    assert again.upload["sent_bytes"] == SIZE and server.stored("alice", queued_sha)


def test_a_quota_too_small_for_the_largest_upload_is_refused_at_start(tmp_path):
    with pytest.raises(ValueError, match="FXPORT_MAX_INPUT_BYTES_PER_TENANT"):
        Settings(home=tmp_path, max_upload_bytes=4 * MiB, max_input_bytes_per_tenant=MiB)
    assert Settings(home=tmp_path, max_upload_bytes=4 * MiB, max_input_bytes_per_tenant=0)  # 0: no quota
