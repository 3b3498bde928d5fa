"""The toolchain fingerprint: which versions of the conversion stack make a job's artifacts.

Part of the result-cache key (fxport/cache.py; deploy/README.md, "Result cache"): fxport, torch, onnx and
onnxruntime versions, plus the TensorRT version and the GPU model for jobs that build an
engine. Read from installed package metadata (`importlib.metadata`), never by importing
torch, so the API server, whose image has no torch, can compute it too — but there it would
describe the wrong machine. So:

- a worker computes its own fingerprint at startup and publishes it per queue in Redis
  (`fxport:toolchain:<queue>`, refreshed while it runs); the API reads what the workers of
  the job's queue(s) published;
- the embedded server runs its jobs in-process, so it uses its own (`local_toolchain`).

A worker that writes a cache entry keys it with its own fingerprint, so a stale or missing
publication can only make lookups miss, never serve another toolchain's artifacts.

The custom op libraries a worker's sandbox loads before each model (FXPORT_OP_LIBRARIES,
`op_library_records`) are part of it under `op_libraries`, only where some are set: a worker
with other libraries (or another build of one) never shares cached results with this one, and
a worker with none keeps the fingerprint it had before the setting existed.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import json
import logging
import os
import platform
import shutil
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fxport.config import OP_LIBRARIES_ENV, parse_op_libraries
from fxport.digest import sha256_file
from fxport.errors import InvalidInput
from fxport.periodic import PeriodicTask

log = logging.getLogger(__name__)

CPU_PACKAGES = ("fxport", "torch", "onnx", "onnxruntime")
GPU_PACKAGES = ("tensorrt",)
PUBLISH_KEY = "fxport:toolchain:{queue}"
REPUBLISH_S = 300.0
READ_CACHE_S = 1.0

Toolchain = dict[str, Any]


def _version(module: str) -> str | None:
    """Version of the distribution that provides import name `module` (e.g. onnxruntime may
    come from `onnxruntime-gpu`, tensorrt from `tensorrt-cu13`), or None if not installed."""
    try:
        return importlib.metadata.version(module)
    except importlib.metadata.PackageNotFoundError:
        pass
    if importlib.util.find_spec(module) is None:  # not installed: no scan of every distribution
        return None
    for name in _distributions().get(module, ()):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


@functools.lru_cache(maxsize=1)  # the installed packages: fixed for a process's life (a worker restarts to upgrade)
def _distributions() -> dict[str, list[str]]:
    return dict(importlib.metadata.packages_distributions())


@functools.lru_cache(maxsize=1)  # the machine's GPU: fixed for a process's life
def gpu_model() -> str | None:
    """The first GPU's model name (nvidia-smi), or None on a machine without one."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    names = [line.strip() for line in out.splitlines() if line.strip()]
    return names[0] if names else None


@functools.lru_cache(maxsize=2)  # keyed on `gpu`; the versions it reads are fixed for a process's life
def _local_toolchain(gpu: bool) -> tuple[tuple[str, Any], ...]:
    out: Toolchain = {name: _version(name) for name in CPU_PACKAGES}
    if gpu:
        out.update({name: _version(name) for name in GPU_PACKAGES})
        out["gpu"] = gpu_model()
    return tuple(out.items())


def local_toolchain(*, gpu: bool = False, op_libraries: Sequence[str] | None = None) -> Toolchain:
    """This machine's versions (read once per process); with `gpu`, also TensorRT's and the GPU model;
    with op libraries (`op_libraries`, default: this process's FXPORT_OP_LIBRARIES), what each is."""
    out = dict(_local_toolchain(gpu))
    entries = configured_op_libraries() if op_libraries is None else tuple(op_libraries)
    if entries:
        out["op_libraries"] = op_library_records(entries)
    return out


def manifest_toolchain() -> Toolchain:
    """What a manifest records under `toolchain`: every package of the conversion stack (None where
    it is not installed), Python's version, and the op libraries this process loaded
    (`note_op_libraries`). Read as the cache key reads them, so the two agree."""
    out = {**dict(_local_toolchain(False)), **{name: _version(name) for name in GPU_PACKAGES},
           "python": platform.python_version()}
    if _loaded_op_libraries:
        out["op_libraries"] = [dict(record) for record in _loaded_op_libraries]
    return out


# -- custom op libraries (FXPORT_OP_LIBRARIES) ------------------------------------------------

# What this process loaded (the sandbox child, before it opened the model): its manifest records them.
_loaded_op_libraries: list[dict[str, str | None]] = []


def configured_op_libraries() -> tuple[str, ...]:
    """This process's FXPORT_OP_LIBRARIES, parsed as Settings parses it. Raises InvalidInput
    naming the setting when an entry is neither an absolute path nor a module name."""
    try:
        return parse_op_libraries(os.environ.get(OP_LIBRARIES_ENV, ""))
    except ValueError as exc:
        raise InvalidInput(str(exc), field=OP_LIBRARIES_ENV, hint="fix the setting and restart the worker") from None


