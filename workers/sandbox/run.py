"""`run_engine_job`: one conversion in a sandbox child, seen from the worker.

The worker makes a private folder for the job's child (`work`, mode 0700, beside the job's
inputs and outputs and nothing of any other job), writes the request there, starts the child
(sandbox/launch.py), reads its events with every size bounded (sandbox/events.py), records its
layers itself (sandbox/layers.py), and after it exits reads what it left only through
sandbox/beneath.py: no link the child made is followed, no file it wrote is read unbounded.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import signal
import stat
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from fxport import errors
from fxport.manifest import Manifest
from fxport.manifest_sections import Sandbox
from fxport.toolchain import configured_op_libraries
from fxport.workers.engine.request import EngineRequest, TimingCachePaths
from fxport.workers.sandbox import beneath, layers
from fxport.workers.sandbox import launch as launcher
from fxport.workers.sandbox.confine import MAX_FILE_BYTES
from fxport.workers.sandbox.events import EventPump
from fxport.workers.sandbox.request import SandboxLimits, SandboxRequest, SandboxResult

log = logging.getLogger("fxport.workers.sandbox")

# Where a TensorRT build inside the child leaves the merged timing cache (it may write only to
# its folders); run_engine_job moves it to the request's timing_cache.write.
TIMING_CACHE_OUT = "tensorrt-timing.cache"
MAX_MANIFEST_BYTES = 16 << 20  # a manifest lists nodes and metrics, never weights
MAX_RESULT_BYTES = MAX_MANIFEST_BYTES + (1 << 20)  # the manifest plus an error
MAX_TIMING_CACHE_BYTES = 256 << 20
MAX_OUTPUT_FILES = 4096  # a conversion writes a handful; FX source one file per submodule at most
MAX_SANDBOX_ENTRIES = 4 * MAX_OUTPUT_FILES  # files and folders beneath its folders while it runs (temp files too)
DISK_CHECK_S = 0.5
# The shape of a manifest the worker accepts from the sandbox: the engine writes at most 2,000 graph
# nodes and a few dozen rows per section, and strings of a few KB (an error's log tail: 4 KB).
MAX_MANIFEST_ITEMS = 10_000
MAX_MANIFEST_STRING = 64 << 10
MAX_MANIFEST_DEPTH = 32
LOG_TAIL_BYTES = 4000



def required_layers() -> list[str]:
    """Layers without which no model runs (FXPORT_SANDBOX_REQUIRE, comma-separated names from
    sandbox/child.py LAYERS). Default on Linux: seccomp and Landlock, both unprivileged. Empty
    elsewhere, where neither exists: the child is then bounded by its rlimits alone."""
    raw = os.environ.get("FXPORT_SANDBOX_REQUIRE")
    if raw is None:
        return ["seccomp", "landlock"] if platform.system() == "Linux" else []
    return [name.strip() for name in raw.split(",") if name.strip() and name.strip() != "none"]


def readable_inputs(model_path: Path, calibration_path: Path | None, timing_cache: Path | None,
                    op_libraries: Sequence[str] = ()) -> list[Path]:
    """What the child may read of the job's inputs: each file alone; an ONNX model's folder
    (its external data lies beside it under names the model chooses); and each op library that
    is a shared library, the file alone (dlopen reads and maps it; a module's package is among
    the installed packages every child reads already)."""
    paths = [model_path.parent if model_path.suffix == ".onnx" else model_path]
    paths += [p for p in (calibration_path, timing_cache) if p is not None]
    paths += [Path(entry) for entry in op_libraries if entry.startswith("/")]
    return [p.resolve() for p in paths]


def run_engine_job(
    request: EngineRequest,
    *,
    on_progress: Callable[[dict[str, Any]], None] | None = None,
    isolate_network: bool = True,
    cancel_event: threading.Event | None = None,
    work_parent: Path | None = None,
    warm: bool | None = None,
    op_libraries: Sequence[str] | None = None,
) -> Manifest:
    """Run the engine on `request` in a sandboxed child. Returns the manifest; raises FxportError.

    `request.out_dir` gets the artifacts, manifest.json and report.html; the child has
    `request.timeout` seconds of wall clock and `request.memory_bytes` of address space.
    `work_parent`: where the child's private folder goes (the job's own folder on a worker; the
    system temp dir by default). Setting `cancel_event` kills the child at once and raises
    JobCancelled. After a TensorRT build the merged timing cache is left at
    `request.timing_cache.write`. `warm`: fork from the warm zygote (default: FXPORT_SANDBOX_MODE)
    or start a fresh interpreter. `op_libraries`: the custom op libraries the child loads before
    the model (default: this process's FXPORT_OP_LIBRARIES; a worker passes its settings')."""
    libraries = configured_op_libraries() if op_libraries is None else list(op_libraries)
    out_dir = request.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    launcher.hide_parent_environment()
    job_id = request.job_id or f"local-{uuid.uuid4().hex[:12]}"  # the key kill_job finds the child by
    work = Path(tempfile.mkdtemp(prefix="fxport-sandbox-", dir=work_parent))  # 0700, this job's alone
    child = _Child(job_id, work, on_progress, warm)
    try:
        manifest = _run_checked(request, child, isolate_network, cancel_event, libraries)
    except Exception:
        # A failed job still publishes manifest.json and report.html (workers/jobs.py): the
        # worker's own, whatever the child (or a thread it left running) put there.
        _keep_failed_outputs(out_dir, child.sandbox_record())
        raise
    finally:
        try:
            beneath.remove_tree(work)  # what the child left, a folder it made unwritable included
        except (OSError, RecursionError) as exc:
            log.warning("could not remove the sandbox's folder %s: %s", work, exc)
    with beneath.opened_dir(out_dir) as out_fd:
        beneath.replace_file(out_fd, "manifest.json", manifest.to_json().encode())
    draw_report(out_dir)
    return manifest


def _run_checked(request: EngineRequest, child: _Child, isolate_network: bool,
                 cancel_event: threading.Event | None, op_libraries: Sequence[str] = ()) -> Manifest:
    """Run `child` on `request` in its folder and return the manifest it reported, with the
    worker's record of the layers, once every file it lists in out_dir has been checked."""
    out_dir, work, timeout, memory = request.out_dir, child.work, request.timeout, request.memory_bytes
    timing_cache = request.timing_cache.read if request.timing_cache is not None else None
    (work / "tmp").mkdir()
    events_path = work / "events"
    os.mkfifo(events_path, 0o600)
    engine = request.resolved()
    if timing_cache is not None:  # the child may write only to its folders: the merged cache goes to out_dir
        engine = engine.model_copy(update={"timing_cache": TimingCachePaths(
            read=timing_cache.resolve(), write=out_dir.resolve() / TIMING_CACHE_OUT)})
    sandbox_request = SandboxRequest(
        engine=engine,
        limits=SandboxLimits(memory_bytes=memory, cpu_seconds=int(timeout) + 1, isolate_network=isolate_network),
        events_path=events_path,
        readable=readable_inputs(request.model_path, request.calibration_path, timing_cache, op_libraries),
        require=required_layers(),
        op_libraries=list(op_libraries),
    )
    (work / "request.json").write_text(sandbox_request.model_dump_json())
    try:
        disk = DiskWatch((work, out_dir), request.max_output_bytes, MAX_SANDBOX_ENTRIES)
        rc = child.run(launcher.scrubbed_env(work), timeout, cancel_event, disk)
        with beneath.opened_dir(work) as work_fd:
            raw = _read_result(work_fd, rc, child, memory, timeout)
    finally:
        box = child.sandbox_record()
        layers.log_layers(child.job_id, box)
    if request.timing_cache is not None:
        _take_timing_cache(out_dir, request.timing_cache.write, keep=raw.get("ok") is True)
    result = _child_result(raw)
    if result.error is not None:
        if result.error.code == "resource_limit":
            _count_failure("memory")
        raise errors.ConversionFailed.from_record(result.error)  # the class its code names; ConversionFailed if none
    assert result.manifest is not None  # _child_result: one or the other
    manifest = result.manifest
    manifest.sandbox = Sandbox.model_validate(box)  # the worker's record; whatever the child wrote there is dropped
    try:
        _validate_outputs(manifest, out_dir, request.max_output_bytes)
    except errors.FxportError:
        _count_failure("invalid_output")
        raise
    return manifest


