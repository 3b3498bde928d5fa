"""The warm sandbox parent: imports the ML stack once, then forks one child per job.

Protocol (JSON lines): stdin `{"job", "request", "log", "env", "deadline_s"}`; stdout
`{"job", "started": pid, "spare": whether its child was forked and ready before the job came
(sandbox/spare.py)}` then `{"job", "status": exit code or -signal}`. A child still running
`deadline_s` after its fork is killed (a backstop: its worker normally stops it first).
It is started with the scrubbed environment and never runs a torch op itself, so its children
inherit no credentials and no busy thread pool. It also keeps no state a child could share
with the next job's child: no writable shared memory (tqdm's lock is a thread lock here, not a
POSIX semaphore in /dev/shm), no file open for writing (onnxruntime's telemetry database is
off); each child closes every descriptor it did not open and checks both before the model
runs (sandbox/child.py), so a library that starts keeping such state fails the jobs closed.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import platform
import select
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from fxport.workers.sandbox.spare import Spare

_out_lock = threading.Lock()
PARENT = os.getppid()


def _say(msg: dict) -> None:
    with _out_lock:
        sys.stdout.write(json.dumps(msg) + "\n")
        sys.stdout.flush()


def _child(req: dict, zygote: int) -> NoReturn:
    """In the forked child: never returns."""
    code = 70
    try:
        from fxport.workers.sandbox.confine import die_with_parent

        die_with_parent(zygote)
        os.setsid()
        log = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # the zygote's pipes and whatever its libraries opened
        os.chdir(os.path.dirname(req["request"]))
        os.environ.clear()
        os.environ.update(req["env"])
        tempfile.tempdir = None  # re-read TMPDIR: the job's private temp dir
        from fxport.workers.sandbox.child import run_request

        code = run_request(req["request"])
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _reap(job: int, pid: int, deadline_s: float | None) -> None:
    if deadline_s:
        _kill_past(pid, deadline_s)
    _, status = os.waitpid(pid, 0)
    _say({"job": job, "status": os.waitstatus_to_exitcode(status)})
    from fxport.workers.sandbox.confine import release_tasks_bound

    release_tasks_bound(pid)  # the child's pids cgroup, empty now; after the status: off the job's path


def _kill_past(pid: int, deadline_s: float) -> None:
    """Kill the child's process group if it is still running `deadline_s` from now: the worker
    stops a child at its wall-clock limit, but a time limit or a cancel that struck in the
    worker while the child was being started leaves no one else to."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:  # already gone, or a kernel without pidfds (before 5.3)
        return
    try:
        exited = select.poll()  # readable once the child has exited
        exited.register(fd, select.POLLIN)
        if not exited.poll(deadline_s * 1000):
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    finally:
        os.close(fd)


def warm_up() -> None:
    """Pay every first-call cost once, here, instead of in every job.

    torch.export.load imports ~1300 modules on first use (sympy, dynamo, serde) and the ONNX
    exporter builds its op registry on first export: ~2.4 s per job if left to the children
    (measured, bench/bench_sandbox.py). The warm-up runs single-threaded: a parent that ran a
    multithreaded op before forking can leave children hanging in torch's thread pool.
    """
    import warnings

    import torch

    from fxport.workers.engine.warm_caches import cache_onnx_registry, cache_pt2_type_hints

    torch.set_num_threads(1)
    cache_onnx_registry()  # built below once, and inherited by every child
    cache_pt2_type_hints()
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = torch.nn.Sequential(torch.nn.Linear(4, 2)).eval()
        args = (torch.zeros(2, 4),)
        batch = torch.export.Dim("batch", min=1, max=8)
        ep = torch.export.export(model, args, dynamic_shapes=({0: batch},))
        torch.export.save(ep, os.path.join(tmp, "w.pt2"))
        loaded = torch.export.load(os.path.join(tmp, "w.pt2"))
        gm = torch.fx.symbolic_trace(loaded.module())
        torch.onnx.export(gm, args, os.path.join(tmp, "w.onnx"), dynamo=True, dynamic_shapes=({0: batch},),
                          external_data=False, verbose=False)
        if os.getppid() != PARENT:  # the worker that started us is gone: skip the long part
            sys.exit(0)
        _warm_up_engine(torch, tmp)


