"""The result cache (deploy/README.md, "Result cache"): an identical job is answered with an earlier job's artifacts.

Identical means the same cache key:

    sha256(scope, model sha256, calibration sha256, spec digest, toolchain fingerprint)

- scope: the tenant, or "*" (no tenant can be named that) when the operator enables
  cross-tenant sharing (`FXPORT_CACHE_SHARE_ACROSS_TENANTS`). Without sharing, one tenant
  cannot even name another's entries.
- spec digest: sha256 of the normalized spec (every default filled in, keys sorted) without
  `labels` and `limits`, which describe the job, not its artifacts: a CI run with a new
  `git_sha` label still hits.
- toolchain fingerprint: fxport, torch, onnx, onnxruntime (+ TensorRT and the GPU model for
  engines) of the workers; see fxport/toolchain.py.

An entry is `cache/{key}/manifest.json`: JSON pointing at the artifacts (keys, sizes, sha256)
of the job that made them, written by the worker when the job SUCCEEDED. The artifacts are
not copied: the cache is an index over job outputs. Evicting an entry removes the index
entry only; an entry whose artifacts are gone fails its proof check and is dropped.

Proof check on a hit: every artifact must still exist with the recorded size and sha256,
and its bytes must hash to that sha256 — re-hashed streamed (1 MiB chunks, bounded memory,
artifacts in parallel). A re-hash is remembered against the object's version (S3 ETag +
Last-Modified, or the file's inode/size/mtime): while that is unchanged and younger than
`cache_rehash_interval_s`, the bytes are not read again (any rewrite of the object through
the store changes its version). 0 = re-hash on every hit. A failed check drops the entry and
the job is converted as if there had been none.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, Field, ValidationError

from fxport.jobs import StoredArtifact
from fxport.periodic import PeriodicTask
from fxport.spec import JobSpec
from fxport.storage import SHA256_RE, ArtifactStore, ObjectNotFound, StorageError

log = logging.getLogger(__name__)

CACHE_PREFIX = "cache/"
SHARED_SCOPE = "*"
KEY_VERSION = 1
TOUCH_S = 600.0  # how stale an entry's last_used_at may get before a hit rewrites it
REHASH_THREADS = 4


def spec_digest(spec: JobSpec) -> str:
    """sha256 of the normalized spec without the fields that do not shape the artifacts."""
    return spec.artifact_digest()


def cache_key(*, scope: str, model_sha256: str, calibration_sha256: str | None, spec_sha256: str,
              toolchain: dict[str, Any]) -> str:
    blob = json.dumps({"v": KEY_VERSION, "scope": scope, "model": model_sha256, "calibration": calibration_sha256 or "",
                       "spec": spec_sha256, "toolchain": toolchain}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def entry_key(key: str) -> str:
    if not SHA256_RE.match(key):
        raise ValueError(f"invalid cache key {key!r}")
    return f"{CACHE_PREFIX}{key}/manifest.json"


def wants_engine(spec: JobSpec) -> bool:
    return "tensorrt" in spec.targets


class CacheEntry(BaseModel):
    """cache/{key}/manifest.json."""

    version: int = KEY_VERSION
    key: str
    tenant: str = Field(description="The tenant whose job made the artifacts.")
    job_id: str
    created_at: float
    last_used_at: float
    model_sha256: str
    model_bytes: int = 0
    calibration_sha256: str | None = None
    calibration_bytes: int = 0
    spec_digest: str
    toolchain: dict[str, Any]
    artifacts: list[StoredArtifact]

    @property
    def bytes(self) -> int:
        return sum(a.bytes for a in self.artifacts)


@dataclass
class Lookup:
    """What a lookup found: `entry` on a hit; otherwise `reason` says why not."""

    key: str | None
    entry: CacheEntry | None = None
    reason: str = ""
    check_s: float = 0.0
    rehashed_bytes: int = 0

    @property
    def hit(self) -> bool:
        return self.entry is not None


@dataclass
class CacheSweepResult:
    kept: int = 0
    kept_bytes: int = 0
    evicted_age: list[str] = field(default_factory=list)
    evicted_size: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Remembered:
    """What a worker's `remember` wrote: the key, the job, and the entry it replaced (if another job's)."""

    key: str
    job_id: str
    replaced: CacheEntry | None = None


class ProofFailed(Exception):
    """A cached artifact is gone, changed, or its bytes no longer hash to its recorded sha256."""


class ResultCache:
    """Lookups and proof checks (API server), entry writes (workers), eviction (a sweep)."""

    def __init__(self, store: ArtifactStore, *, enabled: bool = True, share_across_tenants: bool = False,
                 rehash_interval_s: float = 3600.0, max_age_s: float = 0.0, max_bytes: int = 0) -> None:
        self.store = store
        self.enabled = enabled
        self.share_across_tenants = share_across_tenants
        self.rehash_interval_s = rehash_interval_s
        self.max_age_s = max_age_s
        self.max_bytes = max_bytes
        self._proven: dict[tuple[str, str], float] = {}  # (object key, version) → when its bytes were re-hashed
        self._lock = threading.Lock()

    @classmethod
    def from_settings(cls, store: ArtifactStore, settings: Any) -> ResultCache:
        return cls(store, enabled=settings.cache_enabled, share_across_tenants=settings.cache_share_across_tenants,
                   rehash_interval_s=settings.cache_rehash_interval_s, max_age_s=settings.cache_max_age_s,
                   max_bytes=settings.cache_max_bytes)

    # -- keys ------------------------------------------------------------------------------

    def scope(self, tenant: str) -> str:
        return SHARED_SCOPE if self.share_across_tenants else tenant

    def key_for(self, tenant: str, model_sha256: str, calibration_sha256: str | None, spec: JobSpec,
                toolchain: dict[str, Any] | None) -> str | None:
        """The job's cache key; None when the cache is off or the toolchain is unknown."""
        if not self.enabled or toolchain is None:
            return None
        return cache_key(scope=self.scope(tenant), model_sha256=model_sha256, calibration_sha256=calibration_sha256,
                         spec_sha256=spec_digest(spec), toolchain=toolchain)

    # -- lookups (API) ---------------------------------------------------------------------

    def read(self, key: str) -> CacheEntry | None:
        try:
            raw = b"".join(self.store.iter_chunks(entry_key(key)))
        except ObjectNotFound:
            return None
        try:
            entry = CacheEntry.model_validate_json(raw)
        except ValidationError as exc:
            log.warning("cache entry %s is unreadable; dropping it: %s", key, exc)
            self.drop(key)
            return None
        if entry.key != key:
            log.warning("cache entry %s names key %s; dropping it", key, entry.key)
            self.drop(key)
            return None
        return entry

    def lookup(self, key: str | None, *, prove: bool = True) -> Lookup:
        """The entry for `key` if it passes its check: with `prove`, the full proof (sizes, sha256
        and the bytes themselves); without, the cheap part (sizes and recorded sha256 only), for a
        pre-upload hint. A failed check drops the entry."""
        if key is None:
            return Lookup(None, reason="cache off or toolchain unknown")
        started = time.monotonic()
        entry = self.read(key)
        if entry is None:
            return Lookup(key, reason="no entry", check_s=time.monotonic() - started)
        try:
            rehashed = self._check(entry, rehash=prove)
        except ProofFailed as exc:
            log.warning("cached result %s failed its proof check (%s); dropping it", key, exc)
            self.drop(key)
            return Lookup(key, reason=f"proof failed: {exc}", check_s=time.monotonic() - started)
        if time.time() - entry.last_used_at > min(TOUCH_S, self.max_age_s / 10 if self.max_age_s else TOUCH_S):
            threading.Thread(target=self._touch, args=(entry,), daemon=True).start()
        return Lookup(key, entry, "hit", time.monotonic() - started, rehashed)

    def _check(self, entry: CacheEntry, *, rehash: bool) -> int:
        """Raise ProofFailed unless every artifact is intact. Returns the bytes re-hashed."""
        if not entry.artifacts:
            raise ProofFailed("the entry lists no artifacts")
        with ThreadPoolExecutor(max_workers=min(REHASH_THREADS, len(entry.artifacts))) as pool:
            return sum(pool.map(lambda art: self._check_one(art, rehash), entry.artifacts))

    def _check_one(self, art: StoredArtifact, rehash: bool) -> int:
        try:
            meta = self.store.head(art.key)
        except StorageError as exc:
            raise ProofFailed(f"{art.name}: {exc}") from exc
        if meta is None:
            raise ProofFailed(f"{art.name} is gone from the store")
        if meta.bytes != art.bytes or meta.sha256 != art.sha256:
            raise ProofFailed(f"{art.name} changed: {meta.bytes} bytes, sha256 {meta.sha256[:12]}… recorded "
                              f"{art.bytes} bytes, sha256 {art.sha256[:12]}…")
        if not rehash:
            return 0
        version = getattr(meta, "version", "")
        memo = (art.key, version)
        if version and self.rehash_interval_s > 0:
            with self._lock:
                proven_at = self._proven.get(memo)
            if proven_at is not None and time.monotonic() - proven_at < self.rehash_interval_s:
                return 0
        h, n = hashlib.sha256(), 0
        try:
            for chunk in self.store.iter_chunks(art.key):
                h.update(chunk)
                n += len(chunk)
        except StorageError as exc:
            raise ProofFailed(f"{art.name}: {exc}") from exc
        if n != art.bytes or h.hexdigest() != art.sha256:
            raise ProofFailed(f"{art.name}: its bytes hash to {h.hexdigest()[:12]}… ({n} bytes), recorded "
                              f"{art.sha256[:12]}… ({art.bytes} bytes)")
        if version:
            with self._lock:
                self._proven[memo] = time.monotonic()
                if len(self._proven) > 100_000:  # bounded: forget the oldest half
                    for k, _ in sorted(self._proven.items(), key=lambda kv: kv[1])[:50_000]:
                        self._proven.pop(k, None)
        return n

    def _touch(self, entry: CacheEntry) -> None:
        try:
            self._write(entry.model_copy(update={"last_used_at": time.time()}))
        except Exception as exc:  # only eviction order suffers
            log.debug("could not refresh cache entry %s: %s", entry.key, exc)

    # -- writes (workers) ------------------------------------------------------------------

    def remember(self, key: str, *, tenant: str, job_id: str, model: Any, calibration: Any, spec: JobSpec,
                 toolchain: dict[str, Any], artifacts: Iterable[StoredArtifact]) -> Remembered:
        """Write the entry for a job that SUCCEEDED. `model`/`calibration`: its InputRefs.

        The newest result wins (a `--no-cache` run refreshes the entry); the entry it replaced
        comes back in the result, so that a job cancelled after this write can put it back
        (`forget`) instead of leaving no entry at all."""
        replaced = self.read(key)
        now = time.time()
        entry = CacheEntry(key=key, tenant=tenant, job_id=job_id, created_at=now, last_used_at=now,
                           model_sha256=model.sha256, model_bytes=model.bytes,
                           calibration_sha256=calibration.sha256 if calibration else None,
                           calibration_bytes=calibration.bytes if calibration else 0,
                           spec_digest=spec_digest(spec), toolchain=toolchain, artifacts=list(artifacts))
        self._write(entry)
        return Remembered(key, job_id, replaced if replaced is not None and replaced.job_id != job_id else None)

    def forget(self, remembered: Remembered) -> None:
        """Undo `remember` for a job that did not become SUCCEEDED after all (cancelled meanwhile).
        Only if the entry still names that job: a newer job's entry stays. The entry it replaced
        is put back while its artifacts are intact; otherwise the key is dropped."""
        entry = self.read(remembered.key)
        if entry is None or entry.job_id != remembered.job_id:
            return
        previous = remembered.replaced
        if previous is not None:
            try:
                self._check(previous, rehash=False)
                self._write(previous)
                return
            except ProofFailed:
                pass
        self.drop(remembered.key)

    def _write(self, entry: CacheEntry) -> None:
        self.store.put_stream(entry_key(entry.key), io.BytesIO(entry.model_dump_json(indent=1).encode()))

    def drop(self, key: str) -> None:
        try:
            self.store.delete_prefix(f"{CACHE_PREFIX}{key}/")
        except StorageError as exc:
            log.warning("could not drop cache entry %s: %s", key, exc)

    # -- eviction --------------------------------------------------------------------------

    def entries(self) -> list[CacheEntry]:
        out = []
        for obj in self.store.list_prefix(CACHE_PREFIX):
            parts = obj.key.split("/")
            if len(parts) != 3 or parts[2] != "manifest.json" or not SHA256_RE.match(parts[1]):
                continue
            entry = self.read(parts[1])
            if entry is not None:
                out.append(entry)
        return out

    def sweep(self, *, now: float | None = None) -> CacheSweepResult:
        """Evict entries unused for longer than max_age_s, then the least recently used until the
        artifacts the rest point at fit in max_bytes (0 = no limit, for either)."""
        now = time.time() if now is None else now
        result = CacheSweepResult()
        live = []
        for entry in self.entries():
            if self.max_age_s and now - entry.last_used_at > self.max_age_s:
                self.drop(entry.key)
                result.evicted_age.append(entry.key)
            else:
                live.append(entry)
        live.sort(key=lambda e: e.last_used_at, reverse=True)  # most recently used first
        total, full = 0, False
        for entry in live:
            full = full or bool(self.max_bytes and total + entry.bytes > self.max_bytes)
            if full:  # this one and every less recently used one
                self.drop(entry.key)
                result.evicted_size.append(entry.key)
                continue
            total += entry.bytes
            result.kept += 1
        result.kept_bytes = total
        if result.evicted_age or result.evicted_size:
            log.info("cache sweep: evicted %d by age, %d by size; %d entries (%d bytes) kept",
                     len(result.evicted_age), len(result.evicted_size), result.kept, result.kept_bytes)
        return result


