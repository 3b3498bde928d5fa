"""The shared TensorRT timing cache: one per (GPU model, compute capability, TensorRT version), in the object store.

A TensorRT build times candidate kernels ("tactics") for every layer; the timing cache keeps
those measurements, so a later build of the same layers on the same GPU model and TensorRT
version skips the timing. Timings from another GPU model or TensorRT version are meaningless
there, hence the key:

    cache/tensorrt/tenant/<tenant>/<gpu-name>_sm<cc>_trt<version>/timing.cache

One cache per tenant: the file is written by a sandbox that parsed a tenant's model, and
TensorRT deserializes it into the next build, so a cache shared by tenants would be a way for
one tenant's job to reach into another's. With FXPORT_CACHE_SHARE_ACROSS_TENANTS (the operator
trusts the tenants with each other's results) one cache serves all, under
`cache/tensorrt/shared/<gpu…>/timing.cache`.

The flow, split by who may touch what (the build runs in the sandbox, which has no store
credentials):
- worker (parent), before the build: `fetch_shared_cache` probes the GPU (nvidia-smi, no CUDA
  context) and the installed TensorRT version, derives the key, downloads the cache to a
  local file;
- sandbox (child): `load_timing_cache` gives it to the builder config — a corrupt or
  incompatible file is discarded with a warning, never a failure — and `save_timing_cache`
  writes the build's cache (what was loaded plus the new timings) out; the sandbox hands it
  back in the same local file;
- worker, after the build: `publish_shared_cache` uploads the file under the same key, when
  it changed. Both ends use the worker's probe for the key (the sandbox may not start
  nvidia-smi), so a fetch always finds what an earlier publish wrote. Should the probe
  name another GPU than the one the build ran on, TensorRT refuses the cache as
  "another device's" and the build runs cold — never with wrong timings.

Concurrent builds on the same GPU model: last writer wins. Each written cache holds what its
build loaded plus what it timed, so a lost entry only costs a re-timing on a later build.

Nothing here imports tensorrt or torch at module level; the key derivation is plain Python.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

KEY_PREFIX = "cache/tensorrt"
MAX_CACHE_BYTES = 256 << 20  # a timing cache is KBs to a few MBs; anything this big is not one


@dataclass(frozen=True)
class DeviceIdentity:
    """What a TensorRT engine and its timing cache are tied to."""

    gpu_name: str  # as the driver names it: "NVIDIA H200"
    compute_capability: str  # "9.0"
    tensorrt_version: str  # "10.15.1.29"

    def slug(self) -> str:
        cc = sanitize(self.compute_capability).replace(".", "")
        return f"{sanitize(self.gpu_name)}_sm{cc}_trt{sanitize(self.tensorrt_version)}"

    def as_dict(self) -> dict[str, str]:
        return {"gpu_name": self.gpu_name, "compute_capability": self.compute_capability,
                "tensorrt_version": self.tensorrt_version}


def sanitize(text: str, limit: int = 64) -> str:
    """Lowercase; every run of characters other than [a-z0-9.] becomes one '-'; trimmed."""
    out = re.sub(r"[^a-z0-9.]+", "-", text.strip().lower())
    out = re.sub(r"\.{2,}", ".", out).strip("-.")
    return out[:limit].strip("-.") or "unknown"


SHARED_SCOPE = None  # cache_key's scope for one cache across tenants


def cache_key(identity: DeviceIdentity, tenant: str | None) -> str:
    """The object-store key of the timing cache for `identity`, kept per `tenant` (None: one
    cache for every tenant). Tenant names are checked as for every key (fxport/storage/keys.py)."""
    from fxport.storage import check_tenant

    scope = "shared" if tenant is SHARED_SCOPE else f"tenant/{check_tenant(tenant)}"
    return f"{KEY_PREFIX}/{scope}/{identity.slug()}/timing.cache"


# ---------------------------------------------------------------------------------------
# Probing the device without a CUDA context (the worker process must not create one)
# ---------------------------------------------------------------------------------------

Runner = Callable[..., Any]


def tensorrt_version() -> str | None:
    """The installed TensorRT version, from package metadata (no import of its libraries)."""
    from importlib import metadata

    for dist in ("tensorrt", "tensorrt-cu13", "tensorrt-cu12", "tensorrt_libs"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    try:
        import tensorrt  # noqa: PLC0415 - only where no package metadata says it

        return str(tensorrt.__version__)
    except Exception:
        return None


def parse_nvidia_smi(text: str, visible: str | None) -> tuple[str, str] | None:
    """(name, compute capability) of the GPU CUDA numbers 0, from
    `nvidia-smi --query-gpu=index,uuid,name,compute_cap --format=csv,noheader`.

    CUDA_VISIBLE_DEVICES (`visible`) renumbers GPUs: its first entry (an index or a UUID
    prefix) is CUDA device 0. nvidia-smi itself ignores that variable.
    """
    rows = []
    for line in text.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 4:
            rows.append((parts[0], parts[1], ", ".join(parts[2:-1]), parts[-1]))
    if not rows:
        return None
    chosen = rows[0]
    first = (visible or "").split(",")[0].strip()
    if first:
        match = [r for r in rows if r[0] == first or (first.startswith(("GPU-", "MIG-")) and r[1].startswith(first))]
        if not match:
            return None
        chosen = match[0]
    name, cc = chosen[2], chosen[3]
    if not name or not re.match(r"^\d+\.\d+$", cc):
        return None
    return name, cc


def probe_device_identity(run: Runner = subprocess.run, env: dict[str, str] | None = None) -> DeviceIdentity | None:
    """This machine's (GPU name, compute capability, TensorRT version), or None when any is unknown."""
    return _probe(run, (env if env is not None else os.environ).get("CUDA_VISIBLE_DEVICES"))


