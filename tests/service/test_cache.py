"""The result cache through the service: real Redis, SeaweedFS S3, Celery workers, gRPC API.

A dedicated API (cache lookups on, two tenants with tokens, Prometheus metrics on a port)
shares the session's broker, bucket and workers (tests/conftest.py `distributed_stack`,
whose own API keeps lookups off so other suites are never answered from the cache). The
uploaded-bytes assertions read the API's `fxport_upload_bytes_total` counter.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from fxport.client import Client
from fxport.service.auth import new_token, token_entry
from fxport.v1 import conversion_pb2 as pb
from tests.fixtures.servers import ApiServer, DistributedStack, free_port, start_api

pytestmark = pytest.mark.slow

TENANTS = ("cache-a", "cache-b")
SPEC = {"targets": ["torchscript"], "verify": {"samples": 2}, "labels": {"suite": "cache"}}
# The same spec: other key order, defaults spelled out, another label (labels don't shape artifacts).
SPEC_REORDERED = {"labels": {"suite": "cache", "run": "2"}, "verify": {"samples": 2, "atol": 1e-4},
                  "precision": "fp32", "capture": "auto", "targets": ["torchscript"]}


@dataclass
class CacheApi:
    api: ApiServer
    stack: DistributedStack
    tokens: dict[str, str]
    metrics_port: int

    def client(self, tenant: str = TENANTS[0]) -> Client:
        return Client(self.api.address, token=self.tokens[tenant])

    def metric(self, sample: str) -> float:
        """One sample of the API's /metrics, e.g. 'fxport_upload_bytes_total{kind="model"}'."""
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).read().decode()
        for line in text.splitlines():
            if line.startswith(sample + " "):
                return float(line.split()[-1])
        raise AssertionError(f"{sample} not exported")

    def uploaded_model_bytes(self) -> float:
        """The API's count of model bytes that arrived (all tenants)."""
        return self.metric('fxport_upload_bytes_total{kind="model"}')

    def logs(self) -> str:
        from tests.fixtures.servers import tail

        return f"== cache-api ==\n{tail(self.api.process.log)}\n{self.stack.logs()}"


@pytest.fixture(scope="module")
def cache_api(tmp_path_factory, distributed_stack) -> CacheApi:
    base = tmp_path_factory.mktemp("cache-api")
    tokens = {t: new_token() for t in TENANTS}
    tokens_file = base / "tokens"
    tokens_file.write_text("".join(token_entry(t, tok) + "\n" for t, tok in tokens.items()))
    port = free_port()
    env = {**distributed_stack.env, "FXPORT_TOKENS_FILE": str(tokens_file), "FXPORT_HOME": str(base / "home"),
           "FXPORT_CACHE_ENABLED": "true", "FXPORT_METRICS_PORT": str(port)}
    api = start_api(base, env, name="cache-api")
    yield CacheApi(api, distributed_stack, tokens, port)
    api.stop()


@pytest.fixture(scope="module")
def variant_pt2(tmp_path_factory):
    """tiny_linear with other weights: different model bytes, same architecture."""
    import torch

    from tests.models import CORPUS

    case = CORPUS["tiny_linear"]
    torch.manual_seed(1234)
    model = case.build()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    example = case.example_inputs(2)
    dim = torch.export.Dim("batch", min=1, max=64)
    ep = torch.export.export(model, example, dynamic_shapes=tuple({0: dim} for _ in example))
    path = tmp_path_factory.mktemp("variant") / "tiny_variant.pt2"
    torch.export.save(ep, path)
    return path


def _converted(client: Client, model: Path, spec: dict, **kw):
    job = client.submit(model, spec, **kw)
    job.wait(timeout=180)
    assert job.state == "SUCCEEDED", job.error
    return job


def _would_hit(client: Client, model: Path, spec: dict) -> bool:
    """The pre-upload check's answer (CheckUpload), without submitting anything."""
    sha = hashlib.sha256(model.read_bytes()).hexdigest()
    return client._call(client._stub.CheckUpload,
                        pb.CheckUploadRequest(model_sha256=sha, spec=json.dumps(spec))).cache_hit


@pytest.fixture(scope="module")
def first_job(cache_api, tiny_pt2):
    """Tenant cache-a converts tiny_linear once; the rest of the module hits or misses it."""
    with cache_api.client() as c:
        job = _converted(c, tiny_pt2, SPEC)
    assert not job.message.cache_hit
    return job