def _warm_up_engine(torch: Any, tmp: str) -> None:
    """One whole conversion of a small conv net (the layer kinds of a ResNet) through the
    engine, every CPU target, verification included: the first use of each exporter, pass,
    runner and operator costs a child ~1 s of a ResNet-18 job otherwise (per-process caches
    and registries that every fork would rebuild). Single-threaded; the onnxruntime sessions
    it opens are closed again (their threads end with them), so the zygote forks with one thread."""
    from pathlib import Path

    from torch import nn  # the module `torch` is: imported by name so that it can be subclassed below

    from fxport.spec import parse_spec
    from fxport.workers.engine.pipeline import convert

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1, self.bn1 = nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)
            self.conv2, self.bn2 = nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)
            self.relu = nn.ReLU(inplace=True)

        def forward(self, x: Any) -> Any:
            return self.relu(self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x))))) + x)

    net = nn.Sequential(nn.Conv2d(3, 4, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
                        nn.MaxPool2d(3, stride=2, padding=1), Block(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                        nn.Dropout(0.1), nn.Linear(4, 3)).eval()
    example = (torch.randn(2, 3, 16, 16),)
    dim = torch.export.Dim("batch", min=1, max=4)
    path = Path(tmp) / "warm.pt2"
    torch.export.save(torch.export.export(net, example, dynamic_shapes=({0: dim},)), path)
    spec = parse_spec({"targets": ["torchscript", "onnx", "exported_program", "fx_source"], "verify": {"samples": 1}})
    convert(path, spec, Path(tmp) / "warm-out", job_id="warm-up")


HUGE_PAGE = 2 << 20
MADV_COLLAPSE = 25  # Linux 6.1+


def collapse_to_huge_pages(maps: str = "/proc/self/maps") -> dict[str, float]:
    """Back this process's private anonymous memory (the heap and Python's arenas: the
    imported ML stack, ~0.3 GB) with 2 MiB pages, synchronously (madvise MADV_COLLAPSE).

    Every fork copies the parent's page tables and every child's exit tears its copy down:
    with 4 KiB pages that is ~85k entries each way, a large part of a tiny job's cost in the
    sandbox (docs/benchmarks.md, "Sandbox overhead"). With 2 MiB pages it is a few hundred. A
    child writing to a shared huge page splits only that mapping and copies the 4 KiB it wrote,
    as before. Measured with transparent_hugepage `madvise` (the usual default); where the
    kernel refuses (older than 6.1, THP off, no huge page free) this process keeps its small
    pages: a speed-up lost, nothing else."""
    started = time.monotonic()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    done: dict[str, float] = {"ranges": 0, "collapsed_mib": 0, "refused": 0}
    try:
        with open(maps) as f:
            lines = f.readlines()
    except OSError:
        return done
    for line in lines:
        fields = line.split()
        perms = fields[1]
        # Anonymous (no path, or the brk heap) and private-writable: what a fork copies and a
        # child may write.
        if (len(fields) > 5 and fields[5] != "[heap]") or not perms.startswith("rw") or perms[3] != "p":
            continue
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        lo, hi = -(-lo // HUGE_PAGE) * HUGE_PAGE, hi // HUGE_PAGE * HUGE_PAGE
        if hi <= lo:
            continue
        done["ranges"] += 1
        if libc.madvise(lo, hi - lo, MADV_COLLAPSE) == 0:
            done["collapsed_mib"] += (hi - lo) >> 20
        else:
            done["refused"] += 1
    # A refused range may still be collapsed in part (the kernel goes huge page by huge page and
    # reports the first failure): what the process holds on huge pages in the end is the figure.
    done["huge_mib"] = _anon_huge_pages_mib()
    done["seconds"] = round(time.monotonic() - started, 3)
    return done


def _anon_huge_pages_mib() -> int:
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) >> 10
    except (OSError, ValueError, IndexError):
        pass
    return 0


def probe_job(tmp: str) -> Callable[[], object]:
    """The smallest job a worker runs (a Linear layer to TorchScript, verified), its model saved
    here: what the returned conversion writes, every job's child writes (sandbox/spare.py)."""
    from pathlib import Path

    import torch

    from fxport.spec import parse_spec
    from fxport.workers.engine.pipeline import convert

    net = torch.nn.Sequential(torch.nn.Linear(8, 4)).eval()
    dim = torch.export.Dim("batch", min=1, max=4)
    model = Path(tmp) / "probe.pt2"
    torch.export.save(torch.export.export(net, (torch.zeros(2, 8),), dynamic_shapes=({0: dim},)), model)
    spec = parse_spec({"inputs": [{"name": "input", "shape": ["batch", 8], "dtype": "float32"}],
                       "dynamic_dims": {"batch": {"min": 1, "opt": 2, "max": 4}},
                       "targets": ["torchscript"], "verify": {"samples": 2}})
    return lambda: convert(model, spec, Path(tmp) / "out", job_id="probe")


def main() -> None:
    # onnxruntime's telemetry keeps a database open read-write in $HOME: never in the zygote.
    os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")
    _import_what_jobs_need()
    try:
        warm_up()
    except Exception:  # a failed warm-up only costs speed
        traceback.print_exc()
    spare, ready = _settle()
    _say(ready)
    _serve(spare)


def _import_what_jobs_need() -> None:
    """Import everything a job needs once; forked children share these pages copy-on-write."""
    import logging

    import onnx  # noqa: F401
    import onnxruntime  # noqa: F401
    import torch  # noqa: F401

    import fxport.workers.engine.pipeline  # noqa: F401
    import fxport.workers.sandbox.child  # noqa: F401
    from fxport.workers.sandbox.confine import _ARCHES, python_read_paths, release_stale_task_bounds, seccomp_template

    python_read_paths()  # what every child's Landlock rules grant: made once here
    if platform.machine() in _ARCHES:
        seccomp_template()  # each child puts its own pid in (confine.seccomp_program)
    release_stale_task_bounds()  # job cgroups a killed worker's children left
    from fxport.workers.engine.exporters import exported_program, fx_source, torchscript  # noqa: F401

    # The int8 stage's Q/DQ op library (torch.ops.quantized_decomposed), loaded before the warm-up
    # builds the ONNX exporter's registry: that registry then knows the ops an int8 job exports, so
    # an int8 job's child finds it built (the registry is keyed on the ops torch knows, warm_caches).
    from fxport.workers.engine.quantize import int8  # noqa: F401
    from fxport.workers.engine.verify import runners  # noqa: F401

    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    try:
        import tqdm

        # The ONNX exporter's progress bars start tqdm's monitor thread: no thread to fork past.
        tqdm.tqdm.monitor_interval = 0
        # And their first bar makes a multiprocessing lock, a POSIX semaphore in /dev/shm that
        # every forked child would share: one job holding it would hang the next job's export.
        tqdm.tqdm.set_lock(threading.RLock())
    except ImportError:
        pass


def _settle() -> tuple[Spare, dict[str, Any]]:
    """After the warm-up: freeze the heap, move it to huge pages, learn the pages a job's child
    writes (the spares). Returns the Spare and the zygote's `ready` message."""
    from fxport.workers.sandbox.spare import Pages, Spare, learn_pages

    # Everything imported and warmed up so far goes to the collector's permanent generation: a
    # child's collections then never walk (and so never write to, copying page after page) the
    # zygote's objects. Measured on a tiny job: see bench/bench_sandbox.py.
    gc.collect()
    gc.freeze()
    huge = collapse_to_huge_pages() if os.environ.get("FXPORT_SANDBOX_HUGE_PAGES", "1") != "0" else {}
    pages: Pages | None = None
    learned: dict[str, Any] = {}
    if os.environ.get("FXPORT_SANDBOX_SPARE", "1") != "0":
        with tempfile.TemporaryDirectory() as tmp:
            pages, learned = learn_pages(probe_job(tmp))
    spare = Spare(pages, _child)
    # Threads the imports start (torch's and onnxruntime's own) stay idle; a fork copies only this one.
    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1
    return spare, {"ready": True, "threads": threads, "huge_pages": huge, "spare": learned}


def _serve(spare: Spare) -> None:
    """One child per job request read from stdin, until the worker closes our stdin (it ended, or
    closed the sandbox): then this process exits, and every child still running dies with it
    (confine.die_with_parent)."""
    zygote = os.getpid()
    req: dict | None = None
    while True:
        spare.ensure()  # the next job's child, forked ahead of it: the one place a spare is forked
        if req is None:
            line = sys.stdin.readline()
            if not line:
                spare.close()  # its job cgroup goes with it; the running jobs' children die with us
                break
            req = json.loads(line)
        if spare.pages is not None:
            handed = spare.hand(req)
            if handed is None:
                continue  # that spare died: the next one takes this job
            pid, ahead = handed
        else:  # spares off
            ahead, pid = False, os.fork()
            if pid == 0:
                _child(req, zygote)
        _say({"job": req["job"], "started": pid, "spare": ahead})
        threading.Thread(target=_reap, args=(req["job"], pid, req.get("deadline_s")), daemon=True).start()
        req = None


if __name__ == "__main__":
    main()