def _child_result(raw: dict[str, Any]) -> SandboxResult:
    """result.json as the type it is written in, read as untrusted data: an error record cut to
    size (_child_error), or a manifest of bounded shape (_child_manifest), never both."""
    if raw.get("ok") is not True:
        return SandboxResult(ok=False, error=_child_error(raw.get("error")))
    try:
        return SandboxResult(ok=True, manifest=_child_manifest(raw.get("manifest")))
    except errors.FxportError:
        _count_failure("invalid_output")
        raise


def _child_manifest(data: Any) -> Manifest:
    """The child's manifest, read as the type every reader expects: one of another shape (a
    string where a digest goes, an artifact without a path) or of more than a conversion writes
    (`manifest_shape_violation`) is refused here, not by a reader."""
    if not isinstance(data, dict):
        raise errors.SandboxViolation("the sandbox's result has no manifest", stage="upload")
    excess = manifest_shape_violation(data)
    if excess:
        raise errors.SandboxViolation(f"the sandbox's manifest {excess}", stage="upload",
                                      hint="a conversion's manifest stays far below these bounds: the model "
                                      "rewrote it")
    try:
        return Manifest.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise errors.SandboxViolation(f"the sandbox's manifest is malformed at {where!r}: {first['msg']}"[:500],
                                      stage="upload") from None