def op_library_records(entries: Sequence[str]) -> list[dict[str, str | None]]:
    """What each op library is, in the form the manifest and the cache key record it: a shared
    library (an absolute path) as {"library": path, "sha256": its digest (None where it cannot be
    read)}, a module as {"module": name, "version": its distribution's version (None where it is
    not installed)}. Read without loading anything, so the worker's side and the child agree."""
    records: list[dict[str, str | None]] = []
    for entry in entries:
        if entry.startswith("/"):
            records.append({"library": entry, "sha256": _file_sha256(entry)})
        else:
            records.append({"module": entry, "version": _version(entry.split(".")[0])})
    return records


def note_op_libraries(records: Sequence[dict[str, str | None]]) -> None:
    """Record the op libraries this process has loaded (the sandbox child), for its manifest."""
    _loaded_op_libraries[:] = [dict(record) for record in records]


def loaded_op_libraries() -> list[str]:
    """The entries of FXPORT_OP_LIBRARIES this process has loaded, as set (a module or a path)."""
    return [str(r.get("module") or r.get("library")) for r in _loaded_op_libraries]


def _file_sha256(path: str) -> str | None:
    """sha256 of the file at `path`, hashed again only when its inode, size or mtime changed."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return _hashed_file(path, st.st_ino, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=32)  # keyed on the file's identity: a library replaced in place is hashed again
def _hashed_file(path: str, _ino: int, _size: int, _mtime_ns: int) -> str | None:
    try:
        return sha256_file(Path(path))[0]
    except OSError:
        return None


def job_fingerprint(cpu: Toolchain | None, gpu: Toolchain | None, *, engine: bool) -> Toolchain | None:
    """The fingerprint of a job: the CPU workers' stack, plus TensorRT + GPU model when the job
    builds an engine. None when it cannot be told (nothing published, or a GPU part missing):
    such a job is neither looked up nor cached."""
    if not cpu or any(cpu.get(name) is None for name in ("fxport", "torch")):
        return None
    fingerprint = {name: cpu.get(name) for name in CPU_PACKAGES}
    if cpu.get("op_libraries"):  # only where some are loaded: a fingerprint without any is unchanged
        fingerprint["op_libraries"] = cpu["op_libraries"]
    if engine:
        if not gpu or gpu.get("tensorrt") is None or gpu.get("gpu") is None:
            return None
        fingerprint.update(tensorrt=gpu["tensorrt"], gpu=gpu["gpu"])
    return fingerprint


def publish(redis_client: Any, queue: str, toolchain: Toolchain, worker: str) -> None:
    redis_client.set(PUBLISH_KEY.format(queue=queue),
                     json.dumps({"toolchain": toolchain, "worker": worker, "at": time.time()}))


class ToolchainPublisher(PeriodicTask):
    """A worker's main process: publish this machine's fingerprint for each queue it consumes,
    now and every REPUBLISH_S (a Redis without persistence forgets it on restart)."""

    name = "toolchain-publisher"
    tick_at_start = True

    def __init__(self, redis_url: str, queues: list[str], worker: str, *, interval_s: float = REPUBLISH_S) -> None:
        import redis

        super().__init__(interval_s)
        self._redis = redis.Redis.from_url(redis_url, socket_timeout=2, socket_connect_timeout=2)
        self.queues, self.worker = queues, worker

    def tick(self) -> None:
        for queue in self.queues:
            publish(self._redis, queue, local_toolchain(gpu=queue == "gpu"), self.worker)

    publish_now = tick

    def on_stop(self) -> None:
        self._redis.close()


class PublishedToolchains:
    """The API side: what the workers of each queue published, re-read at most every
    READ_CACHE_S (a burst of submits costs one Redis round trip)."""

    def __init__(self, redis_url: str, *, cache_s: float = READ_CACHE_S) -> None:
        import redis

        self._redis = redis.Redis.from_url(redis_url, decode_responses=True, socket_timeout=2,
                                           socket_connect_timeout=2)
        self.cache_s = cache_s
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[float, Toolchain | None]] = {}

    def get(self, queue: str) -> Toolchain | None:
        now = time.monotonic()
        with self._lock:
            hit = self._cache.get(queue)
            if hit is not None and now - hit[0] < self.cache_s:
                return hit[1]
        try:
            raw = self._redis.get(PUBLISH_KEY.format(queue=queue))
            value = json.loads(raw)["toolchain"] if raw else None
        except Exception as exc:
            log.warning("could not read the %s workers' toolchain: %s", queue, exc)
            value = None
        with self._lock:
            self._cache[queue] = (now, value)
        return value

    def forget(self) -> None:
        """Drop the read cache (tests that change a publication)."""
        with self._lock:
            self._cache.clear()

    def close(self) -> None:
        self._redis.close()


class LocalToolchains:
    """The embedded server: its jobs run here, so its own versions are the workers'."""

    def __init__(self) -> None:
        self._found: dict[str, Toolchain] = {}

    def get(self, queue: str) -> Toolchain | None:
        if queue not in self._found:
            self._found[queue] = local_toolchain(gpu=queue == "gpu")
        return self._found[queue]

    def forget(self) -> None:
        pass

    def close(self) -> None:
        pass
