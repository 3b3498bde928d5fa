"""Starting sandbox children: forked from a warm zygote (the default), or a fresh interpreter.

Both start from a scrubbed environment (no broker URL, storage keys, tokens or `AWS_*`), and
both are registered by job id while they run, so a cancel or a lost lease kills exactly that
job's child (`kill_job`), found by what this process started, never by what a child says.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("fxport.workers.sandbox")

# Environment the child keeps; everything else (AWS_*, FXPORT_*, REDIS_*, tokens) is dropped.
_KEEP_ENV = ("PATH", "LANG", "LC_ALL", "TZ", "PYTHONHASHSEED",
             # a TensorRT build needs the GPU the worker was given and the libraries its image set up
             "LD_LIBRARY_PATH", "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES",
             "CUDA_MODULE_LOADING")

# How long closing a warm sandbox waits for its zygote to exit on its own before killing it.
CLOSE_WAIT_S = 5.0

# The zygote kills a child this long after its wall-clock limit, should its worker not have
# (a time limit or cancellation that struck while the child was being started).
BACKSTOP_GRACE_S = 10.0

# glibc malloc in the sandbox. A child is a fresh process: with glibc's defaults every
# allocation over 128 KiB is its own mmap, page-faulted in and unmapped again at free, over and
# over through export and verify (a long-lived process raises that threshold as it goes; the
# zygote, warmed on a tiny model, never did). Allocations up to 32 MiB from the heap, freed
# memory kept, the heap grown 64 MiB at a time: a ResNet-18 job's child took 244k page faults
# and 0.82 s of system time before, 135k and 0.58 s after, and ran as fast as in-process
# (docs/benchmarks.md, "Sandbox overhead").
SANDBOX_MALLOC_TUNABLES = ("glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=1073741824:"
                           "glibc.malloc.top_pad=67108864")

# The zygote moves its memory onto 2 MiB pages once warm (zygote.collapse_to_huge_pages):
# a fork then copies, and a child's exit tears down, a few hundred page-table entries instead
# of ~85k. A tiny job's fork, run and exit: see docs/benchmarks.md, "Sandbox overhead".
SANDBOX_HUGE_PAGES = True

# The zygote keeps one child forked ahead of the next job, with the page faults of a conversion
# already taken (sandbox/spare.py): a tiny job's overhead in the sandbox fell by about half
# (docs/benchmarks.md, "Sandbox overhead"). It holds 30-40 MiB of its own while it waits.
SANDBOX_SPARE = True

# libgomp (torch's OpenMP) lets a thread that finds no work spin 300,000 times before it
# sleeps. When another process holds a core, torch's second thread then spins for it while the
# first waits: ResNet-18 at 2 threads ran 1.5x slower than at 1 beside one busy process, and
# 1.1x with this spin count, which costs nothing on idle cores (docs/benchmarks.md, "Threads
# when another process takes a core"). libgomp reads it at start: the zygote's environment.
SANDBOX_GOMP_SPINCOUNT = "10000"

PR_SET_DUMPABLE = 4


def hide_parent_environment() -> None:
    """Make this (the worker) process non-dumpable, so /proc/<pid>/environ — which holds the
    broker URL and storage keys — is no longer readable by a same-user process, should a layer
    of the sandbox be missing."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    except Exception:  # not Linux: nothing to hide this way
        pass


