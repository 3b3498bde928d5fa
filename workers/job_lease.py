"""The lease a worker holds on a job while it runs it (deploy/README.md, "Reliability").

At-least-once delivery hands a job to a second worker when the broker believes the first
is gone (a redelivery after the visibility timeout, a requeue after a soft shutdown). The
lease makes "believes" safe:

- `JobLease`: taken before the job starts, renewed every ttl/4 by a heartbeat thread, which
  also keeps the job's broker message invisible (`on_heartbeat`). A redelivered copy that
  finds the lease held by a live worker raises `LeaseHeld` and is retried later; a lease
  whose holder died expires by itself (or is broken at once when the holder was a process
  on this host that no longer exists: a killed pool child).
- `AttemptFence`: the job store and artifact store as this attempt sees them. Once the
  attempt has started, every record update is fenced on its attempt number, and once the
  lease is lost to another worker nothing more is written at all, so a worker that lost
  its job can neither overwrite the newer attempt's record nor its files.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fxport.jobs import JobRecord, JobStore
from fxport.storage import StorageError

log = logging.getLogger(__name__)

RENEW_RETRY_S = 0.5  # while the store is unreachable: retry soon, so a returning store sees us first


class LeaseHeld(Exception):
    """Another live worker holds the job's lease: this delivery is a duplicate; try later."""

    def __init__(self, job_id: str, holder: str, retry_in_s: float) -> None:
        super().__init__(f"job {job_id} is running on {holder}; retrying this delivery in {retry_in_s:g} s")
        self.job_id, self.holder, self.retry_in_s = job_id, holder, retry_in_s


class LeaseLost(StorageError):
    """This worker's lease went to another worker: the job is theirs now; stop writing. A
    StorageError, so a refused upload takes the paths every store failure takes (none of
    which can write to the record any more: the fence refuses)."""

    code = "lease_lost"


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid").removeprefix("pid:[").rstrip("]")
    except OSError:
        return "-"


def lease_owner_name() -> str:
    """host:pid:pid-namespace:nonce — enough to tell, on the same host, whether the holder lives."""
    return f"{socket.gethostname()}:{os.getpid()}:{_pid_namespace()}:{uuid.uuid4().hex[:8]}"


def holder_is_dead(holder: str) -> bool:
    """True only when certain: the holder was a process of this host and PID namespace that
    no longer exists. A holder elsewhere is presumed alive until its lease expires."""
    try:
        host, pid, pidns, _ = holder.rsplit(":", 3)
        pid_n = int(pid)
    except ValueError:
        return False
    if host != socket.gethostname() or pidns != _pid_namespace() or pid_n == os.getpid():
        return False
    try:
        state = Path(f"/proc/{pid_n}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")  # a zombie ran its last instruction


class JobLease:
    """`with JobLease(jobs, job_id, ttl_s):` — raises LeaseHeld if a live worker has the job."""

    def __init__(self, jobs: JobStore, job_id: str, ttl_s: float, *,
                 on_heartbeat: Callable[[], Any] | None = None, on_lost: Callable[[], Any] | None = None) -> None:
        self.jobs, self.job_id, self.ttl_s = jobs, job_id, float(ttl_s)
        self.owner = lease_owner_name()
        self.on_heartbeat, self.on_lost = on_heartbeat, on_lost
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lease-{job_id}", daemon=True)

    def __enter__(self) -> JobLease:
        holder = self.jobs.acquire_lease(self.job_id, self.owner, self.ttl_s)
        if holder is not None and holder_is_dead(holder) and self.jobs.release_lease(self.job_id, holder):
            log.info("broke the lease of %s: that process is gone", holder)
            holder = self.jobs.acquire_lease(self.job_id, self.owner, self.ttl_s)
        if holder is not None:
            raise LeaseHeld(self.job_id, holder, retry_in_s=max(1.0, self.ttl_s / 2))
        self._beat()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        if not self.lost.is_set():
            try:
                self.jobs.release_lease(self.job_id, self.owner)
            except Exception as err:  # it expires by itself
                log.warning("could not release the job lease: %s", err)

    def _beat(self) -> None:
        if self.on_heartbeat is not None:
            try:
                self.on_heartbeat()
            except Exception as err:
                log.warning("heartbeat hook failed: %s", err)

    def _run(self) -> None:
        wait = self.ttl_s / 4
        while not self._stop.wait(wait):
            try:
                held = self.jobs.renew_lease(self.job_id, self.owner, self.ttl_s)
                if not held:  # expired while the store was away; take it back unless someone else has
                    holder = self.jobs.acquire_lease(self.job_id, self.owner, self.ttl_s)
                    if holder is not None:
                        log.warning("lost the job lease to %s; stopping this attempt", holder)
                        self.lost.set()
                        if self.on_lost is not None:
                            self.on_lost()
                        return
            except Exception as err:
                log.warning("could not renew the job lease (retrying): %s", err)
                wait = RENEW_RETRY_S
                continue
            wait = self.ttl_s / 4
            self._beat()


class AttemptFence:
    """A JobStore (or ArtifactStore) proxy for one attempt: see the module docstring."""

    def __init__(self, target: Any, lease: JobLease) -> None:
        self._target, self._lease = target, lease
        self.attempt: int | None = None

    def _check(self, what: str) -> None:
        if self._lease.lost.is_set():
            raise LeaseLost(f"not writing {what}: another worker took over job {self._lease.job_id}")

    # JobStore
    def transition(self, job_id: str, **changes: Any) -> tuple[JobRecord | None, bool]:
        if self._lease.lost.is_set():
            return self._target.get(job_id), False
        if self.attempt is not None:
            changes.setdefault("expect_attempt", self.attempt)
        rec, changed = self._target.transition(job_id, **changes)
        if changed and changes.get("new_attempt") and rec is not None:
            self.attempt = rec.attempts
        return rec, changed

    # ArtifactStore
    def put_file(self, key: str, *args: Any, **kwargs: Any) -> Any:
        self._check(key)
        return self._target.put_file(key, *args, **kwargs)

    def put_stream(self, key: str, *args: Any, **kwargs: Any) -> Any:
        self._check(key)
        return self._target.put_stream(key, *args, **kwargs)

    def put_snapshot(self, key: str, *args: Any, **kwargs: Any) -> Any:
        self._check(key)
        return self._target.put_snapshot(key, *args, **kwargs)

    def delete_prefix(self, prefix: str) -> int:
        self._check(prefix)
        return self._target.delete_prefix(prefix)

    def delete_object(self, key: str) -> Any:
        self._check(key)
        return self._target.delete_object(key)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target, name)
