"""The result cache's keys, proof check and eviction (fxport/cache.py), on a filesystem store.

The service-level behaviour (hits through the API, tenants, upload skipping, --no-cache) is
tests/service/test_cache.py, against real Redis, S3 and workers.
"""

from __future__ import annotations

import hashlib
import os
import time

import pytest

from fxport.cache import CacheEntry, ResultCache, spec_digest
from fxport.jobs import InputRef, StoredArtifact
from fxport.spec import parse_spec
from fxport.storage import FileStore, artifact_key
from fxport.toolchain import job_fingerprint, local_toolchain

TOOLCHAIN = {"fxport": "0.1.0", "torch": "2.13.0+cpu", "onnx": "1.23.2", "onnxruntime": "1.32.0"}
MODEL = "a" * 64
JOB = "01jz0000000000000000000000"


def key(spec: dict, *, tenant: str = "t1", model: str = MODEL, calibration: str | None = None,
        toolchain: dict = TOOLCHAIN, share: bool = False) -> str:
    return ResultCache(None, share_across_tenants=share).key_for(  # type: ignore[arg-type]
        tenant, model, calibration, parse_spec(spec), toolchain)


def test_spec_digest_ignores_key_order_defaults_labels_and_limits():
    a = parse_spec({"targets": ["onnx"], "verify": {"atol": 1e-4, "samples": 4}, "precision": "fp32"})
    b = parse_spec({"verify": {"samples": 4}, "targets": ["onnx"], "labels": {"git_sha": "abc"},
                    "limits": {"timeout_s": 60}, "capture": "auto"})
    assert spec_digest(a) == spec_digest(b)
    assert spec_digest(a) != spec_digest(parse_spec({"targets": ["onnx"], "verify": {"atol": 1e-3}}))


@pytest.mark.parametrize("change", [
    {"targets": ["onnx", "torchscript"]},
    {"precision": "fp16"},
    {"passes": ["remove_dropout"]},
    {"onnx": {"opset": 18}},
    {"verify": {"samples": 2}},
    {"verify": {"fail_on_mismatch": False}},
    {"capture": "export"},
])
def test_every_artifact_shaping_spec_field_changes_the_key(change):
    assert key({"targets": ["onnx"], **change}) != key({"targets": ["onnx"]})


def test_model_calibration_toolchain_and_tenant_change_the_key():
    base = key({"targets": ["onnx"]})
    assert key({"targets": ["onnx"]}, model="b" * 64) != base
    assert key({"targets": ["onnx"]}, calibration="c" * 64) != base
    for name, value in (("torch", "2.14.0+cpu"), ("onnx", "1.24.0"), ("onnxruntime", "1.33.0"), ("fxport", "0.2.0")):
        assert key({"targets": ["onnx"]}, toolchain={**TOOLCHAIN, name: value}) != base
    assert key({"targets": ["onnx"]}, tenant="t2") != base
    # Shared scope: one key for every tenant.
    assert key({"targets": ["onnx"]}, tenant="t1", share=True) == key({"targets": ["onnx"]}, tenant="t2", share=True)
    assert key({"targets": ["onnx"]}, share=True) != base


def test_engine_fingerprint_needs_tensorrt_and_the_gpu_model():
    gpu = {**TOOLCHAIN, "tensorrt": "10.14.1", "gpu": "NVIDIA H100 80GB HBM3"}
    fp = job_fingerprint(TOOLCHAIN, gpu, engine=True)
    assert fp == {**TOOLCHAIN, "tensorrt": "10.14.1", "gpu": "NVIDIA H100 80GB HBM3"}
    assert job_fingerprint(TOOLCHAIN, {**gpu, "gpu": "NVIDIA L4"}, engine=True) != fp
    assert job_fingerprint(TOOLCHAIN, {**gpu, "gpu": None}, engine=True) is None  # unknown: never cached
    assert job_fingerprint(TOOLCHAIN, None, engine=True) is None
    assert job_fingerprint(None, None, engine=False) is None
    assert job_fingerprint(TOOLCHAIN, gpu, engine=False) == TOOLCHAIN
    # Read from package metadata, without importing torch.
    assert local_toolchain()["torch"] and set(local_toolchain()) == {"fxport", "torch", "onnx", "onnxruntime"}


def _cached_result(store: FileStore, tmp_path, cache: ResultCache, *, tenant: str = "t1", job: str = JOB,
                   model: str = MODEL, size: int = 3 << 20) -> tuple[str, list[StoredArtifact]]:
    arts = []
    for name in ("model.onnx", "manifest.json"):
        src = tmp_path / f"{job}-{name}"
        src.write_bytes(os.urandom(size if name == "model.onnx" else 100))
        k = artifact_key(tenant, job, name)
        stored = store.put_file(k, src)
        arts.append(StoredArtifact(name=name, format="onnx", key=k, bytes=stored.bytes, sha256=stored.sha256))
    spec = parse_spec({"targets": ["onnx"]})
    k = cache.key_for(tenant, model, None, spec, TOOLCHAIN)
    cache.remember(k, tenant=tenant, job_id=job, model=InputRef(sha256=model, bytes=10, key=f"{tenant}/inputs/{model}"),
                   calibration=None, spec=spec, toolchain=TOOLCHAIN, artifacts=arts)
    return k, arts


