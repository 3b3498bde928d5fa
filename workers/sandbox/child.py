"""The sandbox child: take nothing inherited, apply the layers, report them, then run the engine.

Runs either as a fresh interpreter (`python -m fxport.workers.sandbox.child request.json`) or
forked from the warm zygote (`run_request`). Everything before `_report_layers` is fxport's own
code with no byte of the model read yet: the layer report it sends is the first line on the
events channel, and the worker takes only that line as the child's word on its layers
(sandbox/run.py). After it, nothing the child says about itself is believed.

The operator's custom op libraries (FXPORT_OP_LIBRARIES: torchvision's ops, a shared library of
one's own) are loaded after the layers are applied and before the model is opened, so their own
start-up code runs confined too (`load_op_libraries`).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# What a job must have before the model runs (request["require"]): a layer's name → the keys of
# `confine`'s report that make it up.
LAYERS = {
    "seccomp": ("no_new_processes", "sockets_blocked"),
    "landlock": ("filesystem_reads_confined", "filesystem_writes_confined"),
    "network_namespace": ("network_isolated",),
}


def missing_layers(info: dict[str, Any], required: list[str]) -> list[str]:
    return [name for name in required if not all(info.get(key) for key in LAYERS.get(name, (name,)))]


def run_request(request_path: str) -> int:
    # Nothing from whoever started us but stdin (/dev/null), stdout and stderr (the job's log).
    os.closerange(3, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    from fxport.errors import ErrorRecord
    from fxport.workers.sandbox.request import SandboxRequest, SandboxResult

    request = SandboxRequest.model_validate_json(Path(request_path).read_bytes())  # the worker's own words
    work = Path(request_path).parent
    events = os.open(request.events_path, os.O_WRONLY | os.O_CLOEXEC)

    from fxport.workers.sandbox.confine import apply_limits, bound_tasks, confine, inherited_state

    started = time.perf_counter()
    limits = request.limits
    isolated = apply_limits(limits.memory_bytes, limits.cpu_seconds, limits.isolate_network,
                            request.limit_address_space)
    bound_tasks()  # before confine, which leaves the job's cgroup out of reach; the worker records it
    info = {"network_isolated": isolated,
            **confine([work, request.engine.out_dir], request.readable, gpu=request.gpu)}
    problems = inherited_state({0, 1, 2, events})
    info["inherited_state_clean"] = not problems
    missing = missing_layers(info, request.require)
    info["setup_ms"] = round((time.perf_counter() - started) * 1000, 2)  # what the layers cost this job
    _report_layers(events, info)
    if problems or missing:
        # Fail closed, before the model is opened: this result is still fxport's own word.
        errors = "; ".join(info.get("errors", ()))
        why = ("; ".join(problems) if problems else
               f"the {', '.join(missing)} layer(s) the worker requires could not be applied"
               + (f" ({errors})" if errors else "") + ". An operator may run jobs without a layer by leaving it "
               "out of FXPORT_SANDBOX_REQUIRE (default seccomp,landlock); `fxport convert --no-sandbox` runs a "
               "model you trust in your own process")
        refused = ErrorRecord(code="sandbox_unavailable", stage="load",
                              message=f"the sandbox refused to run the model: {why}")
        _write_result(work, SandboxResult(ok=False, error=refused).to_data())
        return 0

    import torch

    # A child forked from a parent that ran a multithreaded op can hang in torch's thread pool
    # (seen with torch 2.13 on Linux); setting the thread count first thing avoids it.
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    stream = os.fdopen(events, "w", buffering=1)

    def on_progress(event: dict[str, Any]) -> None:
        stream.write(json.dumps(event) + "\n")

    from fxport.errors import FxportError
    from fxport.text import cause_chain
    from fxport.workers.engine.pipeline import convert_request

    try:
        load_op_libraries(request.op_libraries)  # confined already: their own start-up code runs in the sandbox
        # report.html is drawn by the parent, which may start `dot` (sandbox/run.py)
        result = SandboxResult(ok=True, manifest=convert_request(request.engine, on_progress=on_progress,
                                                                 report=False))
    except FxportError as exc:
        result = SandboxResult(ok=False, error=exc.record())
    except MemoryError:
        result = SandboxResult(ok=False, error=ErrorRecord(code="resource_limit",
                                                           message="the model ran out of its memory limit"))
    except Exception as exc:
        traceback.print_exc()
        result = SandboxResult(ok=False, error=ErrorRecord(
            code="conversion_failed", message=f"internal error: {type(exc).__name__}: {exc}",
            detail=cause_chain(exc)))
    _write_result(work, result.to_data())
    stream.close()
    return 0


def load_op_libraries(entries: Sequence[str]) -> None:
    """Load the custom op libraries (FXPORT_OP_LIBRARIES) into this process, in order, and note
    them for its manifest (fxport.toolchain.note_op_libraries): a shared library (an absolute
    path) with torch.ops.load_library, a module by importing it, which registers its ops
    (torchvision: torchvision::nms, roi_align, ...). Raises ConversionFailed naming the entry
    that could not be loaded and what to do; nothing of the model has been read yet."""
    if not entries:
        return
    import importlib

    import torch

    from fxport.errors import ConversionFailed
    from fxport.toolchain import note_op_libraries, op_library_records

    for entry in entries:
        try:
            if entry.startswith("/"):
                torch.ops.load_library(entry)
            else:
                importlib.import_module(entry)
        except Exception as exc:  # OSError (dlopen), ImportError, or whatever the library's start-up raised
            where = ("a shared library readable by the worker, built for this torch"
                     if entry.startswith("/") else "a module installed in the worker's Python environment")
            raise ConversionFailed(
                f"the op library {entry!r} (FXPORT_OP_LIBRARIES) could not be loaded: {type(exc).__name__}: "
                f"{str(exc)[:500]}", stage="load", field="FXPORT_OP_LIBRARIES",
                hint=f"an operator makes each entry {where}, or removes it from FXPORT_OP_LIBRARIES") from exc
    note_op_libraries(op_library_records(entries))


def _report_layers(events: int, info: dict[str, Any]) -> None:
    os.write(events, (json.dumps({"sandbox": info}) + "\n").encode())


def _write_result(work: Path, result: dict[str, Any]) -> None:
    """result.json: SandboxResult.to_data() (a plain mapping the worker reads as untrusted data)."""
    (work / "result.json").write_text(json.dumps(result, default=str))


if __name__ == "__main__":
    if os.environ.get("FXPORT_SANDBOX_PARENT"):  # a cold child: it dies with the worker that started it
        from fxport.workers.sandbox.confine import die_with_parent

        die_with_parent(int(os.environ["FXPORT_SANDBOX_PARENT"]))
    exit_code = run_request(sys.argv[1])
    # result.json and the events are written and closed. The interpreter's own teardown, freeing
    # what torch and the exporters built, is a large share of a small job while the worker or
    # `fxport convert` waits on the exit (docs/benchmarks.md, "Costs the code is shaped around"):
    # skip it, as the zygote's forked children do. The model may have swapped the streams: flush
    # those and the originals.
    for stream in {id(s): s for s in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__) if s}.values():
        try:
            stream.flush()
        except Exception:  # noqa: S110 - a stream the model broke loses its tail, not the result
            pass
    os._exit(exit_code)
