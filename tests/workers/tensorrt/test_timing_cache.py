"""Shared timing cache: key derivation, device probing, fetch/publish through a real FileStore,
and the discard-never-fail rules of loading a cache into a builder config.

TensorRT cannot be installed without a GPU (it is the optional `gpu` extra), so the builder-config side is exercised
with a stand-in that has IBuilderConfig's timing-cache methods and their documented results
(create_timing_cache → None or raises on bytes it cannot read; set_timing_cache → False for
another device's cache). The real thing runs in the gpu tests.
"""

from __future__ import annotations

import hashlib
import subprocess
from types import SimpleNamespace

import pytest

from fxport.storage import FileStore
from fxport.workers.engine.tensorrt import timing_cache as tc
from fxport.workers.engine.tensorrt.timing_cache import (
    DeviceIdentity,
    cache_key,
    fetch_shared_cache,
    load_timing_cache,
    parse_nvidia_smi,
    publish_shared_cache,
    sanitize,
    save_timing_cache,
)

H200 = DeviceIdentity("NVIDIA H200", "9.0", "10.15.1.29")


@pytest.mark.parametrize("identity, key", [
    (H200, "cache/tensorrt/tenant/alice/nvidia-h200_sm90_trt10.15.1.29/timing.cache"),
    (DeviceIdentity("NVIDIA GeForce RTX 4090", "8.9", "10.3.0"),
     "cache/tensorrt/tenant/alice/nvidia-geforce-rtx-4090_sm89_trt10.3.0/timing.cache"),
    (DeviceIdentity("NVIDIA A100-SXM4-80GB", "8.0", "10.0.1.6"),
     "cache/tensorrt/tenant/alice/nvidia-a100-sxm4-80gb_sm80_trt10.0.1.6/timing.cache"),
    (DeviceIdentity("  ../Tesla T4 (MIG 1g.5gb)/ ", "7.5", "10.15.1+cuda12"),
     "cache/tensorrt/tenant/alice/tesla-t4-mig-1g.5gb_sm75_trt10.15.1-cuda12/timing.cache"),
])
def test_cache_key_per_tenant_gpu_model_compute_capability_and_tensorrt_version(identity, key):
    assert cache_key(identity, "alice") == key
    # a key is a plain path: no traversal, no empty segment, valid for the file and S3 stores
    assert ".." not in key.split("/") and "" not in key.split("/") and key.isascii()


def test_every_part_of_the_identity_changes_the_key():
    keys = {cache_key(H200, "alice"), cache_key(DeviceIdentity("NVIDIA H100 80GB HBM3", "9.0", "10.15.1.29"), "alice"),
            cache_key(DeviceIdentity("NVIDIA H200", "10.0", "10.15.1.29"), "alice"),
            cache_key(DeviceIdentity("NVIDIA H200", "9.0", "10.14.1.48"), "alice"),
            cache_key(H200, "bob"), cache_key(H200, None)}
    assert len(keys) == 6
    assert cache_key(H200, None) == "cache/tensorrt/shared/nvidia-h200_sm90_trt10.15.1.29/timing.cache"
    with pytest.raises(Exception, match="invalid tenant"):
        cache_key(H200, "../shared")


def test_sanitize():
    assert sanitize("NVIDIA  H200 NVL") == "nvidia-h200-nvl"
    assert sanitize("...") == "unknown" and sanitize("a" * 200) == "a" * 64


SMI = """0, GPU-11111111-aaaa, NVIDIA H200, 9.0
1, GPU-22222222-bbbb, NVIDIA L4, 8.9
"""


def test_nvidia_smi_parsing_follows_cuda_visible_devices():
    assert parse_nvidia_smi(SMI, None) == ("NVIDIA H200", "9.0")
    assert parse_nvidia_smi(SMI, "1,0") == ("NVIDIA L4", "8.9")
    assert parse_nvidia_smi(SMI, "GPU-2222") == ("NVIDIA L4", "8.9")
    assert parse_nvidia_smi(SMI, "7") is None  # a GPU nvidia-smi does not list: unknown, not a guess
    assert parse_nvidia_smi("0, GPU-1, NVIDIA H200, [N/A]\n", None) is None
    assert parse_nvidia_smi("", None) is None


def test_probe_without_tensorrt_or_nvidia_smi_is_none(monkeypatch):
    tc._probe.cache_clear()
    monkeypatch.setattr(tc, "tensorrt_version", lambda: "10.15.1.29")

    def smi(argv, **kw):
        assert argv[0] == "nvidia-smi" and "compute_cap" in argv[1]
        return SimpleNamespace(returncode=0, stdout=SMI)

    assert tc.probe_device_identity(run=smi, env={"CUDA_VISIBLE_DEVICES": "1"}) == DeviceIdentity("NVIDIA L4", "8.9",
                                                                                                   "10.15.1.29")

    def missing(argv, **kw):
        raise FileNotFoundError("nvidia-smi")

    assert tc.probe_device_identity(run=missing, env={}) is None
    monkeypatch.setattr(tc, "tensorrt_version", lambda: None)
    assert tc.probe_device_identity(run=smi, env={"CUDA_VISIBLE_DEVICES": "0"}) is None
    tc._probe.cache_clear()


def test_this_cpu_machine_is_not_identified():
    tc._probe.cache_clear()
    assert tc.probe_device_identity(run=subprocess.run, env={}) is None  # no tensorrt on a CPU-only machine
    tc._probe.cache_clear()