@lru_cache(maxsize=4)  # keyed on the runner and CUDA_VISIBLE_DEVICES; GPUs and TensorRT fixed per process
def _probe(run: Runner, visible: str | None) -> DeviceIdentity | None:
    version = tensorrt_version()
    if version is None:
        return None
    try:
        done = run(["nvidia-smi", "--query-gpu=index,uuid,name,compute_cap", "--format=csv,noheader"],
                   capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    if getattr(done, "returncode", 1) != 0:
        return None
    found = parse_nvidia_smi(done.stdout, visible)
    return DeviceIdentity(found[0], found[1], version) if found else None


# ---------------------------------------------------------------------------------------
# Worker side: fetch before, publish after (the store is never reachable from the sandbox)
# ---------------------------------------------------------------------------------------


@dataclass
class SharedCacheHandle:
    path: Path  # the local file handed to the build (may not exist: a cold build)
    key: str | None  # where it came from; None when this machine could not be identified
    fetched_sha256: str | None = None
    warnings: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"key": self.key, "fetched": self.fetched_sha256 is not None, "fetched_sha256": self.fetched_sha256}


def fetch_shared_cache(store: Any, dest: Path, *, tenant: str | None,
                       identity: DeviceIdentity | None = None) -> SharedCacheHandle:
    """Download the timing cache for this machine and `tenant` (None: the one shared by all) to
    `dest`. Never raises: a missing, unreadable or oversized cache means a cold build, with a
    warning where that is news."""
    from fxport.storage import ObjectNotFound

    dest.parent.mkdir(parents=True, exist_ok=True)
    identity = identity or probe_device_identity()
    if identity is None:
        return SharedCacheHandle(dest, None, warnings=[
            "shared timing cache skipped: could not identify this GPU worker (needs nvidia-smi with the compute_cap "
            "field and the tensorrt package); building cold"])
    key = cache_key(identity, tenant)
    handle = SharedCacheHandle(dest, key)
    try:
        meta = store.head(key)
        if meta is None:
            return handle
        if meta.bytes > MAX_CACHE_BYTES:
            handle.warnings.append(f"shared timing cache {key} is {meta.bytes} bytes, over {MAX_CACHE_BYTES}: ignored")
            return handle
        stored = store.get(key, dest)
        handle.fetched_sha256 = stored.sha256
    except ObjectNotFound:
        pass
    except Exception as exc:  # a store hiccup or a corrupt object: build cold, never fail
        dest.unlink(missing_ok=True)
        handle.warnings.append(f"shared timing cache {key} could not be read ({type(exc).__name__}: {exc}); "
                               "building cold")
    return handle


