"""Which job store a URL names: `open_job_store`."""

from __future__ import annotations

from pathlib import Path

from fxport.jobs.redis_store import RedisJobStore
from fxport.jobs.sqlite_store import SqliteJobStore
from fxport.jobs.store import JobStore


def open_job_store(url: str | None, home: Path, *, retry_s: float = 0.0, events_ttl_s: int | None = None) -> JobStore:
    """`redis://…` → RedisJobStore; None → SQLite under `home`; `sqlite:///path` → that file.
    `retry_s`: RedisJobStore's retry budget for an unreachable Redis; `events_ttl_s`: how long
    its event streams outlive their last event."""
    if url and url.startswith(("redis://", "rediss://", "unix://")):
        return RedisJobStore(url, retry_s=retry_s, events_ttl_s=events_ttl_s)
    if url and url.startswith("sqlite:///"):
        return SqliteJobStore(Path(url[len("sqlite:///") - 1 :]))
    if url:
        raise ValueError(f"job store URL {url!r}: use redis://HOST:PORT/DB or sqlite:///path")
    return SqliteJobStore(Path(home) / "jobs.db")
