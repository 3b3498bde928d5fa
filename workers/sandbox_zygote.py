"""The warm sandbox parent: imports the ML stack once, then forks one child per job.

Protocol (JSON lines): stdin `{"job", "request", "log", "env"}`; stdout `{"job", "started": pid}`
then `{"job", "status": exit code or -signal}`. It is started with the scrubbed environment and
never runs a torch op itself, so its children inherit no credentials and no busy thread pool.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import traceback

_out_lock = threading.Lock()


def _say(msg: dict) -> None:
    with _out_lock:
        sys.stdout.write(json.dumps(msg) + "\n")
        sys.stdout.flush()


def _child(req: dict) -> None:
    """In the forked child: never returns."""
    code = 70
    try:
        os.setsid()
        log = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.chdir(os.path.dirname(req["request"]))
        os.environ.clear()
        os.environ.update(req["env"])
        tempfile.tempdir = None  # re-read TMPDIR: the job's private temp dir
        from fxport.workers.sandbox_child import run_request

        code = run_request(req["request"])
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _reap(job: int, pid: int) -> None:
    _, status = os.waitpid(pid, 0)
    _say({"job": job, "status": os.waitstatus_to_exitcode(status)})


def warm_up() -> None:
    """Pay every first-call cost once, here, instead of in every job.

    torch.export.load imports ~1300 modules on first use (sympy, dynamo, serde) and the ONNX
    exporter builds its op registry on first export: ~2.4 s per job if left to the children
    (measured, bench/bench_sandbox.py). The warm-up runs single-threaded: a parent that ran a
    multithreaded op before forking can leave children hanging in torch's thread pool.
    """
    import warnings

    import torch

    torch.set_num_threads(1)
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


def main() -> None:
    # Import everything a job needs once; forked children share these pages copy-on-write.
    import logging

    import onnx  # noqa: F401
    import onnxruntime  # noqa: F401
    import torch  # noqa: F401

    import fxport.workers.engine.pipeline  # noqa: F401
    import fxport.workers.sandbox_child  # noqa: F401
    from fxport.workers.engine.exporters import exported_program, fx_source, onnx as onnx_exp, torchscript  # noqa: F401
    from fxport.workers.engine.verify import runners  # noqa: F401

    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    try:
        warm_up()
    except Exception:  # a failed warm-up only costs speed
        traceback.print_exc()
    _say({"ready": True})
    for line in sys.stdin:
        req = json.loads(line)
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            _child(req)
        _say({"job": req["job"], "started": pid})
        threading.Thread(target=_reap, args=(req["job"], pid), daemon=True).start()


if __name__ == "__main__":
    main()