def manifest_shape_violation(data: Any) -> str | None:
    """What in a manifest passes MAX_MANIFEST_ITEMS items in a list or mapping,
    MAX_MANIFEST_STRING characters in a string or MAX_MANIFEST_DEPTH levels of nesting, said with
    its path and the bound; None when nothing does. Every reader after the sandbox (the upload, the
    report, the job record) then handles a manifest of bounded shape, whatever the model wrote."""
    stack: list[tuple[Any, str, int]] = [(data, "manifest", 0)]
    while stack:
        value, where, depth = stack.pop()
        if isinstance(value, str):
            if len(value) > MAX_MANIFEST_STRING:
                return f"has a string of {len(value)} characters at {where}; the bound is {MAX_MANIFEST_STRING}"
            continue
        if not isinstance(value, (list, dict)):
            continue
        if depth >= MAX_MANIFEST_DEPTH:
            return f"nests more than {MAX_MANIFEST_DEPTH} levels deep at {where}"
        if len(value) > MAX_MANIFEST_ITEMS:
            return f"has {len(value)} items at {where}; the bound is {MAX_MANIFEST_ITEMS} per list or mapping"
        if isinstance(value, dict):
            stack.extend((v, f"{where}.{str(k)[:40]}", depth + 1) for k, v in value.items())
            stack.extend((k, f"{where} (a key)", depth + 1) for k in value)
        else:
            stack.extend((v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value))
    return None


def _str(value: Any) -> str | None:
    return None if value is None else str(value)[:4000]