def publish_shared_cache(store: Any, handle: SharedCacheHandle) -> dict[str, Any]:
    """Upload the build's timing cache (handle.path) under handle.key, when it changed. Never raises."""
    out: dict[str, Any] = {**handle.as_dict(), "published": False}
    key = handle.key
    if key is None:
        return out
    path = handle.path
    if not path.is_file() or path.stat().st_size == 0:
        return out
    size = path.stat().st_size
    if size > MAX_CACHE_BYTES:
        handle.warnings.append(f"the build wrote a {size}-byte timing cache, over {MAX_CACHE_BYTES}: not published")
        return out
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    out["sha256"] = digest
    if digest == handle.fetched_sha256:
        out["unchanged"] = True
        return out
    try:
        store.put_file(key, path, sha256=digest)
        out["published"] = True
        out["bytes"] = size
    except Exception as exc:
        handle.warnings.append(f"the timing cache could not be written to {key} ({type(exc).__name__}: {exc})")
    return out


# ---------------------------------------------------------------------------------------
# Build side (inside the sandbox, with TensorRT): load into a builder config, save after
# ---------------------------------------------------------------------------------------


@dataclass
class LoadedCache:
    cache: Any  # the ITimingCache the builder config uses
    status: str  # "warm" (loaded), "cold" (no file), "discarded" (corrupt / incompatible)
    bytes_in: int = 0
    warning: str | None = None

    def as_dict(self) -> dict[str, Any]:
        out = {"status": self.status, "bytes_in": self.bytes_in}
        if self.warning:
            out["warning"] = self.warning
        return out


def load_timing_cache(config: Any, path: Path | None) -> LoadedCache:
    """Give `config` the timing cache in `path` (TensorRT IBuilderConfig). A file TensorRT
    cannot read, or one from another device or TensorRT version, is replaced by an empty
    cache and reported as "discarded" with the reason."""
    data = path.read_bytes() if path is not None and path.is_file() else b""
    if not data:
        cache = config.create_timing_cache(b"")
        config.set_timing_cache(cache, False)
        return LoadedCache(cache, "cold")
    why = None
    try:
        cache = config.create_timing_cache(data)
    except Exception as exc:
        cache, why = None, f"TensorRT could not read it ({type(exc).__name__}: {exc})"
    if cache is None and why is None:
        why = "TensorRT could not read it (corrupt, or written by another TensorRT version)"
    if cache is not None:
        try:
            accepted = config.set_timing_cache(cache, False)  # False: refuse another device's timings
        except Exception as exc:
            accepted, why = False, f"TensorRT refused it ({type(exc).__name__}: {exc})"
        if accepted is not False:
            return LoadedCache(cache, "warm", len(data))
        why = why or "it was recorded on another GPU model or TensorRT version"
    warning = f"timing cache discarded ({len(data)} bytes): {why}; building cold"
    log.warning(warning)
    cache = config.create_timing_cache(b"")
    config.set_timing_cache(cache, False)
    return LoadedCache(cache, "discarded", len(data), warning)


def save_timing_cache(config: Any, path: Path) -> int:
    """Write the config's timing cache (loaded entries + this build's) to `path`, atomically."""
    cache = config.get_timing_cache()
    if cache is None:
        return 0
    data = bytes(memoryview(cache.serialize()))
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return len(data)