def test_lookup_proves_the_bytes_and_drops_a_corrupted_entry(tmp_path):
    store = FileStore(tmp_path / "store")
    cache = ResultCache(store, rehash_interval_s=3600)
    k, arts = _cached_result(store, tmp_path, cache)
    first = cache.lookup(k)
    assert first.hit and first.rehashed_bytes == sum(a.bytes for a in arts)
    again = cache.lookup(k)  # same object versions, proven a moment ago: not read again
    assert again.hit and again.rehashed_bytes == 0

    # Same size, same recorded sha256, different bytes: only the re-hash can tell.
    obj = tmp_path / "store" / "objects" / arts[0].key
    data = bytearray(obj.read_bytes())
    data[12345] ^= 0xFF
    obj.write_bytes(bytes(data))
    assert cache.lookup(k, prove=False).hit  # the cheap pre-upload check cannot see it
    bad = cache.lookup(k)
    assert not bad.hit and "hash to" in bad.reason
    assert cache.read(k) is None  # dropped: the next submit converts


def test_rehash_interval_zero_reads_every_hit_and_missing_artifacts_fail(tmp_path):
    store = FileStore(tmp_path / "store")
    cache = ResultCache(store, rehash_interval_s=0)
    k, arts = _cached_result(store, tmp_path, cache)
    assert cache.lookup(k).rehashed_bytes == cache.lookup(k).rehashed_bytes == sum(a.bytes for a in arts)
    store.delete_object(arts[1].key)
    gone = cache.lookup(k)
    assert not gone.hit and "gone" in gone.reason


def test_sweep_evicts_by_age_then_least_recently_used_by_size(tmp_path):
    store = FileStore(tmp_path / "store")
    cache = ResultCache(store, max_age_s=3600, max_bytes=5 << 20)
    keys = []
    for i, job in enumerate(("01jz0000000000000000000001", "01jz0000000000000000000002", "01jz0000000000000000000003")):
        k, _ = _cached_result(store, tmp_path, cache, job=job, model=hashlib.sha256(b"%d" % i).hexdigest())
        keys.append(k)
    now = time.time()
    entries = {e.key: e for e in cache.entries()}
    # Ages: keys[0] unused for 2 h (past max_age), keys[1] used 10 min ago, keys[2] just now.
    for k, used in ((keys[0], now - 7200), (keys[1], now - 600), (keys[2], now)):
        cache._write(entries[k].model_copy(update={"last_used_at": used}))
    result = cache.sweep(now=now)
    assert result.evicted_age == [keys[0]]
    assert result.evicted_size == [keys[1]]  # 2 × ~3 MiB > 5 MiB: the less recently used goes
    assert result.kept == 1 and [e.key for e in cache.entries()] == [keys[2]]


def test_a_malformed_entry_is_dropped(tmp_path):
    store = FileStore(tmp_path / "store")
    cache = ResultCache(store)
    k = "d" * 64
    import io

    store.put_stream(f"cache/{k}/manifest.json", io.BytesIO(b"{not json"))
    assert cache.lookup(k).reason == "no entry" and not store.exists(f"cache/{k}/manifest.json")
    assert CacheEntry.model_fields["artifacts"]  # the schema the entries are checked against


def test_a_late_cancel_puts_back_the_entry_its_job_replaced(tmp_path):
    """A second job with the same key (--no-cache, or a pre-upload miss that raced the first)
    converts, remembers its result, and is then cancelled: the first job's entry must come back."""
    store = FileStore(tmp_path / "store")
    cache = ResultCache(store)
    k, first_arts = _cached_result(store, tmp_path, cache, job=JOB)
    later, newest = "01jz0000000000000000000009", "01jz0000000000000000000010"
    _, later_arts = _cached_result(store, tmp_path, cache, job=later, size=100)
    spec = parse_spec({"targets": ["onnx"]})
    ref = InputRef(sha256=MODEL, bytes=10, key=f"t1/inputs/{MODEL}")
    cache.drop(k)  # start with no entry: only the artifacts of both jobs

    def remember(job: str, arts: list[StoredArtifact]):
        return cache.remember(k, tenant="t1", job_id=job, model=ref, calibration=None, spec=spec,
                              toolchain=TOOLCHAIN, artifacts=arts)

    cache.forget(remember(JOB, first_arts))
    assert cache.read(k) is None  # no earlier entry to restore: cancelled → nothing cached
    remember(JOB, first_arts)
    mine = remember(later, later_arts)  # the newest result wins...
    assert cache.read(k).job_id == later and mine.replaced.job_id == JOB
    cache.forget(mine)  # ...until its job turns out cancelled
    assert cache.read(k).job_id == JOB and cache.lookup(k).hit

    mine = remember(later, later_arts)
    remember(newest, first_arts)  # a newer job's entry, written after ours, is not ours to undo
    cache.forget(mine)
    assert cache.read(k).job_id == newest

    mine = remember(later, later_arts)
    store.delete_object(first_arts[0].key)  # what it replaced lost its artifacts meanwhile
    cache.forget(mine)
    assert cache.read(k) is None


def test_a_miss_from_checkupload_stands_once_and_not_for_long(monkeypatch):
    from fxport.service import servicer

    misses = servicer.RecentMisses(ttl_s=30.0, limit=2)
    misses.add("k1")
    assert misses.take("k1") and not misses.take("k1")  # taken once
    misses.add("k2")
    now = time.monotonic()
    monkeypatch.setattr(servicer.time, "monotonic", lambda: now + 31.0)
    assert not misses.take("k2")  # too old: the SubmitJob reads the entry itself
    monkeypatch.undo()
    for key in ("a", "b", "c"):
        misses.add(key)
    assert not misses.take("a") and misses.take("b") and misses.take("c")  # bounded: the oldest goes