class _Child:
    """One child: started, watched (events, layers, cancel, clock) and stopped."""

    def __init__(self, job_id: str, work: Path, on_progress: Callable[[dict[str, Any]], None] | None,
                 warm: bool | None) -> None:
        self.job_id, self.work, self.on_progress, self.warm = job_id, work, on_progress, warm
        self.stage = "load"
        self.launch: launcher.Launch | None = None
        self._launched = threading.Event()
        self.reported: dict[str, Any] | None = None
        self.measured: dict[str, Any] | None = None
        self.measure_error: str | None = None

    def _on_layers(self, report: dict[str, Any] | None) -> None:
        """The child's first line: its layer report, then the worker looks at it from outside."""
        self.reported = report
        self._launched.wait(30)
        if self.launch is None:
            self.measure_error = "it was not started"
            return
        try:
            self.measured = layers.measure(self.launch.pid, self.launch.alive)
        except layers.ChildGone:
            self.measure_error = "it had exited"
        except (OSError, ValueError) as exc:
            self.measure_error = f"{type(exc).__name__}: {exc}"

    def _on_event(self, event: dict[str, Any]) -> None:
        self.stage = event["stage"]
        if self.on_progress:
            self.on_progress(event)

    def run(self, env: dict[str, str], timeout: float, cancel: threading.Event | None,
            disk: DiskWatch | None = None) -> int:
        events_fd = os.open(self.work / "events", os.O_RDWR | os.O_NONBLOCK)  # never blocks, never EOF
        pump = EventPump(events_fd, self._on_layers, self._on_event).start()
        try:
            try:
                self.launch = launcher.launch(self.work / "request.json", env, self.work / "sandbox.log",
                                              timeout + launcher.BACKSTOP_GRACE_S, warm=self.warm)
            finally:
                self._launched.set()
            launcher.register(self.job_id, self.launch)
            try:
                return self._wait(timeout, cancel, pump, disk)
            except BaseException:
                self.launch.kill()
                raise
            finally:
                launcher.unregister(self.job_id, self.launch)
                self.launch.close()
        finally:
            pump.stop()
            os.close(events_fd)

    def _wait(self, timeout: float, cancel: threading.Event | None, pump: EventPump, disk: DiskWatch | None) -> int:
        """The child's exit status; raises when it is cancelled, breaks the event rules, writes
        past its disk budget or runs past `timeout`."""
        assert self.launch is not None
        deadline = time.monotonic() + timeout
        while True:
            if cancel is not None and cancel.is_set():
                raise errors.JobCancelled(f"cancelled during {self.stage}", stage=self.stage)
            if pump.violated.is_set():
                _count_failure("events")
                raise errors.SandboxViolation(
                    f"the model broke the sandbox's event rules during {self.stage}: {pump.violation}",
                    stage=self.stage, hint="a model must not write to the sandbox's event channel")
            excess = disk.check() if disk is not None else None
            if excess:
                _count_failure("disk")
                raise errors.ResourceLimitExceeded(f"the model {excess} during {self.stage}", stage=self.stage,
                                                   hint="a conversion's files stay far below it; an operator sets "
                                                   "FXPORT_MAX_JOB_OUTPUT_BYTES")
            left = deadline - time.monotonic()
            if left <= 0:
                _count_failure("timeout")
                raise errors.ResourceLimitExceeded(
                    f"the model ran past the {timeout:.0f} s wall-clock limit during {self.stage}",
                    stage=self.stage, hint="raise spec.limits.timeout_s (within the server maximum) "
                    "or check the model for a hang in forward()")
            try:
                return self.launch.wait(min(left, 0.2))
            except TimeoutError:
                continue

    def sandbox_record(self) -> dict[str, Any]:
        return layers.record(self.measured, self.reported, measure_error=self.measure_error)


class DiskWatch:
    """What a running child has written beneath its folders: the sizes of its regular files (a
    sparse file at its full size: what reading or uploading it would cost) and the number of
    entries, looked at every DISK_CHECK_S without following a link (each folder opened beneath
    its parent with O_NOFOLLOW). The kernel bounds each file (RLIMIT_FSIZE); this bounds them all."""

    def __init__(self, folders: tuple[Path, ...], max_bytes: int, max_entries: int) -> None:
        self.folders, self.max_bytes, self.max_entries = folders, max_bytes, max_entries
        self._next = 0.0

    def check(self) -> str | None:
        """The excess, said (`wrote more than N bytes (FXPORT_MAX_JOB_OUTPUT_BYTES)`), or None;
        looked at once every DISK_CHECK_S at most."""
        now = time.monotonic()
        if now < self._next:
            return None
        self._next = now + DISK_CHECK_S
        total = entries = 0
        pending: list[int] = []  # folders to list, each open
        done: list[int] = []
        try:
            for folder in self.folders:
                with contextlib.suppress(OSError):
                    pending.append(os.open(folder, _DIR_FLAGS))
            while pending:
                fd = pending.pop()
                done.append(fd)
                try:
                    listing = os.scandir(fd)
                except OSError:
                    continue
                with listing:
                    for entry in listing:
                        entries += 1
                        if entries > self.max_entries:
                            return f"made more than {self.max_entries} files and folders (the bound)"
                        try:
                            st = os.stat(entry.name, dir_fd=fd, follow_symlinks=False)
                            if stat.S_ISDIR(st.st_mode):
                                pending.append(os.open(entry.name, _DIR_FLAGS, dir_fd=fd))
                            elif stat.S_ISREG(st.st_mode):
                                total += st.st_size
                        except OSError:  # gone, or swapped for a link meanwhile: never followed
                            continue
                        if total > self.max_bytes:
                            return f"wrote more than {self.max_bytes} bytes (FXPORT_MAX_JOB_OUTPUT_BYTES)"
        finally:
            for fd in pending + done:
                os.close(fd)
        return None


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _read_result(work_fd: int, rc: int, child: _Child, memory: int, timeout: float) -> dict[str, Any]:
    """The child's result.json, read within MAX_RESULT_BYTES; its death, named, if there is none."""
    try:
        raw = beneath.read_bounded(work_fd, "result.json", MAX_RESULT_BYTES, "result.json")
    except FileNotFoundError:
        raw = None
    except errors.SandboxViolation:
        _count_failure("invalid_output")
        raise
    if rc != 0 or raw is None:
        log_tail = beneath.tail_bounded(work_fd, "sandbox.log", LOG_TAIL_BYTES).decode("utf-8", "replace")
        raise _death_error(rc, child.stage, memory, timeout, log_tail)
    try:
        result = json.loads(raw)
    except (ValueError, RecursionError):
        _count_failure("invalid_output")
        raise errors.SandboxViolation("the sandbox's result.json is not valid JSON", stage="upload") from None
    if not isinstance(result, dict):
        _count_failure("invalid_output")
        raise errors.SandboxViolation("the sandbox's result.json is not an object", stage="upload")
    return result


