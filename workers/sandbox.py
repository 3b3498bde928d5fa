"""The sandbox: every load and forward of a user's model runs in a child process (DESIGN.md §6).

The child gets a scrubbed environment (no broker URL, storage keys or tokens), a private
working directory, resource limits (address space, CPU time, file size, open files) and,
where the kernel allows, a network namespace with no interfaces. It reports progress as
JSON lines on a private pipe and leaves its result as files; the parent validates them.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

from fxport import errors
from fxport.spec import JobSpec

CLONE_NEWNET = 0x40000000
# Environment the child keeps; everything else (AWS_*, FXPORT_*, REDIS_*, tokens) is dropped.
_KEEP_ENV = ("PATH", "LANG", "LC_ALL", "TZ", "PYTHONHASHSEED")
MAX_FILE_BYTES = 16 << 30
MAX_OPEN_FILES = 1024

_ERROR_TYPES: dict[str, type[errors.FxportError]] = {
    cls.code: cls
    for cls in (
        errors.FxportError, errors.InvalidInput, errors.UnsupportedModelFormat, errors.CaptureFailed,
        errors.ConversionFailed, errors.VerificationFailed, errors.ResourceLimitExceeded,
    )
}


def apply_limits(memory_bytes: int, cpu_seconds: int, isolate_network: bool) -> bool:
    """Called first thing in the child, before any user code: limits, then no network.

    Returns whether the network namespace could be entered (needs CAP_SYS_ADMIN or
    unprivileged user namespaces; where it can't, the manifest says so).
    """
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
) -> dict[str, Any]:
    """Run `engine.convert` in a sandboxed child. Returns the manifest; raises FxportError."""
    out_dir.mkdir(parents=True, exist_ok=True)
    hide_parent_environment()
    timeout = float(timeout_s or spec.limits.timeout_s)
    memory = spec.limits.memory_mb << 20
    with tempfile.TemporaryDirectory(prefix="fxport-sandbox-") as work_str:
        work = Path(work_str)
        (work / "tmp").mkdir()
        request = {
            "model_path": str(model_path.resolve()), "spec": spec.normalized(), "out_dir": str(out_dir.resolve()),
            "job_id": job_id, "calibration_path": str(calibration_path) if calibration_path else None,
            "limits": {"memory_bytes": memory, "cpu_seconds": int(timeout) + 1, "isolate_network": isolate_network},
        }
        (work / "request.json").write_text(json.dumps(request))
        env = {k: os.environ[k] for k in _KEEP_ENV if k in os.environ}
        env.update(HOME=str(work), TMPDIR=str(work / "tmp"), PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1",
                   OMP_NUM_THREADS=os.environ.get("FXPORT_SANDBOX_THREADS", str(os.cpu_count() or 1)))
        event_r, event_w = os.pipe()
        env["FXPORT_SANDBOX_EVENT_FD"] = str(event_w)
        log_path = work / "sandbox.log"
        last_stage = {"stage": "load"}
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "fxport.workers.sandbox_child", str(work / "request.json")],
                cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                pass_fds=(event_w,), start_new_session=True,
            )
        os.close(event_w)

        def pump() -> None:
            with os.fdopen(event_r, "r") as events:
                for line in events:
                    try:
                        event = json.loads(line)
                    except ValueError:
                        continue
                    last_stage["stage"] = event.get("stage", last_stage["stage"])
                    if on_progress:
                        on_progress(event)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        started = time.monotonic()
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            raise errors.ResourceLimitExceeded(
                f"the model ran past the {timeout:.0f} s wall-clock limit during {last_stage['stage']}",
                stage=last_stage["stage"], hint="raise spec.limits.timeout_s (within the server maximum) "
                "or check the model for a hang in forward()",
            ) from None
        except BaseException:
            _kill_group(proc)
            raise
        finally:
            reader.join(timeout=5)
        elapsed = time.monotonic() - started
        result_path = work / "result.json"
        if rc != 0 or not result_path.exists():
            raise _death_error(rc, last_stage["stage"], memory, timeout, elapsed, _tail(log_path))
        result = json.loads(result_path.read_text())
    if not result.get("sandbox", {}).get("network_isolated"):
        logging.getLogger(__name__).warning("job %s: sandbox ran WITHOUT network isolation "
                                            "(no permission for a network namespace)", job_id)
    if not result.get("ok"):
        err = result["error"]
        cls = _ERROR_TYPES.get(err.get("code"), errors.ConversionFailed)
        exc = cls(err.get("message") or "conversion failed", stage=err.get("stage"), detail=err.get("detail"),
                  field=err.get("field"))
        raise exc
    manifest = result["manifest"]
    manifest["sandbox"] = result.get("sandbox", {})
    _validate_outputs(manifest, out_dir)
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2, default=str))
    return manifest


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _tail(path: Path, limit: int = 4000) -> str:
    try:
        data = path.read_bytes()[-limit:]
    except OSError:
        return ""
    return data.decode("utf-8", "replace")


def _death_error(rc: int, stage: str, memory: int, timeout: float, elapsed: float, log: str) -> errors.FxportError:
    if rc < 0:
        sig = signal.Signals(-rc).name
        if -rc == signal.SIGXCPU:
            why = f"the model used up its {timeout:.0f} s CPU-time limit during {stage}"
        elif -rc in (signal.SIGKILL,) or "MemoryError" in log or "std::bad_alloc" in log:
            why = f"the model exceeded {memory >> 20} MiB address space during {stage} (killed by {sig})"
        elif -rc == signal.SIGXFSZ:
            why = f"the model wrote a file larger than {MAX_FILE_BYTES >> 30} GiB during {stage}"
        else:
            why = f"the sandbox process died with {sig} during {stage}"
    elif "MemoryError" in log or "bad_alloc" in log or "Cannot allocate memory" in log:
        why = f"the model exceeded {memory >> 20} MiB address space during {stage}"
    else:
        why = f"the sandbox process exited with status {rc} during {stage}"
    return errors.ResourceLimitExceeded(why, stage=stage, detail=log[-2000:] or None,
                                        hint="raise spec.limits.memory_mb / timeout_s within the server maximum, "
                                        "or check the model")


def _validate_outputs(manifest: dict[str, Any], out_dir: Path) -> None:
    """The child's files are untrusted: every artifact must be a regular file inside out_dir
    whose size and sha256 match the manifest."""
    from fxport.workers.engine.exporters import file_sha256

    root = out_dir.resolve()
    for art in manifest.get("artifacts", []):
        path = (out_dir / art["path"]).resolve()
        if root not in path.parents or path.is_symlink() or not path.is_file():
            raise errors.ConversionFailed(f"sandbox produced an invalid artifact path {art['path']!r}", stage="upload")
        if path.stat().st_size != art["bytes"] or file_sha256(path) != art["sha256"]:
            raise errors.ConversionFailed(f"artifact {art['path']!r} does not match its recorded digest", stage="upload")
    for path in out_dir.rglob("*"):
        if path.is_symlink():
            raise errors.ConversionFailed(f"sandbox produced a symlink {path.name!r}", stage="upload")
