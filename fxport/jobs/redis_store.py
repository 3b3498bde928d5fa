"""The distributed job store: Redis.

A Redis hash per job, a Redis Stream of events per job with ids `0-<seq>` (so the stream id *is*
the event sequence number and `XREAD` from `0-<n>` resumes exactly after event n), a sorted set
per tenant for listing, idempotency keys as plain keys set in the same Lua step that creates the
job. Each multi-key change is one Lua script or one WATCH/MULTI transaction.

redis is imported only when a RedisJobStore is made: the embedded server never needs it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from fxport.jobs.records import (
    IN_FLIGHT_STATES,
    IdempotencyConflict,
    InputAdmission,
    JobEvent,
    JobRecord,
    JobState,
    SharedArtifactsGone,
)
from fxport.jobs.store import JobStore, idempotency_digest, same_request, shared_source
from fxport.jobs.transitions import apply_update, event_for
from fxport.storage.keys import job_prefix

_CREATE_LUA = """
if ARGV[4] ~= '' then
  local existing = redis.call('GET', KEYS[4])
  if existing then return existing end
end
if ARGV[9] == '1' and redis.call('EXISTS', KEYS[6]) == 0 then return false end
if ARGV[4] ~= '' then redis.call('SET', KEYS[4], ARGV[1]) end
redis.call('HSET', KEYS[1], 'record', ARGV[2], 'state', ARGV[3], 'seq', 1)
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[6], '0-1', 'e', ARGV[5])
redis.call('EXPIRE', KEYS[2], ARGV[8])
redis.call('ZADD', KEYS[3], 0, ARGV[1])
if ARGV[7] == '1' then redis.call('SADD', KEYS[5], ARGV[1]) end
if ARGV[9] == '1' then redis.call('SADD', KEYS[7], ARGV[1]) end
return ARGV[1]
"""

# KEYS: 1 job, 2 events, 3 tenant's jobs, 4 in-flight, 5 running, 6 lease, 7 heartbeat,
# 8 idempotency key (or a placeholder), 9 jobs sharing this one's artifacts, 10 the deletion
# queue, 11 the source job (or a placeholder), 12 jobs sharing the source's artifacts.
# ARGV: 1 job id, 2 its artifact prefix, 3 '1' when it shares a source's artifacts, 4 the
# source's prefix.
_REMOVE_LUA = """
local state = redis.call('HGET', KEYS[1], 'state')
if not state then
  redis.call('ZREM', KEYS[3], ARGV[1])
  return 0
end
if state == 'QUEUED' or state == 'RUNNING' then return -1 end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[6], KEYS[7])
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('SREM', KEYS[4], ARGV[1])
redis.call('SREM', KEYS[5], ARGV[1])
if redis.call('GET', KEYS[8]) == ARGV[1] then redis.call('DEL', KEYS[8]) end
if redis.call('SCARD', KEYS[9]) == 0 then redis.call('RPUSH', KEYS[10], ARGV[2]) end
if ARGV[3] == '1' then
  redis.call('SREM', KEYS[12], ARGV[1])
  if redis.call('SCARD', KEYS[12]) == 0 and redis.call('EXISTS', KEYS[11]) == 0 then
    redis.call('RPUSH', KEYS[10], ARGV[4])
  end
end
return 1
"""


# KEYS: 1 the tenant's inputs (sha256 -> keep_until), 2 their sizes, 3 their total bytes.
# ARGV: 1 sha256, 2 size, 3 keep_until, 4 quota (0 = none).
_RESERVE_INPUT_LUA = """
local old = redis.call('ZSCORE', KEYS[1], ARGV[1])
local used = tonumber(redis.call('GET', KEYS[3]) or '0')
if old then
  if tonumber(ARGV[3]) > tonumber(old) then redis.call('ZADD', KEYS[1], ARGV[3], ARGV[1]) end
  return {1, used}
end
local quota = tonumber(ARGV[4])
if quota > 0 and used + tonumber(ARGV[2]) > quota then return {0, used} end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
return {1, redis.call('INCRBY', KEYS[3], ARGV[2])}
"""

# KEYS as _RESERVE_INPUT_LUA's. ARGV: 1 sha256, 2 now.
_FORGET_INPUT_LUA = """
local keep = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not keep or tonumber(keep) >= tonumber(ARGV[2]) then return -1 end
local size = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0')
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('DECRBY', KEYS[3], size)
return size
"""


_ACQUIRE_LEASE_LUA = """
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then return holder end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
local t = redis.call('TIME')
redis.call('SET', KEYS[2], t[1] .. '.' .. string.format('%06d', t[2]), 'EX', ARGV[3])
return false
"""

_RENEW_LEASE_LUA = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
local t = redis.call('TIME')
redis.call('SET', KEYS[2], t[1] .. '.' .. string.format('%06d', t[2]), 'EX', ARGV[3])
return 1
"""