def _take_timing_cache(out_dir: Path, dest: Path, *, keep: bool) -> None:
    """Move the merged TensorRT timing cache the child left to `dest` (never an artifact)."""
    with beneath.opened_dir(out_dir) as out_fd:
        if keep:
            try:
                data = beneath.read_bounded(out_fd, TIMING_CACHE_OUT, MAX_TIMING_CACHE_BYTES, "TensorRT timing cache")
                tmp = dest.with_name(dest.name + ".new")
                tmp.write_bytes(data)
                os.replace(tmp, dest)
            except (OSError, errors.FxportError) as exc:
                log.warning("the TensorRT timing cache the build left was not kept: %s", exc)
        try:
            os.unlink(TIMING_CACHE_OUT, dir_fd=out_fd)
        except FileNotFoundError:
            pass


def _keep_failed_outputs(out_dir: Path, box: dict[str, Any]) -> None:
    """A failed job still publishes manifest.json and report.html (workers/jobs.py), so both are
    made here, by the worker: the manifest the child left, read as a Manifest and written back
    with the worker's record of the layers, and the report drawn from it. A manifest that does
    not read as one is removed rather than published as the child (or a thread it left running)
    wrote it, and so is whatever report.html the child left. Never raises: the job's own error
    is the one to report."""
    try:
        with beneath.opened_dir(out_dir) as out_fd:
            _unlink_at(out_fd, "report.html")
            try:
                raw = beneath.read_bounded(out_fd, "manifest.json", MAX_MANIFEST_BYTES, "manifest.json")
                manifest = _child_manifest(json.loads(raw))
            except FileNotFoundError:
                return
            except (OSError, ValueError, RecursionError, errors.FxportError):  # a ValidationError is a ValueError
                _unlink_at(out_fd, "manifest.json")
                return
            manifest.sandbox = Sandbox.model_validate(box)
            beneath.replace_file(out_fd, "manifest.json", manifest.to_json().encode())
    except (OSError, errors.FxportError) as exc:
        log.warning("a failed job's manifest could not be rewritten: %s", exc)
        return
    draw_report(out_dir)


def _unlink_at(dir_fd: int, name: str) -> None:
    """Remove a file the child left; a name that is not a file stays (the upload refuses it)."""
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass


def draw_report(out_dir: Path) -> None:
    """report.html from out_dir/manifest.json, drawn here: the child may not start `dot`, so
    it leaves the report to this side, which runs `dot` confined (confine.confined_dot).
    The manifest is the child's (untrusted): it is read without following links and within
    MAX_MANIFEST_BYTES, every string in it is escaped by the report, and the report is written
    as a new file renamed into place. A report problem never fails the job."""
    from fxport.report import render_report
    from fxport.workers.sandbox.confine import confined_dot

    try:
        with beneath.opened_dir(out_dir) as out_fd:
            try:
                raw = beneath.read_bounded(out_fd, "manifest.json", MAX_MANIFEST_BYTES, "manifest.json")
            except FileNotFoundError:
                return
            manifest = json.loads(raw)
            if not isinstance(manifest, dict):
                return
            beneath.replace_file(out_fd, "report.html", render_report(manifest, layout=confined_dot).encode())
    except Exception as exc:
        log.warning("report.html could not be drawn: %s: %s", type(exc).__name__, exc)