def test_fetch_then_publish_round_trip_through_the_store(tmp_path):
    store = FileStore(tmp_path / "store")
    first = fetch_shared_cache(store, tmp_path / "a" / "timing.cache", tenant="alice", identity=H200)
    assert first.key == cache_key(H200, "alice") and first.fetched_sha256 is None and not first.warnings
    assert not first.path.exists()  # cold: nothing to read
    first.path.write_bytes(b"timings of build 1")  # what the sandboxed build leaves there
    published = publish_shared_cache(store, first)
    assert published["published"] and published["key"] == cache_key(H200, "alice")

    second = fetch_shared_cache(store, tmp_path / "b" / "timing.cache", tenant="alice", identity=H200)
    assert second.path.read_bytes() == b"timings of build 1"
    assert second.fetched_sha256 == hashlib.sha256(b"timings of build 1").hexdigest()
    unchanged = publish_shared_cache(store, second)  # nothing new timed: no write
    assert unchanged["unchanged"] and not unchanged["published"]
    second.path.write_bytes(b"timings of build 1 + 2")
    assert publish_shared_cache(store, second)["published"]

    other = fetch_shared_cache(store, tmp_path / "c" / "timing.cache", tenant="alice",
                               identity=DeviceIdentity("NVIDIA L4", "8.9", "10.15.1.29"))
    assert other.fetched_sha256 is None  # another GPU model never sees the H200's timings
    # Nor does another tenant: the file comes out of a sandbox that parsed alice's model, and
    # TensorRT deserializes it into the next build.
    bob = fetch_shared_cache(store, tmp_path / "d" / "timing.cache", tenant="bob", identity=H200)
    assert bob.fetched_sha256 is None and not bob.path.exists()


def test_a_corrupt_stored_cache_means_a_cold_build_with_a_warning(tmp_path):
    store = FileStore(tmp_path / "store")
    src = tmp_path / "src"
    src.write_bytes(b"good")
    store.put_file(cache_key(H200, "alice"), src)
    (tmp_path / "store" / "objects" / cache_key(H200, "alice")).write_bytes(b"bitrot")  # sha256 no longer matches
    handle = fetch_shared_cache(store, tmp_path / "x" / "timing.cache", tenant="alice", identity=H200)
    assert handle.fetched_sha256 is None and not handle.path.exists()
    assert handle.warnings and "could not be read" in handle.warnings[0] and "building cold" in handle.warnings[0]


def test_an_unidentified_worker_builds_without_the_shared_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(tc, "probe_device_identity", lambda: None)
    handle = fetch_shared_cache(FileStore(tmp_path / "store"), tmp_path / "t.cache", tenant="alice")
    assert handle.key is None and "could not identify this GPU worker" in handle.warnings[0]
    handle.path.write_bytes(b"x")
    assert publish_shared_cache(FileStore(tmp_path / "store"), handle)["published"] is False


# --- loading into a builder config (stand-in with IBuilderConfig's timing-cache methods) ---------


class StandInCache:
    def __init__(self, data: bytes) -> None:
        self.data = data

    def serialize(self) -> bytes:
        return self.data + b"+new"


class StandInConfig:
    """IBuilderConfig's timing-cache surface: b"CORRUPT..." cannot be read, b"OTHERGPU..." is refused."""

    def __init__(self, unreadable: str = "none") -> None:
        self.unreadable, self.cache = unreadable, None

    def create_timing_cache(self, data: bytes) -> StandInCache | None:
        if data.startswith(b"CORRUPT"):
            if self.unreadable == "raise":
                raise RuntimeError("Invalid timing cache header")
            return None
        return StandInCache(bytes(data))

    def set_timing_cache(self, cache: StandInCache, ignore_mismatch: bool) -> bool:
        assert ignore_mismatch is False  # another device's timings are never accepted
        if cache.data.startswith(b"OTHERGPU"):
            return False
        self.cache = cache
        return True

    def get_timing_cache(self) -> StandInCache | None:
        return self.cache


def test_load_cold_warm_and_save(tmp_path):
    config = StandInConfig()
    cold = load_timing_cache(config, tmp_path / "missing.cache")
    assert cold.status == "cold" and cold.warning is None and config.cache.data == b""
    path = tmp_path / "t.cache"
    path.write_bytes(b"TIMINGS")
    warm = load_timing_cache(config, path)
    assert warm.status == "warm" and warm.bytes_in == 7 and config.cache.data == b"TIMINGS"
    assert save_timing_cache(config, tmp_path / "out.cache") == len(b"TIMINGS+new")
    assert (tmp_path / "out.cache").read_bytes() == b"TIMINGS+new"


@pytest.mark.parametrize("content, unreadable, why", [
    (b"CORRUPT bytes", "none", "could not read it"),
    (b"CORRUPT bytes", "raise", "Invalid timing cache header"),
    (b"OTHERGPU timings", "none", "another GPU model or TensorRT version"),
])
def test_corrupt_or_incompatible_cache_is_discarded_with_a_warning(tmp_path, content, unreadable, why):
    path = tmp_path / "t.cache"
    path.write_bytes(content)
    config = StandInConfig(unreadable)
    loaded = load_timing_cache(config, path)
    assert loaded.status == "discarded" and why in loaded.warning and "building cold" in loaded.warning
    assert config.cache is not None and config.cache.data == b""  # the build still gets a (fresh) cache
    assert loaded.as_dict()["warning"] == loaded.warning
