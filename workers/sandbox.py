"""The sandbox: every load and forward of a user's model runs in a child process (DESIGN.md §6).

The child gets a scrubbed environment (no broker URL, storage keys or tokens), a private
working directory, resource limits (address space, CPU time, file size, open files) and,
where the kernel allows, a network namespace with no interfaces; workers/sandbox_confine.py
then forbids new processes, writes outside its folders, TCP and capabilities. It reports
progress as JSON lines on a private pipe and leaves its result as files; the parent
validates them.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import resource
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from fxport import errors
from fxport.spec import JobSpec

CLONE_NEWNET = 0x40000000
# Environment the child keeps; everything else (AWS_*, FXPORT_*, REDIS_*, tokens) is dropped.
_KEEP_ENV = ("PATH", "LANG", "LC_ALL", "TZ", "PYTHONHASHSEED",
             # a TensorRT build needs the GPU the worker was given and the libraries its image set up
             "LD_LIBRARY_PATH", "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES",
             "CUDA_MODULE_LOADING")
# Where a TensorRT build inside the child leaves the merged timing cache (it may write only to
# its folders); run_engine_job moves it to the caller's timing_cache_path.
TIMING_CACHE_OUT = "tensorrt-timing.cache"
MAX_FILE_BYTES = 16 << 30
MAX_OPEN_FILES = 1024
MAX_MANIFEST_BYTES = 64 << 20  # a manifest lists nodes and metrics, never weights

_ERROR_TYPES: dict[str, type[errors.FxportError]] = {
    cls.code: cls
    for cls in (
        errors.FxportError, errors.InvalidInput, errors.UnsupportedModelFormat, errors.CaptureFailed,
        errors.ConversionFailed, errors.VerificationFailed, errors.ResourceLimitExceeded,
    )
}


def apply_limits(memory_bytes: int, cpu_seconds: int, isolate_network: bool, limit_address_space: bool = True) -> bool:
    """Called first thing in the child, before any user code: limits, then no network.

    Returns whether the network namespace could be entered (needs CAP_SYS_ADMIN or
    unprivileged user namespaces; where it can't, the manifest says so).
    `limit_address_space=False` (a TensorRT build): CUDA reserves far more virtual address
    space than it uses and fails to initialise under RLIMIT_AS, so there the container's
    memory limit is what bounds the job.
    """
    if limit_address_space:
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 5))
    resource.setrlimit(resource.RLIMIT_FSIZE, (MAX_FILE_BYTES, MAX_FILE_BYTES))
    resource.setrlimit(resource.RLIMIT_NOFILE, (MAX_OPEN_FILES, MAX_OPEN_FILES))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if not isolate_network:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.unshare(CLONE_NEWNET) == 0


PR_SET_DUMPABLE = 4


def hide_parent_environment() -> None:
    """Make this (the worker) process non-dumpable, so /proc/<pid>/environ — which holds the
    broker URL and storage keys — is no longer readable by a same-user sandbox child."""
    try:
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

# The zygote moves its memory onto 2 MiB pages once warm (sandbox_zygote.collapse_to_huge_pages):
# a fork then copies, and a child's exit tears down, a few hundred page-table entries instead
# of ~85k. A tiny job's fork, run and exit: see docs/benchmarks.md, "Sandbox overhead".
SANDBOX_HUGE_PAGES = True


def _scrubbed_env(work: Path | None = None) -> dict[str, str]:
    env = {k: os.environ[k] for k in _KEEP_ENV if k in os.environ}
    env.update(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", FXPORT_SANDBOX="1", GLIBC_TUNABLES=SANDBOX_MALLOC_TUNABLES,
               OMP_NUM_THREADS=os.environ.get("FXPORT_SANDBOX_THREADS") or str(available_cpus()))
    if work is not None:
        env.update(HOME=str(work), TMPDIR=str(work / "tmp"))
    return env


class _ColdLaunch:
    """A fresh interpreter per job: pays `import torch` every time (the fallback)."""

    def __init__(self, request_path: Path, env: dict[str, str], log_path: Path) -> None:
        with log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "fxport.workers.sandbox_child", str(request_path)],
                cwd=request_path.parent, env={**env, "FXPORT_SANDBOX_PARENT": str(os.getpid())},
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        self.pid = self.proc.pid

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


class _WarmLaunch:
    def __init__(self, zygote: "WarmSandbox", job: int, pid: int) -> None:
        self.zygote, self.job, self.pid = zygote, job, pid

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


class WarmSandbox:
    """A warm parent (the zygote) with torch, onnx and the engine imported, forking one child
    per job (DESIGN.md §8): a job pays a fork (milliseconds), not an interpreter start and
    `import torch` (seconds). The zygote itself starts with the scrubbed environment, so no
    child can inherit a credential, and it never runs a torch op, so forking is safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[str] | None = None
        self._next = 0
        self._started: dict[int, tuple[threading.Event, list[int]]] = {}
        self._exited: dict[int, tuple[threading.Event, list[int]]] = {}
        self.ready: dict[str, Any] = {}  # the zygote's start-up report: its threads, its huge pages

    def _ensure(self) -> subprocess.Popen[str]:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "fxport.workers.sandbox_zygote"], cwd="/",
            env={**_scrubbed_env(), "FXPORT_SANDBOX_HUGE_PAGES": "1" if SANDBOX_HUGE_PAGES else "0"},
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
        logging.getLogger(__name__).info(
            "warm sandbox ready (pid %d): %s MiB of its memory moved to huge pages in %s s, %s range(s) refused",
            self._proc.pid, huge.get("collapsed_mib", 0), huge.get("seconds", 0), huge.get("refused", 0))
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
            event.set()
        # the zygote died: wake every waiter with a failure status
        with self._lock:
            for table in (self._started, self._exited):
                for event, box in table.values():
                    if not event.is_set():
                        box.append(-int(signal.SIGKILL))
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
        return _WarmLaunch(self, job, box[0])

    def wait(self, job: int, timeout: float) -> int:
        event, box = self._exited[job]
        if not event.wait(timeout):
            raise TimeoutError
        with self._lock:
            self._started.pop(job, None)
            self._exited.pop(job, None)
        return box[0]

    def close(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None


_warm: WarmSandbox | None = None
_warm_lock = threading.Lock()


def _warm_sandbox() -> WarmSandbox:
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
    zygote = _warm_sandbox()
    try:
        with zygote._lock:
            zygote._ensure()
    except Exception:
        logging.getLogger(__name__).warning("could not prestart the warm sandbox", exc_info=True)


def _launch(request_path: Path, env: dict[str, str], log_path: Path,
            deadline_s: float | None = None) -> _ColdLaunch | _WarmLaunch:
    if os.environ.get("FXPORT_SANDBOX_MODE", "warm") == "warm":
        _warm = _warm_sandbox()
        try:
            return _warm.launch(request_path, env, log_path, deadline_s)
        except (RuntimeError, OSError, ValueError):  # what a failed or dead zygote raises; a
            # time limit or cancellation raised meanwhile (Celery's SoftTimeLimitExceeded is an
            # Exception too) must end the job, not start a cold sandbox that no clock watches
            logging.getLogger(__name__).warning("warm sandbox unavailable; starting a cold one", exc_info=True)
    return _ColdLaunch(request_path, env, log_path)


class _Cancelled(Exception):
    pass


def _wait_or_cancel(launch: _ColdLaunch | _WarmLaunch, timeout: float, cancel: threading.Event | None) -> int:
    """Wait for the child; raise TimeoutError past `timeout`, _Cancelled once `cancel` is set."""
    deadline = time.monotonic() + timeout
    while True:
        if cancel is not None and cancel.is_set():
            raise _Cancelled
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        try:
            return launch.wait(min(left, 0.2) if cancel is not None else left)
        except TimeoutError:
            continue


def run_engine_job(
    model_path: Path,
    spec: JobSpec,
    out_dir: Path,
    *,
    job_id: str,
    calibration_path: Path | None = None,
    on_progress: Callable[[dict[str, Any]], None] | None = None,
    timeout_s: float | None = None,
    isolate_network: bool = True,
    cancel_event: threading.Event | None = None,
    deferred_targets: Sequence[str] = (),
    timing_cache_path: Path | None = None,
    input_sha256: str | None = None,
) -> dict[str, Any]:
    """Run `engine.convert` in a sandboxed child. Returns the manifest; raises FxportError.

    Setting `cancel_event` kills the child at once and raises JobCancelled.
    `deferred_targets` and `timing_cache_path` go to convert; the child reads the timing cache
    there and, after a TensorRT build, the merged cache is left at the same path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    hide_parent_environment()
    timeout = float(timeout_s or spec.limits.timeout_s)
    memory = spec.limits.memory_mb << 20
    builds_engine = "tensorrt" in spec.targets and "tensorrt" not in deferred_targets
    cache_out = out_dir.resolve() / TIMING_CACHE_OUT if timing_cache_path is not None else None
    with tempfile.TemporaryDirectory(prefix="fxport-sandbox-") as work_str:
        work = Path(work_str)
        (work / "tmp").mkdir()
        events_path = work / "events"
        os.mkfifo(events_path, 0o600)
        request = {
            "model_path": str(model_path.resolve()), "spec": spec.normalized(), "out_dir": str(out_dir.resolve()),
            "job_id": job_id, "calibration_path": str(calibration_path) if calibration_path else None,
            "limits": {"memory_bytes": memory, "cpu_seconds": int(timeout) + 1, "isolate_network": isolate_network,
                       "limit_address_space": not builds_engine},
            "events_path": str(events_path),
            "deferred_targets": list(deferred_targets),
            "input_sha256": input_sha256,
            "timing_cache": {"read": str(timing_cache_path.resolve()), "write": str(cache_out)} if cache_out else None,
        }
        (work / "request.json").write_text(json.dumps(request))
        log_path = work / "sandbox.log"
        last_stage = {"stage": "load"}
        # O_RDWR: opening never blocks and never reads EOF early, whenever the child opens its end
        events_fd = os.open(events_path, os.O_RDWR | os.O_NONBLOCK)
        # Written once the child has exited: the pump drains what is left and stops at once
        # (a poll timeout here cost every job up to its length after the child was done).
        wake_r, wake_w = os.pipe()
        done = threading.Event()

        def deliver(buffer: bytes) -> bytes:
            *lines, rest = buffer.split(b"\n")
            for line in lines:
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                last_stage["stage"] = event.get("stage", last_stage["stage"])
                if on_progress:
                    on_progress(event)
            return rest

        def read_some() -> bytes:
            try:
                return os.read(events_fd, 65536)
            except BlockingIOError:  # our own O_RDWR end keeps the FIFO open: empty, never EOF
                return b""

        def pump() -> None:
            buffer = b""
            while True:
                ready, _, _ = select.select([events_fd, wake_r], [], [], 1.0)
                if events_fd in ready and (chunk := read_some()):
                    buffer = deliver(buffer + chunk)
                    continue
                if wake_r in ready or done.is_set():
                    while chunk := read_some():
                        buffer = deliver(buffer + chunk)
                    return

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        started = time.monotonic()
        launch = _launch(work / "request.json", _scrubbed_env(work), log_path, timeout + BACKSTOP_GRACE_S)
        try:
            rc = _wait_or_cancel(launch, timeout, cancel_event)
        except _Cancelled:
            launch.kill()
            raise errors.JobCancelled(f"cancelled during {last_stage['stage']}", stage=last_stage["stage"]) from None
        except TimeoutError:
            launch.kill()
            _count_failure("timeout")
            raise errors.ResourceLimitExceeded(
                f"the model ran past the {timeout:.0f} s wall-clock limit during {last_stage['stage']}",
                stage=last_stage["stage"], hint="raise spec.limits.timeout_s (within the server maximum) "
                "or check the model for a hang in forward()",
            ) from None
        except BaseException:
            launch.kill()
            raise
        finally:
            done.set()
            os.write(wake_w, b"x")
            reader.join(timeout=5)
            for fd in (events_fd, wake_r, wake_w):
                os.close(fd)
        elapsed = time.monotonic() - started
        result_path = work / "result.json"
        if rc != 0 or not result_path.exists():
            draw_report(out_dir)
            raise _death_error(rc, last_stage["stage"], memory, timeout, elapsed, _tail(log_path))
        result = json.loads(result_path.read_text())
    if cache_out is not None and timing_cache_path is not None:
        if cache_out.is_file() and not cache_out.is_symlink() and result.get("ok"):
            os.replace(cache_out, timing_cache_path)
        cache_out.unlink(missing_ok=True)  # never uploaded as an artifact
    box = result.get("sandbox", {})
    if not box.get("network_isolated"):
        logging.getLogger(__name__).warning(
            "job %s: sandbox ran WITHOUT a network namespace (no permission for one); TCP %s", job_id,
            "is blocked by Landlock" if box.get("tcp_blocked") else "is OPEN and so are other protocols")
    for problem in box.get("errors", ()):
        logging.getLogger(__name__).warning("job %s: sandbox confinement incomplete: %s", job_id, problem)
    if not result.get("ok"):
        draw_report(out_dir)
        err = result["error"]
        if err.get("code") == "resource_limit":
            _count_failure("memory")
        cls = _ERROR_TYPES.get(err.get("code"), errors.ConversionFailed)
        exc = cls(err.get("message") or "conversion failed", stage=err.get("stage"), detail=err.get("detail"),
                  field=err.get("field"))
        raise exc
    manifest = result["manifest"]
    manifest["sandbox"] = result.get("sandbox", {})
    try:
        _validate_outputs(manifest, out_dir)
    except errors.FxportError:
        _count_failure("invalid_output")
        raise
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2, default=str))
    draw_report(out_dir)
    return manifest


def draw_report(out_dir: Path) -> None:
    """report.html from out_dir/manifest.json, drawn here: the child may not start `dot`, so
    it leaves the report to this side, which runs `dot` confined (sandbox_confine.confined_dot).
    The manifest is the child's (untrusted): every string in it is escaped by the report, and
    one too big to be a manifest is not read. A report problem never fails the job."""
    from fxport.report import write_report
    from fxport.workers.sandbox_confine import confined_dot

    path = out_dir / "manifest.json"
    try:
        if path.is_symlink() or not path.is_file() or path.stat().st_size > MAX_MANIFEST_BYTES:
            return
        write_report(path, layout=confined_dot)
    except Exception as exc:
        logging.getLogger(__name__).warning("report.html could not be drawn: %s: %s", type(exc).__name__, exc)


def _tail(path: Path, limit: int = 4000) -> str:
    try:
        data = path.read_bytes()[-limit:]
    except OSError:
        return ""
    return data.decode("utf-8", "replace")


def _count_failure(reason: str) -> None:
    """fxport_sandbox_failures_total{reason}; metrics are optional where prometheus isn't installed."""
    try:
        from fxport.metrics import METRICS
    except ImportError:
        return
    METRICS.record_sandbox_failure(reason)


def _death_error(rc: int, stage: str, memory: int, timeout: float, elapsed: float, log: str) -> errors.FxportError:
    if rc < 0:
        sig = signal.Signals(-rc).name
        if -rc == signal.SIGXCPU:
            reason, why = "cpu_time", f"the model used up its {timeout:.0f} s CPU-time limit during {stage}"
        elif -rc in (signal.SIGKILL,) or "MemoryError" in log or "std::bad_alloc" in log:
            reason = "memory"
            why = f"the model exceeded {memory >> 20} MiB address space during {stage} (killed by {sig})"
        elif -rc == signal.SIGXFSZ:
            reason = "file_size"
            why = f"the model wrote a file larger than {MAX_FILE_BYTES >> 30} GiB during {stage}"
        else:
            reason, why = "signal", f"the sandbox process died with {sig} during {stage}"
    elif "MemoryError" in log or "bad_alloc" in log or "Cannot allocate memory" in log:
        reason, why = "memory", f"the model exceeded {memory >> 20} MiB address space during {stage}"
    else:
        reason, why = "exit_code", f"the sandbox process exited with status {rc} during {stage}"
    _count_failure(reason)
    return errors.ResourceLimitExceeded(why, stage=stage, detail=log[-2000:] or None,
                                        hint="raise spec.limits.memory_mb / timeout_s within the server maximum, "
                                        "or check the model")


def _validate_outputs(manifest: dict[str, Any], out_dir: Path) -> None:
    """The child's files are untrusted: every artifact must be a regular file inside out_dir
    whose size and sha256 match the manifest."""
    from fxport.workers.engine.exporters import file_sha256

    from concurrent.futures import ThreadPoolExecutor

    root = out_dir.resolve()
    arts = manifest.get("artifacts", [])
    for art in arts:
        path = (out_dir / art["path"]).resolve()
        if root not in path.parents or path.is_symlink() or not path.is_file():
            raise errors.ConversionFailed(f"sandbox produced an invalid artifact path {art['path']!r}", stage="upload")
    # Several artifacts hashed at once (hashlib lets go of the GIL): this is on every job's critical path.
    with ThreadPoolExecutor(max_workers=max(1, min(4, len(arts)))) as pool:
        digests = list(pool.map(lambda a: file_sha256(out_dir / a["path"]), arts))
    for art, digest in zip(arts, digests):
        if (out_dir / art["path"]).stat().st_size != art["bytes"] or digest != art["sha256"]:
            raise errors.ConversionFailed(f"artifact {art['path']!r} does not match its recorded digest", stage="upload")
    for path in out_dir.rglob("*"):
        if path.is_symlink():
            raise errors.ConversionFailed(f"sandbox produced a symlink {path.name!r}", stage="upload")