def _count_failure(reason: str) -> None:
    """fxport_sandbox_failures_total{reason}; metrics are optional where prometheus isn't installed."""
    try:
        from fxport.metrics import METRICS
    except ImportError:
        return
    METRICS.record_sandbox_failure(reason)


def _child_error(raw: Any) -> errors.ErrorRecord:
    """The error the child reported, as a record whatever it wrote (the child is untrusted):
    strings cut to their limits, a malformed record read as a failed conversion."""
    try:
        record = errors.ErrorRecord.model_validate(raw if isinstance(raw, dict) else {})
    except ValidationError:
        record = errors.ErrorRecord(code="conversion_failed")
    return record.model_copy(update={
        "message": record.message[:4000] or "conversion failed",
        "stage": _str(record.stage), "detail": _str(record.detail), "field": _str(record.field),
    })


def _death_error(rc: int, stage: str, memory: int, timeout: float, log_tail: str) -> errors.FxportError:
    if rc < 0:
        sig = signal.Signals(-rc).name
        if -rc == signal.SIGXCPU:
            reason, why = "cpu_time", f"the model used up its {timeout:.0f} s CPU-time limit during {stage}"
        elif -rc in (signal.SIGKILL,) or "MemoryError" in log_tail or "std::bad_alloc" in log_tail:
            reason = "memory"
            why = f"the model exceeded {memory >> 20} MiB address space during {stage} (killed by {sig})"
        elif -rc == signal.SIGXFSZ:
            reason = "file_size"
            why = f"the model wrote a file larger than {MAX_FILE_BYTES >> 30} GiB during {stage}"
        else:
            reason, why = "signal", f"the sandbox process died with {sig} during {stage}"
    elif "MemoryError" in log_tail or "bad_alloc" in log_tail or "Cannot allocate memory" in log_tail:
        reason, why = "memory", f"the model exceeded {memory >> 20} MiB address space during {stage}"
    elif rc == 0:  # it ended itself (os._exit, sys.exit) before the engine wrote its result
        reason, why = "exit_code", f"the model ended the sandbox process during {stage} before the conversion finished"
    else:
        reason, why = "exit_code", f"the sandbox process exited with status {rc} during {stage}"
    _count_failure(reason)
    return errors.ResourceLimitExceeded(why, stage=stage, detail=log_tail[-2000:] or None,
                                        hint="raise spec.limits.memory_mb / timeout_s within the server maximum, "
                                        "or check the model")


def _validate_outputs(manifest: Manifest, out_dir: Path, max_bytes: int) -> None:
    """The child's files are untrusted: every file beneath out_dir must be a regular file
    (no link, FIFO or hard link anywhere), at most MAX_OUTPUT_FILES of them, and each artifact
    the manifest lists must be there with the size (fstat, before a byte is read; `max_bytes` in
    all) and sha256 it states."""
    from fxport.digest import sha256_file

    with beneath.opened_dir(out_dir) as out_fd:
        files = {f.name: f for f in beneath.walk_files(out_fd, strict=True, max_files=MAX_OUTPUT_FILES)}
        try:
            listed = []
            for art in manifest.artifacts:
                name = art.path
                if name not in files:
                    raise errors.ConversionFailed(f"sandbox produced an invalid artifact path {name!r}", stage="upload")
                if files[name].size != art.bytes:
                    raise errors.ConversionFailed(f"artifact {name!r} does not match its recorded digest: "
                                                  f"{files[name].size} bytes, recorded {art.bytes}", stage="upload")
                listed.append((art, files[name]))
            total = sum(f.size for f in files.values())
            if total > max_bytes:
                raise errors.ResourceLimitExceeded(
                    f"the job's outputs come to {total} bytes; the bound is {max_bytes} (FXPORT_MAX_JOB_OUTPUT_BYTES)",
                    stage="upload")
            # Several artifacts hashed at once (hashlib lets go of the GIL): this is on every job's critical path.
            with ThreadPoolExecutor(max_workers=max(1, min(4, len(listed)))) as pool:
                digests = list(pool.map(lambda pair: sha256_file(pair[1].path), listed))
            for (art, _f), (digest, size) in zip(listed, digests):
                if size != art.bytes or digest != art.sha256:
                    raise errors.ConversionFailed(f"artifact {art.path!r} does not match its recorded digest",
                                                  stage="upload")
        finally:
            for f in files.values():
                f.close()