def test_identical_spec_in_another_key_order_is_a_hit_without_upload(cache_api, first_job, tiny_pt2, tmp_path):
    uploaded = cache_api.uploaded_model_bytes()
    with cache_api.client() as c:
        t0 = time.perf_counter()
        job = c.submit(tiny_pt2, SPEC_REORDERED)
        took = time.perf_counter() - t0
        # A new job in the caller's tenant, SUCCEEDED at once, pointing at the earlier artifacts.
        assert job.state == "SUCCEEDED" and job.message.cache_hit, (job.to_dict(), cache_api.logs())
        assert job.id != first_job.id and job.message.tenant == TENANTS[0]
        assert job.upload == {"sent_bytes": 0, "skipped": "cache_hit", "direct": False}
        assert [(a["name"], a["key"], a["sha256"]) for a in job.artifacts] == \
               [(a["name"], a["key"], a["sha256"]) for a in first_job.artifacts]
        assert job.spec["labels"] == {"suite": "cache", "run": "2"}  # the new job's own spec
        # Watching it ends at once; its artifacts download with every sha256 checked.
        assert [e.state for e in c.get(job.id).events(timeout=10)] == ["SUCCEEDED"]
        paths = job.download(tmp_path / "out")
        assert {p.name for p in paths} >= {"model.ts", "manifest.json"}
        assert json.loads((tmp_path / "out" / "manifest.json").read_text())["job_id"] == first_job.id
    assert cache_api.uploaded_model_bytes() == uploaded  # counted at the server: nothing arrived
    assert took < 5, took


def _calls(api: CacheApi, method: str) -> float:
    """How many `method` RPCs the API has started (grpc_server_started_total)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{api.metrics_port}/metrics", timeout=10).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("grpc_server_started_total{") and f'grpc_method="{method}"' in line)


def test_a_hit_is_one_round_trip_and_honours_its_idempotency_key(cache_api, first_job, tiny_pt2):
    """CheckUpload with the SubmitJob header answers a cached result with the job itself, as
    SubmitJob would: no SubmitJob follows, and the same key gives the same job again."""
    submits, checks = _calls(cache_api, "SubmitJob"), _calls(cache_api, "CheckUpload")
    with cache_api.client() as c:
        job = c.submit(tiny_pt2, SPEC, idempotency_key="one-trip")
        assert job.message.cache_hit and job.state == "SUCCEEDED", job.to_dict()
        assert job.upload == {"sent_bytes": 0, "skipped": "cache_hit", "direct": False}
        assert [a["sha256"] for a in job.artifacts] == [a["sha256"] for a in first_job.artifacts]
        assert _calls(cache_api, "SubmitJob") == submits and _calls(cache_api, "CheckUpload") == checks + 1
        again = c.submit(tiny_pt2, SPEC, idempotency_key="one-trip")
        assert again.id == job.id
        # the key names that job: another spec under it is refused, as SubmitJob refuses it
        with pytest.raises(Exception, match="idempotency"):
            c.submit(tiny_pt2, {**SPEC, "verify": {"samples": 3}}, idempotency_key="one-trip")
        # no_cache: no job from the check; the model is stored, so SubmitJob queues a conversion
        fresh = c.submit(tiny_pt2, SPEC, no_cache=True)
        assert not fresh.message.cache_hit and fresh.upload["skipped"] == "model_stored"
        fresh.cancel()


def test_another_tenant_cannot_take_a_hit_or_a_job_through_the_one_round_trip(cache_api, first_job, tiny_pt2):
    """An attacker in tenant cache-b who knows cache-a's model digest, spec and idempotency key,
    calling CheckUpload by hand with the submit header: no job of cache-a's, no hit on its result."""
    with cache_api.client(TENANTS[0]) as alice:
        owned = alice.submit(tiny_pt2, SPEC, idempotency_key="alices-key")
        assert owned.message.cache_hit and owned.message.tenant == TENANTS[0]
    sha = hashlib.sha256(tiny_pt2.read_bytes()).hexdigest()
    header = pb.SubmitHeader(spec=json.dumps(SPEC), idempotency_key="alices-key",
                             model=pb.FileHeader(filename="m.pt2", size=tiny_pt2.stat().st_size, sha256=sha,
                                                 stored=True))
    with cache_api.client(TENANTS[1]) as mallory:
        answer = mallory._call(mallory._stub.CheckUpload, pb.CheckUploadRequest(
            model_sha256=sha, spec=json.dumps(SPEC), submit_if_cached=header))
        assert not answer.HasField("job") and not answer.cache_hit
        assert not answer.model_present  # cache-a's stored model is not cache-b's either
        with pytest.raises(Exception, match=f"no job {owned.id}"):
            mallory.get(owned.id)