class CacheSweeper(PeriodicTask):
    """`cache.sweep()` every `interval_s` in a daemon thread of the API server (a store outage:
    the next round)."""

    name = "cache-sweeper"

    def __init__(self, cache: ResultCache, interval_s: float) -> None:
        super().__init__(interval_s)
        self.cache = cache

    def tick(self) -> None:
        self.cache.sweep()


def remember_job_result(store: ArtifactStore, settings: Any, record: Any,
                        toolchain: dict[str, Any] | None) -> Remembered | None:
    """Worker side: write the cache entry of a job that just SUCCEEDED, keyed with the toolchain
    that made it (`job_fingerprint` of this worker). Returns what was written (for `forget_job_result`),
    or None when not cached. Never raises: a cache that cannot be written costs later hits, not this job."""
    cache = ResultCache.from_settings(store, settings)
    try:
        spec = record.spec
        calibration = record.calibration
        key = cache.key_for(record.tenant, record.model.sha256, calibration.sha256 if calibration else None, spec,
                            toolchain)
        if key is None or not record.artifacts:
            return None
        return cache.remember(key, tenant=record.tenant, job_id=record.id, model=record.model,
                              calibration=calibration, spec=spec, toolchain=toolchain or {},
                              artifacts=record.artifacts)
    except Exception as exc:
        log.warning("could not write the cache entry of job %s: %s", record.id, exc)
        return None


def forget_job_result(store: ArtifactStore, remembered: Remembered | None) -> None:
    """Worker side: the job remembered did not become SUCCEEDED (cancelled meanwhile)."""
    if remembered is None:
        return
    try:
        ResultCache(store).forget(remembered)
    except Exception as exc:
        log.warning("could not undo the cache entry of job %s: %s", remembered.job_id, exc)
