"""The spare child: forked ahead of the next job, with a conversion's page faults already taken.

A child forked from the zygote shares the zygote's memory and copies each page the first time it
writes to it. CPython writes to every object it touches (reference counts), so the smallest job
copies ~9,500 pages (37 MiB) as it runs, and ran about twice as slow in the child as in-process
(docs/benchmarks.md, "Sandbox overhead"). The CPU those faults cost is the same whenever they
are taken; what a job waits for is when.

A fork also maps none of the zygote's code: the child faults in again each page of the
libraries it runs. So the zygote learns once which of its pages a conversion writes and which
code pages it maps (`learn_pages`: a probe child runs the smallest job on fxport's own model and
reads /proc/self/pagemap), and keeps one `Spare`: a child forked ahead of the next job that takes
those faults at once (madvise MADV_POPULATE_WRITE, which copies without changing a byte, and
MADV_POPULATE_READ), says it is ready, and blocks for its request. The job that takes it starts
with its faults taken and no fork to wait for; the zygote then forks the next spare while that
job runs. A job that comes while no spare is ready waits for the next
one: a child forked for it alone would take the same faults during the job.

Until its request arrives a spare runs only this module; from then on it is a job's child like
any other (zygote._child: it closes every descriptor it inherited, applies the layers, reports
them). The page list comes from the probe, never from a job's child, and nothing a job's child
does reaches a later spare: each is forked from the zygote, not from a child. While a job runs,
the spare that will run the next one waits beside it unconfined; the job's child cannot reach
it: no ptrace or process_vm_* (seccomp), no /proc/<pid> but its own and no signal outside its
own Landlock domain (tests/security/test_isolation.py tries, from inside a real job).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import signal
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

PAGE = os.sysconf("SC_PAGE_SIZE")
PM_PRESENT, PM_EXCLUSIVE = 1 << 63, 1 << 56  # /proc/pid/pagemap: mapped by this process alone (Linux 4.2+)
MADV_POPULATE_READ, MADV_POPULATE_WRITE = 22, 23  # Linux 5.14+; where refused, a spare only saves the fork

# How long a job waits for a spare to be ready (writing its pages takes tens of milliseconds;
# a child forked without them would take the same faults during the job). A spare not ready by
# then is killed and another forked; after MAX_FAILURES in a row, spares are turned off. All of
# it stays well within the 30 s the worker waits for the zygote to start a job (launch.py).
READY_WAIT_S = 5.0
MAX_FAILURES = 3

Runs = list[tuple[int, int]]  # (start address, bytes)


def mapped_ranges(maps: str = "/proc/self/maps") -> tuple[Runs, Runs]:
    """This process's private mappings as (start, end): the writable ones (anonymous memory, the
    heap, libraries' data: what a forked child shares copy-on-write), and the read-only ones
    backed by a file (libraries' code: a child maps again each page it runs)."""
    writable, files = [], []
    with open(maps) as f:
        for line in f:
            fields = line.split()
            perms = fields[1]
            if perms[3] != "p":
                continue
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if perms.startswith("rw"):
                writable.append((lo, hi))
            elif perms[1] == "-" and len(fields) > 5 and fields[5].startswith("/"):
                files.append((lo, hi))
    return writable, files


def exclusive_runs(ranges: Runs, pagemap: str = "/proc/self/pagemap", *, alone: bool = True) -> Runs:
    """(start, bytes) runs of the pages within `ranges` that are present and mapped by this
    process alone: in a forked child, the pages it has written since the fork (copied, or new).
    `alone=False`: every page present (in a child, the file pages it mapped since the fork)."""
    want = PM_PRESENT | (PM_EXCLUSIVE if alone else 0)
    runs: Runs = []
    with open(pagemap, "rb", buffering=0) as f:
        for lo, hi in ranges:
            f.seek(lo // PAGE * 8)
            entries = memoryview(f.read((hi - lo) // PAGE * 8)).cast("Q")
            start = None
            for i, entry in enumerate(entries):
                mine = entry & want == want
                if mine and start is None:
                    start = i
                elif not mine and start is not None:
                    runs.append((lo + start * PAGE, (i - start) * PAGE))
                    start = None
            if start is not None:
                runs.append((lo + start * PAGE, (len(entries) - start) * PAGE))
    return runs


@dataclass(frozen=True)
class Pages:
    """What a conversion touches of the zygote: pages it writes, and file pages (code) it maps."""

    write: Runs
    read: Runs

    @property
    def written_bytes(self) -> int:
        return sum(n for _, n in self.write)


def learn_pages(probe: Callable[[], object]) -> tuple[Pages | None, dict[str, Any]]:
    """Fork a probe child that runs `probe` (a conversion of fxport's own model) and reports the
    zygote's pages it wrote and the file pages it mapped. Returns (them or None when it failed,
    a summary for the log)."""
    started = time.monotonic()
    writable, files = mapped_ranges()

    def learn() -> dict[str, Runs]:
        probe()
        return {"write": exclusive_runs(writable), "read": exclusive_runs(files, alone=False)}

    status, found = in_forked_child(learn)
    seconds = round(time.monotonic() - started, 3)
    if status != 0:
        return None, {"error": f"the probe ended with status {os.waitstatus_to_exitcode(status)}", "seconds": seconds}
    pages = Pages(*([(int(a), int(n)) for a, n in found[kind]] for kind in ("write", "read")))
    return pages, {"pages": pages.written_bytes // PAGE, "mib": round(pages.written_bytes / (1 << 20), 1),
                   "runs": len(pages.write), "code_mib": round(sum(n for _, n in pages.read) / (1 << 20), 1),
                   "seconds": seconds}


def in_forked_child(fn: Callable[[], object]) -> tuple[int, Any]:
    """Run `fn` in a forked child and wait for it: (its wait status, what `fn` returned, through
    JSON; None when it failed, its traceback printed)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(r)
            result = json.dumps(fn()).encode()
            with os.fdopen(w, "wb") as out:
                out.write(result)
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    return status, json.loads(data) if status == 0 else None


def take_faults(pages: Pages) -> int:
    """Take now the faults a conversion would: copy the pages it writes (MADV_POPULATE_WRITE,
    which changes no byte) and map the code it runs (MADV_POPULATE_READ). Returns how many runs
    the kernel refused (a range unmapped since, or a kernel before 5.14)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return (sum(libc.madvise(start, length, MADV_POPULATE_WRITE) != 0 for start, length in pages.write)
            + sum(libc.madvise(start, length, MADV_POPULATE_READ) != 0 for start, length in pages.read))


class Spare:
    """The zygote's one spare child (none while `pages` is None: spares are off).

    While spares are on, every job's child is forked by `ensure`, called from one place in the
    zygote: a child's stack at the fork is part of what it runs with (TorchScript records the
    Python stack of each traced call in the artifact), so a job's artifact is the same whichever
    spare ran it. (With spares off, the zygote forks each job's child from one other line.)"""

    def __init__(self, pages: Pages | None, run_job: Callable[[dict[str, Any], int], NoReturn]) -> None:
        self.pages, self.run_job = pages, run_job
        self.pid: int | None = None
        self.failures = 0
        self._request_w = self._ready_r = -1

    def ensure(self) -> None:
        """Fork the next spare, unless one is waiting (or spares are off)."""
        if self.pages is None or self.pid is not None:
            return
        request_r, request_w = os.pipe()
        ready_r, ready_w = os.pipe()
        zygote = os.getpid()
        pid = os.fork()
        if pid == 0:
            os.close(request_w)
            os.close(ready_r)
            self.run_job(_wait_for_job(zygote, self.pages, request_r, ready_w), zygote)
        os.close(request_r)
        os.close(ready_w)
        self.pid, self._request_w, self._ready_r = pid, request_w, ready_r

    def close(self) -> None:
        """End the waiting spare, if any, and remove its job cgroup (the zygote is exiting)."""
        if self.pid is None:
            return
        pid, self.pid = self.pid, None
        for fd in (self._request_w, self._ready_r):
            with contextlib.suppress(OSError):
                os.close(fd)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
        from fxport.workers.sandbox.confine import release_tasks_bound

        release_tasks_bound(pid)

    def hand(self, request: dict[str, Any]) -> tuple[int, bool] | None:
        """Give `request` to the spare once it is ready: (its pid, whether it was ready before
        the request came). None when it died or never got ready (it is gone then: `ensure`
        forks another)."""
        assert self.pid is not None
        pid, self.pid = self.pid, None
        handed = ahead = False
        try:
            ready = select.poll()
            ready.register(self._ready_r, select.POLLIN)
            ahead = bool(ready.poll(0))
            if (ahead or ready.poll(READY_WAIT_S * 1000)) and os.read(self._ready_r, 1) == b"r":
                os.write(self._request_w, json.dumps(request).encode() + b"\n")
                handed = True
        except OSError:  # it died meanwhile (a broken pipe)
            pass
        finally:
            os.close(self._request_w)
            os.close(self._ready_r)
        if handed:
            self.failures = 0
            return pid, ahead
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(pid, 0)
        from fxport.workers.sandbox.confine import release_tasks_bound

        release_tasks_bound(pid)
        self.failures += 1
        if self.failures >= MAX_FAILURES:
            self.pages = None  # the zygote forks each job's child itself from now on
        return None


def _wait_for_job(zygote: int, pages: Pages, request_r: int, ready_w: int) -> dict[str, Any]:
    """In the spare: write the pages, say so, and block until the zygote sends a request: one
    line, or the pipe closed with none (no job for this spare: it exits)."""
    try:
        from fxport.workers.sandbox.confine import die_with_parent, join_job_cgroup

        die_with_parent(zygote)
        take_faults(pages)
        join_job_cgroup()  # its job's thread bound, ahead of the job (confine.bound_tasks)
        os.write(ready_w, b"r")
        os.close(ready_w)
        data = b""
        while not data.endswith(b"\n"):
            chunk = os.read(request_r, 1 << 16)
            if not chunk:  # the zygote closed it: no job for this spare
                os._exit(0)
            data += chunk
        os.close(request_r)
        return json.loads(data)
    except BaseException:
        os._exit(70)