def test_a_changed_spec_field_or_model_misses(cache_api, first_job, tiny_pt2, variant_pt2):
    with cache_api.client() as c:
        assert _would_hit(c, tiny_pt2, SPEC_REORDERED)
        for change in ({"verify": {"samples": 2, "atol": 1e-3}}, {"targets": ["torchscript", "fx_source"]},
                       {"passes": ["remove_dropout"]}, {"torchscript": {"method": "script"}}):
            assert not _would_hit(c, tiny_pt2, {**SPEC, **change}), change
        assert not _would_hit(c, variant_pt2, SPEC)
        # Through SubmitJob too: a miss is queued for conversion, not answered.
        job = c.submit(tiny_pt2, {**SPEC, "verify": {"samples": 3}})
        assert not job.message.cache_hit and job.state in ("QUEUED", "RUNNING")
        assert job.upload["skipped"] == "model_stored"  # the bytes were already there
        job.cancel()


def test_a_changed_toolchain_misses(cache_api, first_job, tiny_pt2):
    import redis

    from fxport.toolchain import PUBLISH_KEY, READ_CACHE_S

    r = redis.Redis.from_url(cache_api.stack.redis.url)
    key = PUBLISH_KEY.format(queue="cpu")
    published = r.get(key)
    assert published, "the cpu workers did not publish their toolchain"
    doc = json.loads(published)
    doc["toolchain"]["torch"] = "9.9.9"  # the workers were upgraded
    try:
        r.set(key, json.dumps(doc))
        time.sleep(READ_CACHE_S + 0.2)
        with cache_api.client() as c:
            assert not _would_hit(c, tiny_pt2, SPEC)
            job = c.submit(tiny_pt2, SPEC)
            assert not job.message.cache_hit
            job.cancel()
    finally:
        r.set(key, published)
        time.sleep(READ_CACHE_S + 0.2)
    with cache_api.client() as c:
        assert _would_hit(c, tiny_pt2, SPEC)


def test_no_hit_across_tenants(cache_api, first_job, tiny_pt2):
    uploaded = cache_api.uploaded_model_bytes()
    with cache_api.client(TENANTS[1]) as c:
        assert not _would_hit(c, tiny_pt2, SPEC)
        job = c.submit(tiny_pt2, SPEC)
        assert not job.message.cache_hit and job.message.tenant == TENANTS[1]
        # cache-a's stored model is not cache-b's either: the bytes travel.
        assert job.upload == {"sent_bytes": tiny_pt2.stat().st_size, "skipped": None, "direct": False}
        job.cancel()
    assert cache_api.uploaded_model_bytes() == uploaded + tiny_pt2.stat().st_size
    with cache_api.client(TENANTS[0]) as c:  # and cache-a still hits its own
        assert _would_hit(c, tiny_pt2, SPEC)


def test_upload_skipped_for_a_known_digest(cache_api, first_job, tiny_pt2, variant_pt2):
    with cache_api.client() as c:
        before = cache_api.uploaded_model_bytes()
        job = c.submit(variant_pt2, SPEC, no_cache=True)  # a model this tenant never sent
        assert job.upload == {"sent_bytes": variant_pt2.stat().st_size, "skipped": None, "direct": False}
        job.cancel()
        after = cache_api.uploaded_model_bytes()
        assert after == before + variant_pt2.stat().st_size
        again = c.submit(variant_pt2, {"targets": ["fx_source"]}, no_cache=True)  # same bytes, other job
        assert again.upload == {"sent_bytes": 0, "skipped": "model_stored", "direct": False}
        again.cancel()
        assert cache_api.uploaded_model_bytes() == after