def available_cpus(cgroup_root: Path = Path("/sys/fs/cgroup")) -> int:
    """CPUs this process may use: its affinity mask, capped by a cgroup v2 CPU quota (a
    Kubernetes CPU limit) rounded up. os.cpu_count() would say the node's cores, and torch and
    onnxruntime would start that many threads under a limit of two."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    try:
        quota, period = (cgroup_root / "cpu.max").read_text().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cpus)


def job_threads() -> int:
    """Threads one job's engine may use: FXPORT_SANDBOX_THREADS if set, else this worker's share
    of the CPUs it may use (`available_cpus` over FXPORT_WORKER_CONCURRENCY, the jobs it runs
    at once; `fxport worker -c` sets it). Two jobs at two threads each on two cores run
    slower than at one each: each job's threads wait for the core the other holds."""
    explicit = os.environ.get("FXPORT_SANDBOX_THREADS")
    if explicit:
        return max(1, int(explicit))
    slots = max(1, int(os.environ.get("FXPORT_WORKER_CONCURRENCY") or 1))
    return max(1, available_cpus() // slots)


def scrubbed_env(work: Path | None = None) -> dict[str, str]:
    """The child's whole environment, with its torch and onnxruntime threads (`job_threads()`)."""
    env = {k: os.environ[k] for k in _KEEP_ENV if k in os.environ}
    env.update(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", FXPORT_SANDBOX="1", GLIBC_TUNABLES=SANDBOX_MALLOC_TUNABLES,
               # onnxruntime 1.2x keeps a telemetry database open read-write (~/.cache/Microsoft/...)
               # and probes the machine for it: state every child would share with the zygote
               ORT_DISABLE_TELEMETRY="1",
               OMP_NUM_THREADS=str(job_threads()),
               GOMP_SPINCOUNT=os.environ.get("GOMP_SPINCOUNT") or SANDBOX_GOMP_SPINCOUNT)
    if work is not None:
        env.update(HOME=str(work), TMPDIR=str(work / "tmp"))
    return env


class _ColdLaunch:
    """A fresh interpreter per job: pays `import torch` every time (the fallback)."""

    def __init__(self, request_path: Path, env: dict[str, str], log_path: Path) -> None:
        with log_path.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "fxport.workers.sandbox.child", str(request_path)],
                cwd=request_path.parent, env={**env, "FXPORT_SANDBOX_PARENT": str(os.getpid())},
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )
        self.pid = self.proc.pid
        self.pidfd = _pidfd(self.pid)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError from None

    def kill(self) -> None:
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def alive(self) -> bool:
        return _alive(self.pidfd) if self.pidfd is not None else self.proc.poll() is None

    def close(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None
        if self.proc.poll() is not None:  # reaped: its pids cgroup is empty
            from fxport.workers.sandbox.confine import release_tasks_bound

            release_tasks_bound(self.pid)


class _WarmLaunch:
    def __init__(self, zygote: WarmSandbox, job: int, pid: int, forked_ahead: bool) -> None:
        self.zygote, self.job, self.pid, self.forked_ahead = zygote, job, pid, forked_ahead
        self.pidfd = _pidfd(pid)

    def wait(self, timeout: float) -> int:
        return self.zygote.wait(self.job, timeout)

    def kill(self) -> None:
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.zygote.wait(self.job, 30)
        except TimeoutError:
            pass

    def alive(self) -> bool:
        return self.pidfd is not None and _alive(self.pidfd)

    def close(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


Launch = _ColdLaunch | _WarmLaunch


def _pidfd(pid: int) -> int | None:
    """A handle on the child that stays valid after it exits (so a reused pid is never mistaken
    for it); None where the kernel has no pidfds (before 5.3) or it has gone already."""
    try:
        return os.pidfd_open(pid)
    except (OSError, AttributeError):
        return None


def _alive(pidfd: int) -> bool:
    poll = select.poll()
    poll.register(pidfd, select.POLLIN)  # readable once the process has exited
    return not poll.poll(0)


class WarmSandbox:
    """A warm parent (the zygote) with torch, onnx and the engine imported, forking one child
    per job (docs/architecture.md, "Speed"): a job pays a fork (milliseconds), not an interpreter start and
    `import torch` (seconds). The zygote itself starts with the scrubbed environment, so no
    child can inherit a credential, and it never runs a torch op, so forking is safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[str] | None = None
        self._next = 0
        self._started: dict[int, tuple[threading.Event, list[Any]]] = {}
        self._exited: dict[int, tuple[threading.Event, list[Any]]] = {}
        self.ready: dict[str, Any] = {}  # the zygote's start-up report: its threads, its huge pages

    def _ensure(self) -> subprocess.Popen[str]:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        started = time.monotonic()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "fxport.workers.sandbox.zygote"], cwd="/",
            env={**scrubbed_env(), "FXPORT_SANDBOX_HUGE_PAGES": "1" if SANDBOX_HUGE_PAGES else "0",
                 "FXPORT_SANDBOX_SPARE": "1" if SANDBOX_SPARE else "0"},
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1,
            start_new_session=True,
        )
        ready = self._proc.stdout.readline() if self._proc.stdout else ""
        if '"ready"' not in ready:
            self._proc.kill()
            self._proc = None
            raise RuntimeError("the warm sandbox did not start")
        self.ready = json.loads(ready)
        huge = self.ready.get("huge_pages") or {}
        spare = self.ready.get("spare") or {}
        # "ready in N s": how long a worker's first job waits for its sandbox (tests bound that wait by it)
        log.info("warm sandbox ready in %.2f s (pid %d): %s MiB of its memory on huge pages after %s s of "
                 "collapsing, %s range(s) refused in whole or part; spare children %s",
                 time.monotonic() - started, self._proc.pid, huge.get("huge_mib", 0),
                 huge.get("seconds", 0), huge.get("refused", 0),
                 f"write {spare['mib']} MiB and map {spare['code_mib']} MiB of code ahead of each job "
                 f"(learned in {spare['seconds']} s)" if "mib" in spare
                 else f"off ({spare.get('error', 'FXPORT_SANDBOX_SPARE=0')})")
        threading.Thread(target=self._read, args=(self._proc,), daemon=True).start()
        return self._proc

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            msg = json.loads(line)
            table = self._started if "started" in msg else self._exited
            with self._lock:
                event, box = table.setdefault(msg["job"], (threading.Event(), []))
            box.append(msg.get("started", msg.get("status")))
            if "started" in msg:
                box.append(bool(msg.get("spare")))
            event.set()
        # the zygote died: wake every waiter with a failure status
        with self._lock:
            for table in (self._started, self._exited):
                for event, box in table.values():
                    if not event.is_set():
                        box += [-int(signal.SIGKILL), False]
                        event.set()

    def launch(self, request_path: Path, env: dict[str, str], log_path: Path,
               deadline_s: float | None = None) -> _WarmLaunch:
        """Fork a child for request_path. `deadline_s`: the zygote kills it past this many seconds,
        a backstop for a parent that lost track of it (it normally stops it well before)."""
        with self._lock:
            proc = self._ensure()
            self._next += 1
            job = self._next
            self._started[job] = (threading.Event(), [])
            self._exited[job] = (threading.Event(), [])
            assert proc.stdin is not None
            proc.stdin.write(json.dumps({"job": job, "request": str(request_path), "log": str(log_path),
                                         "env": env, "deadline_s": deadline_s}) + "\n")
            proc.stdin.flush()
        event, box = self._started[job]
        if not event.wait(30) or box[0] < 0:
            raise RuntimeError("the warm sandbox could not fork a job")
        log.debug("job %d runs in child %d, %s", job, box[0],
                  "a spare forked ahead of it" if box[1] else "forked when it came (no spare was ready)")
        return _WarmLaunch(self, job, box[0], box[1])

    def wait(self, job: int, timeout: float) -> int:
        event, box = self._exited[job]
        if not event.wait(timeout):
            raise TimeoutError
        with self._lock:
            self._started.pop(job, None)
            self._exited.pop(job, None)
        return box[0]

    def close(self) -> None:
        """End the zygote: its stdin closed, it ends its spare (and removes the spare's job cgroup)
        and exits; killed if it has not within a few seconds. Children still running die with it."""
        if self._proc is not None:
            with contextlib.suppress(OSError):
                if self._proc.stdin is not None:
                    self._proc.stdin.close()
            try:
                self._proc.wait(timeout=CLOSE_WAIT_S)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None


_warm: WarmSandbox | None = None
_warm_lock = threading.Lock()


def warm_sandbox() -> WarmSandbox:
    global _warm
    with _warm_lock:
        if _warm is None:
            _warm = WarmSandbox()
        return _warm


def prestart() -> None:
    """Start the warm sandbox now (a worker process that just started), so that the first job
    does not wait seconds for `import torch` and the warm-up. A failure here only costs speed:
    the first job tries again."""
    if os.environ.get("FXPORT_SANDBOX_MODE", "warm") != "warm":
        return
    zygote = warm_sandbox()
    try:
        with zygote._lock:
            zygote._ensure()
    except Exception:
        log.warning("could not prestart the warm sandbox", exc_info=True)


def launch(request_path: Path, env: dict[str, str], log_path: Path, deadline_s: float | None = None, *,
           warm: bool | None = None) -> Launch:
    """A child for request_path: forked from the warm zygote unless `warm` is False (or
    FXPORT_SANDBOX_MODE=cold), a fresh interpreter if the zygote cannot fork."""
    if warm is None:
        warm = os.environ.get("FXPORT_SANDBOX_MODE", "warm") == "warm"
    if warm:
        try:
            return warm_sandbox().launch(request_path, env, log_path, deadline_s)
        except (RuntimeError, OSError, ValueError):  # what a failed or dead zygote raises; a
            # time limit or cancellation raised meanwhile (Celery's SoftTimeLimitExceeded is an
            # Exception too) must end the job, not start a cold sandbox that no clock watches
            log.warning("warm sandbox unavailable; starting a cold one", exc_info=True)
    return _ColdLaunch(request_path, env, log_path)


# -- the children running now, by job -----------------------------------------------------

_running: dict[str, set[Any]] = {}
_running_lock = threading.Lock()


def register(job_id: str, child: Launch) -> None:
    with _running_lock:
        _running.setdefault(job_id, set()).add(child)


def unregister(job_id: str, child: Launch) -> None:
    with _running_lock:
        children = _running.get(job_id)
        if children is not None:
            children.discard(child)
            if not children:
                del _running[job_id]


def kill_job(job_id: str) -> int:
    """Kill the sandbox children this process started for `job_id`; returns how many."""
    with _running_lock:
        children = list(_running.get(job_id, ()))
    for child in children:
        try:
            if child.pidfd is not None:  # exactly that process, even if its pid were reused
                signal.pidfd_send_signal(child.pidfd, signal.SIGKILL)
            else:
                os.killpg(child.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError, OSError):
            pass
    return len(children)
