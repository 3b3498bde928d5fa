"""The shared job store, tried as an attacker would: a tenant submitting and cancelling in a loop.

Every job leaves a record in Redis, which holds everything in memory; each record carries its
spec, labels included (up to 32 of 256 characters). Before retention, records were kept for
good, so a tenant looping over SubmitJob and CancelJob (each cancel frees its in-flight slot at
once) grew Redis without bound, until it ran out of memory and every tenant's jobs stopped with
it. Now a tenant past FXPORT_MAX_FINISHED_JOBS_PER_TENANT wakes the retention sweep, which
removes its oldest finished jobs: never another tenant's, never a job in flight.

The server is the real API on a loopback port with the real Redis (a database of its own, emptied
first, since the sweep covers every tenant in it) and no worker on its queue, so jobs stay QUEUED
until cancelled. Its periodic sweep is an hour apart: only the wake-up can keep the count."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from fxport.client import Client
from fxport.client.errors import JobNotFound
from fxport.config import Settings
from fxport.jobs import RedisJobStore
from fxport.service.auth import new_token, token_entry
from fxport.service.server import create_server
from tests.fixtures.servers import scaled, wait_until

KEEP = 4
LOOPS = 12
REDIS_DB = 13
# The largest labels a spec may carry (32 of 256 characters): what an attacker would send to grow the store fastest.
SPEC = {"targets": ["onnx"], "labels": {f"pad{i}": "x" * 256 for i in range(32)}}


@dataclass
class RetentionServer:
    address: str
    tokens: dict[str, str]
    model: Path
    jobs: RedisJobStore

    def client(self, tenant: str) -> Client:
        return Client(self.address, token=self.tokens[tenant])


@pytest.fixture()
def server(redis_server, tmp_path) -> Iterator[RetentionServer]:
    tokens = {t: new_token() for t in ("alice", "bob")}
    (tmp_path / "tokens").write_text("".join(token_entry(t, tok) + "\n" for t, tok in tokens.items()))
    url = redis_server.url.rsplit("/", 1)[0] + f"/{REDIS_DB}"
    jobs = RedisJobStore(url)
    jobs.r.flushdb()
    settings = Settings(home=tmp_path / "home", listen="127.0.0.1:0", broker_url=url,
                        store=f"file://{tmp_path / 'store'}", tokens_file=tmp_path / "tokens",
                        max_finished_jobs_per_tenant=KEEP, retention_sweep_interval_s=3600, log_format="text")
    srv, port = create_server(settings)
    srv.start()
    model = tmp_path / "model.pt2"
    model.write_bytes(b"bytes the worker would look at; no worker listens here")
    try:
        yield RetentionServer(f"127.0.0.1:{port}", tokens, model, jobs)
    finally:
        srv.stop(grace=0)
        jobs.close()


def _removed(reason: str) -> float:
    return REGISTRY.get_sample_value("fxport_jobs_removed_total", {"reason": reason}) or 0.0


def test_a_submit_and_cancel_loop_cannot_grow_the_job_store_past_the_tenants_limit(server):
    assert len(json.dumps(SPEC)) > 8000
    removed_before = _removed("count")
    with server.client("alice") as alice, server.client("bob") as bob:
        bobs = [bob.submit(server.model, SPEC) for _ in range(2)]
        bob.cancel(bobs[0].id)
        in_flight = alice.submit(server.model, SPEC)  # alice's oldest job, still QUEUED
        cancelled = []
        for _ in range(LOOPS):
            job = alice.submit(server.model, SPEC)
            alice.cancel(job.id)
            cancelled.append(job.id)

        # the submit that passed the limit woke the sweep: alice is back at her limit
        wait_until(lambda: server.jobs.count_jobs("alice") <= KEEP, scaled(30),
                   "alice's job records back at FXPORT_MAX_FINISHED_JOBS_PER_TENANT")
        # counted as the sweep goes (the count can drop a moment before the counter rises)
        wait_until(lambda: _removed("count") - removed_before >= LOOPS + 1 - KEEP, scaled(10), "the removals counted")
        assert _removed("count") - removed_before == LOOPS + 1 - KEEP
        kept = [j.id for j in alice.list().jobs]
        assert kept == [*reversed(cancelled[-(KEEP - 1):]), in_flight.id], kept
        with pytest.raises(JobNotFound) as info:
            alice.get(cancelled[0])
        assert "FXPORT_MAX_FINISHED_JOBS_PER_TENANT" in str(info.value), info.value
        assert alice.get(in_flight.id).state == "QUEUED"
        # nothing of a removed job is left in Redis
        leftover = [k for k in server.jobs.r.scan_iter(match="fxport:*") if cancelled[0] in k]
        assert leftover == []

        # bob, below the limit, lost nothing: neither his finished job nor his queued one
        assert sorted(j.id for j in bob.list().jobs) == sorted(j.id for j in bobs)
        assert [bob.get(j.id).state for j in bobs] == ["CANCELLED", "QUEUED"]