_RELEASE_LEASE_LUA = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
return redis.call('DEL', KEYS[1])
"""


class RedisJobStore(JobStore):
    # A job's event stream: at most ~EVENTS_MAXLEN events (each message ≤ 500 characters: the
    # sandbox's events are checked and cut, workers/sandbox/events.py), expiring events_ttl_s
    # after the last one, so no job can grow Redis without bound.
    EVENTS_MAXLEN = 2_000
    EVENTS_TTL_S = 7 * 24 * 3600
    HEARTBEAT_KEEP_S = 7 * 24 * 3600

    def __init__(self, url: str, *, namespace: str = "fxport", retry_s: float = 0.0,
                 events_ttl_s: int | None = None) -> None:
        """`retry_s`: how long a command keeps retrying (backoff up to 1 s) while Redis is
        unreachable or still replaying its AOF. Workers ride out a broker restart this way;
        the API keeps it short and answers UNAVAILABLE instead (service/status.py)."""
        self.events_ttl_s = int(events_ttl_s or self.EVENTS_TTL_S)
        import redis

        from fxport.jobs.redis_retry import DeadlineRetry

        self._redis_mod = redis
        self.url = url
        self.ns = namespace
        # decode_responses=True: every reply is str, which redis-py's annotations (bytes | str) cannot say
        self.r: Any = redis.Redis.from_url(
            url, decode_responses=True, health_check_interval=30, socket_keepalive=True,
            retry_on_timeout=True, socket_connect_timeout=5,
            retry=DeadlineRetry(retry_s, (redis.ConnectionError, redis.TimeoutError, TimeoutError)),
        )
        self._create = self.r.register_script(_CREATE_LUA)
        self._acquire = self.r.register_script(_ACQUIRE_LEASE_LUA)
        self._renew = self.r.register_script(_RENEW_LEASE_LUA)
        self._release = self.r.register_script(_RELEASE_LEASE_LUA)
        self._remove = self.r.register_script(_REMOVE_LUA)
        self._reserve_input = self.r.register_script(_RESERVE_INPUT_LUA)
        self._forget_input = self.r.register_script(_FORGET_INPUT_LUA)

    def _job(self, job_id: str) -> str:
        return f"{self.ns}:job:{job_id}"

    # Outside the `{ns}:job:*` pattern that ids_in_states scans.
    def _lease(self, job_id: str) -> str:
        return f"{self.ns}:lease:{job_id}"

    def _heartbeat(self, job_id: str) -> str:
        return f"{self.ns}:heartbeat:{job_id}"

    def _running(self) -> str:
        return f"{self.ns}:running"

    def _events(self, job_id: str) -> str:
        return f"{self.ns}:job:{job_id}:events"

    def _tenant_jobs(self, tenant: str) -> str:
        return f"{self.ns}:tenant:{tenant}:jobs"

    def _in_flight(self, tenant: str) -> str:
        return f"{self.ns}:tenant:{tenant}:in-flight"

    def _idem(self, tenant: str, key: str) -> str:
        return f"{self.ns}:idem:{tenant}:{idempotency_digest(key)}"

    def _shares(self, job_id: str) -> str:
        return f"{self.ns}:shares:{job_id}"

    def _deletions(self) -> str:
        return f"{self.ns}:artifact-deletions"

    def _inputs(self, tenant: str) -> list[str]:
        head = f"{self.ns}:tenant:{tenant}"
        return [f"{head}:inputs", f"{head}:input-sizes", f"{head}:input-bytes"]

    def create(self, record: JobRecord) -> tuple[JobRecord, bool]:
        rec = record.model_copy(update={"last_seq": 1})
        idem = rec.idempotency_key or ""
        source = rec.artifacts_of or ""
        job_id = self._create(
            keys=[self._job(rec.id), self._events(rec.id), self._tenant_jobs(rec.tenant),
                  self._idem(rec.tenant, idem) if idem else f"{self.ns}:noidem", self._in_flight(rec.tenant),
                  self._job(source) if source else f"{self.ns}:nosource",
                  self._shares(source) if source else f"{self.ns}:nosource"],
            args=[rec.id, rec.model_dump_json(), rec.state.value, idem,
                  event_for(rec, 1).model_dump_json(), self.EVENTS_MAXLEN,
                  "1" if rec.state in IN_FLIGHT_STATES else "0", self.events_ttl_s, "1" if source else "0"],
        )
        if job_id is None:
            raise SharedArtifactsGone(f"job {source} was removed")
        if job_id == rec.id:
            return rec, True
        existing = self.get(job_id)
        if existing is None:  # the key outlived its job; should not happen, but don't fail the submit
            self.r.delete(self._idem(rec.tenant, idem))
            return self.create(record)
        if not same_request(existing, rec):
            raise IdempotencyConflict(existing)
        return existing, False

    def get(self, job_id: str) -> JobRecord | None:
        raw = self.r.hget(self._job(job_id), "record")
        return JobRecord.from_json(raw) if raw else None

    def _raw_many(self, ids: list[str]) -> list[str | None]:
        with self.r.pipeline(transaction=False) as pipe:
            for job_id in ids:
                pipe.hget(self._job(job_id), "record")
            raws: list[str | None] = pipe.execute()
        return raws

    def find_idempotent(self, tenant: str, key: str) -> JobRecord | None:
        job_id = self.r.get(self._idem(tenant, key))
        return self.get(job_id) if job_id else None

    def transition(self, job_id: str, **changes: Any) -> tuple[JobRecord | None, bool]:
        key = self._job(job_id)
        with self.r.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(key)
                    raw = pipe.hget(key, "record")
                    if not raw:
                        pipe.unwatch()
                        return None, False
                    rec = JobRecord.from_json(raw)
                    new = apply_update(rec, **changes)
                    if new is None:
                        pipe.unwatch()
                        return rec, False
                    new.last_seq = rec.last_seq + 1
                    pipe.multi()
                    pipe.hset(key, mapping={"record": new.model_dump_json(), "state": new.state.value,
                                            "seq": new.last_seq})
                    event = event_for(new, new.last_seq, changes.get("staged"))
                    pipe.xadd(self._events(job_id), {"e": event.model_dump_json()},
                              id=f"0-{new.last_seq}", maxlen=self.EVENTS_MAXLEN, approximate=True)
                    pipe.expire(self._events(job_id), self.events_ttl_s)
                    if new.state is JobState.RUNNING:
                        pipe.sadd(self._running(), job_id)
                    elif rec.state is JobState.RUNNING:
                        pipe.srem(self._running(), job_id)
                    # Added on every in-flight write, not only on entering: a job created before
                    # the index existed is counted from its next update on.
                    if new.state in IN_FLIGHT_STATES:
                        pipe.sadd(self._in_flight(new.tenant), job_id)
                    else:
                        pipe.srem(self._in_flight(new.tenant), job_id)
                    pipe.execute()
                    return new, True
                except self._redis_mod.WatchError:
                    continue

    def read_events(self, job_id: str, after_seq: int = 0, timeout: float = 0.0) -> list[JobEvent]:
        stream = self._events(job_id)
        if timeout > 0:
            resp = self.r.xread({stream: f"0-{int(after_seq)}"}, count=500, block=max(1, int(timeout * 1000)))
            entries = resp[0][1] if resp else []
        else:
            entries = self.r.xrange(stream, min=f"(0-{int(after_seq)}", count=500)
        return [JobEvent.model_validate_json(fields["e"]) for _, fields in entries]

    def _ids_desc(self, tenant: str, before: str | None, limit: int) -> list[str]:
        hi = f"({before}" if before else "+"
        ids: list[str] = self.r.zrevrangebylex(self._tenant_jobs(tenant), hi, "-", start=0, num=limit)
        return ids

    def ids_in_states(self, states: Iterable[JobState]) -> list[str]:
        wanted = {s.value for s in states}
        out = []
        for key in self.r.scan_iter(match=f"{self.ns}:job:*", count=500):
            if key.endswith(":events"):
                continue
            if self.r.hget(key, "state") in wanted:
                out.append(key.rsplit(":", 1)[1])
        return out

    def running_ids(self) -> list[str]:
        # An index kept by `transition`, so a sweep does not scan every job ever run.
        return sorted(self.r.smembers(self._running()))

    def count_in_flight(self, tenant: str, *, exact: bool = False) -> int:
        key = self._in_flight(tenant)
        if not exact:
            return int(self.r.scard(key))
        ids = sorted(self.r.smembers(key))
        with self.r.pipeline(transaction=False) as pipe:
            for job_id in ids:
                pipe.hget(self._job(job_id), "state")
            states = pipe.execute()
        wanted = {s.value for s in IN_FLIGHT_STATES}
        stale = [job_id for job_id, state in zip(ids, states) if state not in wanted]
        for job_id in stale:  # only if it is still stale: a transition may have re-added it meanwhile
            with self.r.pipeline() as pipe:
                try:
                    pipe.watch(self._job(job_id))
                    if pipe.hget(self._job(job_id), "state") not in wanted:
                        pipe.multi()
                        pipe.srem(key, job_id)
                        pipe.execute()
                except self._redis_mod.WatchError:
                    pass
        return len(ids) - len(stale)

    def tenants(self) -> list[str]:
        head, tail = f"{self.ns}:tenant:", ":jobs"
        return sorted({key[len(head):-len(tail)] for key in self.r.scan_iter(match=f"{head}*{tail}", count=500)})

    def ids_asc(self, tenant: str, after: str | None, limit: int) -> list[str]:
        lo = f"({after}" if after else "-"
        ids: list[str] = self.r.zrangebylex(self._tenant_jobs(tenant), lo, "+", start=0, num=limit)
        return ids

    def count_jobs(self, tenant: str) -> int:
        return int(self.r.zcard(self._tenant_jobs(tenant)))

    def remove(self, job_id: str, tenant: str | None = None) -> bool | None:
        rec = self.get(job_id)
        if rec is None:
            if tenant is not None:
                self.r.zrem(self._tenant_jobs(tenant), job_id)
            return None
        idem = rec.idempotency_key or ""
        source = shared_source(rec)
        done = self._remove(
            keys=[self._job(job_id), self._events(job_id), self._tenant_jobs(rec.tenant),
                  self._in_flight(rec.tenant), self._running(), self._lease(job_id), self._heartbeat(job_id),
                  self._idem(rec.tenant, idem) if idem else f"{self.ns}:noidem", self._shares(job_id),
                  self._deletions(), self._job(source[0]) if source else f"{self.ns}:nosource",
                  self._shares(source[0]) if source else f"{self.ns}:nosource"],
            args=[job_id, job_prefix(rec.tenant, job_id), "1" if source else "0", source[1] if source else ""],
        )
        return {1: True, -1: False}.get(int(done))

    def pending_deletions(self, limit: int = 100) -> list[str]:
        prefixes: list[str] = self.r.lrange(self._deletions(), 0, max(1, limit) - 1)
        return prefixes

    def deletion_done(self, prefix: str) -> None:
        self.r.lrem(self._deletions(), 0, prefix)

    def reserve_input(self, tenant: str, sha256: str, size: int, keep_until: float, quota: int) -> InputAdmission:
        admitted, used = self._reserve_input(keys=self._inputs(tenant),
                                             args=[sha256, int(size), repr(float(keep_until)), int(quota)])
        return InputAdmission(bool(admitted), int(used))

    def input_bytes(self, tenant: str) -> int:
        return int(self.r.get(self._inputs(tenant)[2]) or 0)

    def input_tenants(self) -> list[str]:
        head, tail = f"{self.ns}:tenant:", ":inputs"
        return sorted({key[len(head):-len(tail)] for key in self.r.scan_iter(match=f"{head}*{tail}", count=500)})

    def inputs_due(self, tenant: str, now: float, limit: int) -> list[str]:
        due: list[str] = self.r.zrangebyscore(self._inputs(tenant)[0], "-inf", f"({now!r}", start=0, num=limit)
        return due

    def forget_input(self, tenant: str, sha256: str, now: float) -> int | None:
        size = int(self._forget_input(keys=self._inputs(tenant), args=[sha256, repr(float(now))]))
        return None if size < 0 else size

    def _in_flight_ids(self, tenant: str) -> list[str]:
        return sorted(self.r.smembers(self._in_flight(tenant)))

    def acquire_lease(self, job_id: str, owner: str, ttl_s: float) -> str | None:
        holder = self._acquire(keys=[self._lease(job_id), self._heartbeat(job_id)],
                               args=[owner, max(1, int(ttl_s * 1000)), self.HEARTBEAT_KEEP_S])
        return holder or None

    def renew_lease(self, job_id: str, owner: str, ttl_s: float) -> bool:
        return bool(self._renew(keys=[self._lease(job_id), self._heartbeat(job_id)],
                                args=[owner, max(1, int(ttl_s * 1000)), self.HEARTBEAT_KEEP_S]))

    def release_lease(self, job_id: str, owner: str) -> bool:
        return bool(self._release(keys=[self._lease(job_id)], args=[owner]))

    def lease_holder(self, job_id: str) -> str | None:
        holder: str | None = self.r.get(self._lease(job_id))
        return holder

    def last_heartbeat(self, job_id: str) -> float | None:
        raw = self.r.get(self._heartbeat(job_id))
        return float(raw) if raw else None

    def clock(self) -> float:
        sec: int
        usec: int
        sec, usec = self.r.time()
        return sec + usec / 1e6

    def close(self) -> None:
        self.r.close()