def test_a_new_model_reads_the_cache_entry_once_not_in_both_calls(cache_api, first_job, variant_pt2):
    """CheckUpload's miss stands for the SubmitJob that follows it: one store read per new job."""
    with cache_api.client() as c:
        reads = cache_api.metric("fxport_cache_entry_reads_total")
        job = c.submit(variant_pt2, {**SPEC, "verify": {"samples": 3}})  # CheckUpload, then SubmitJob
        assert not job.message.cache_hit
        assert cache_api.metric("fxport_cache_entry_reads_total") == reads + 1
        job.wait(timeout=180)
        assert job.state == "SUCCEEDED", job.error
        # The miss was taken once: the same submit again reads the entry and hits it.
        again = c.submit(variant_pt2, {**SPEC, "verify": {"samples": 3}})
        assert again.message.cache_hit
        assert cache_api.metric("fxport_cache_entry_reads_total") == reads + 2  # CheckUpload answers the hit itself


def test_no_cache_forces_a_run_whose_result_replaces_the_entry(cache_api, first_job, tiny_pt2):
    with cache_api.client() as c:
        forced = _converted(c, tiny_pt2, SPEC, no_cache=True)
        assert not forced.message.cache_hit and forced.message.attempts == 1 and forced.message.worker
        hit = c.submit(tiny_pt2, SPEC)
        assert hit.message.cache_hit
        assert {a["key"] for a in hit.artifacts} == {a["key"] for a in forced.artifacts}  # the fresh result


def test_a_corrupted_cached_artifact_is_detected_and_recomputed(cache_api, first_job, tiny_pt2):
    from fxport.storage import input_key

    store = cache_api.stack.artifact_store()
    s3 = cache_api.stack.s3.client()
    with cache_api.client() as c:
        cached = c.submit(tiny_pt2, SPEC)
        assert cached.message.cache_hit
        art = next(a for a in cached.artifacts if a["name"] == "model.ts")
        # Overwrite the object behind the store's back: same length, same recorded sha256
        # metadata, different bytes. Only re-hashing the bytes can tell.
        data = bytearray(b"".join(store.iter_chunks(art["key"])))
        data[len(data) // 2] ^= 0xFF
        s3.put_object(Bucket=cache_api.stack.s3.bucket, Key=store.prefix + art["key"], Body=bytes(data),
                      Metadata={"sha256": art["sha256"]})
        # And forget the model, so the client relies on the cache hint alone: when the proof
        # fails, the server must ask for the bytes and the client must send them.
        store.delete_object(input_key(TENANTS[0], hashlib.sha256(tiny_pt2.read_bytes()).hexdigest()))
        before = cache_api.uploaded_model_bytes()
        assert _would_hit(c, tiny_pt2, SPEC)  # sizes and recorded digests still agree
        job = c.submit(tiny_pt2, SPEC)
        assert not job.message.cache_hit, cache_api.logs()
        assert job.upload["sent_bytes"] == tiny_pt2.stat().st_size
        assert cache_api.uploaded_model_bytes() == before + tiny_pt2.stat().st_size
        job.wait(timeout=180)
        assert job.state == "SUCCEEDED", job.error
        fresh = c.submit(tiny_pt2, SPEC)  # the recomputed result is cached in its place
        assert fresh.message.cache_hit
        assert {a["key"] for a in fresh.artifacts} == {a["key"] for a in job.artifacts}
    assert "failed its proof check" in cache_api.api.process.log.read_text()


def test_cli_reports_cache_hit_and_skipped_upload(cache_api, first_job, tiny_pt2, tmp_path):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(SPEC_REORDERED))
    base = [sys.executable, "-m", "fxport.cli", "submit", str(tiny_pt2), "--spec", str(spec),
            "--server", cache_api.api.address, "--token", cache_api.tokens[TENANTS[0]], "--json"]
    hit = subprocess.run([*base, "--wait"], capture_output=True, text=True, timeout=120)
    assert hit.returncode == 0, hit.stderr
    assert "cache hit" in hit.stderr
    doc = json.loads(hit.stdout)
    assert doc["cache_hit"] and doc["state"] == "SUCCEEDED" and doc["upload"]["skipped"] == "cache_hit"
    forced = subprocess.run([*base, "--no-cache"], capture_output=True, text=True, timeout=120)
    assert forced.returncode == 0, forced.stderr
    assert "model already stored, upload skipped" in forced.stderr
    doc = json.loads(forced.stdout)
    assert not doc["cache_hit"] and doc["state"] in ("QUEUED", "RUNNING")
    with cache_api.client() as c:
        c.cancel(doc["job_id"])


def test_cross_tenant_sharing_when_the_operator_enables_it(tmp_path, tiny_pt2):
    """Embedded server (in-process workers, filesystem store) with sharing on: a second tenant is
    answered from the first one's result once it has shown it holds the model: by sending the
    bytes (hashed in that call), or by its own stored copy. Its digest alone is no proof: a
    tenant that sends only another tenant's model sha256, size and spec (no bytes) gets no job,
    and the pre-upload check tells it nothing about the other tenant's result."""
    import grpc

    tokens = {t: new_token() for t in TENANTS}
    (tmp_path / "tokens").write_text("".join(token_entry(t, tok) + "\n" for t, tok in tokens.items()))
    api = start_api(tmp_path, {"FXPORT_HOME": str(tmp_path / "home"), "FXPORT_TOKENS_FILE": str(tmp_path / "tokens"),
                               "FXPORT_SANDBOX_THREADS": "1", "FXPORT_CACHE_ENABLED": "true",
                               "FXPORT_CACHE_SHARE_ACROSS_TENANTS": "true"}, name="shared-cache")
    spec = {"targets": ["fx_source"]}
    data = tiny_pt2.read_bytes()
    try:
        with Client(api.address, token=tokens[TENANTS[0]]) as a:
            first = _converted(a, tiny_pt2, spec)
        with Client(api.address, token=tokens[TENANTS[1]]) as b:
            # 1. The attack: another tenant's digest, size and spec, and not a byte of the model.
            assert not _would_hit(b, tiny_pt2, spec)  # the pre-upload check does not answer from a's result
            header = pb.SubmitHeader(spec=json.dumps(spec), model=pb.FileHeader(
                filename="stolen.pt2", size=len(data), sha256=hashlib.sha256(data).hexdigest()))
            with pytest.raises(grpc.RpcError) as refused:
                b._stub.SubmitJob(iter([pb.SubmitJobRequest(header=header)]), metadata=b._metadata, timeout=30)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
            assert b.list().jobs == [], "a hash-only submit made a job"
            # 2. With the bytes sent (and hashed in that call), the shared result answers it.
            hit = b.submit(tiny_pt2, spec)
            assert hit.message.cache_hit and hit.message.tenant == TENANTS[1]
            assert hit.upload == {"sent_bytes": len(data), "skipped": "cache_hit", "direct": False}, hit.upload
            assert {a["key"] for a in hit.artifacts} == {a["key"] for a in first.artifacts}
            assert "of job" not in hit.message.message  # another tenant's job id is not named
            hit.download(tmp_path / "out")  # the other tenant's objects, readable through this job
    finally:
        api.stop()


def test_a_hit_keeps_the_artifacts_it_shares_once_retention_removes_the_job_that_made_them(
        cache_api, tiny_pt2, tmp_path):
    """Retention (fxport/retention.py) removes the job whose artifacts a cache entry points at:
    the cache hit already answered keeps them, and the next identical submit converts anew
    instead of being answered with a removed job's artifacts."""
    from fxport.retention import RetentionPolicy, sweep_finished

    spec = {**SPEC, "verify": {"samples": 5}}  # a cache key of this test's own
    jobs, store = cache_api.stack.job_store(), cache_api.stack.artifact_store()
    drain = RetentionPolicy(retention_s=0, keep_per_tenant=0)  # removes nothing; deletes what is queued
    try:
        with cache_api.client() as c:
            source = _converted(c, tiny_pt2, spec)
            hit = c.submit(tiny_pt2, spec)
            assert hit.message.cache_hit and [a["key"] for a in hit.artifacts] == [a["key"] for a in source.artifacts]

            assert jobs.remove(source.id) is True  # what the sweep does once the source is due
            assert sweep_finished(jobs, store, drain).deleted_prefixes == []  # the hit shares them
            assert all(store.head(a["key"]) is not None for a in source.artifacts)
            paths = c.get(hit.id).download(tmp_path / "hit")
            assert {p.name for p in paths} >= {"model.ts", "manifest.json"}

            again = c.submit(tiny_pt2, spec)
            assert not again.message.cache_hit, again.to_dict()
            again.wait(timeout=180)
            assert again.state == "SUCCEEDED", again.error

            assert jobs.remove(hit.id) is True  # the last job sharing them: they go with it
            deleted = sweep_finished(jobs, store, drain).deleted_prefixes
            assert f"{TENANTS[0]}/jobs/{source.id}/" in deleted, deleted
            assert [store.head(a["key"]) for a in source.artifacts] == [None] * len(source.artifacts)
    finally:
        jobs.close()
