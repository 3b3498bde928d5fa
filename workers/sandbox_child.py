"""The sandbox child: apply limits, leave the network, run the engine on request.json, write result.json.

Runs either as a fresh interpreter (`python -m fxport.workers.sandbox_child request.json`)
or forked from the warm zygote (`run_request`); everything the model can touch starts here.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any


def run_request(request_path: str) -> int:
    request = json.loads(Path(request_path).read_text())
    work = Path(request_path).parent

    from fxport.workers.sandbox import apply_limits

    limits = request["limits"]
    address_space = limits.get("limit_address_space", True)
    isolated = apply_limits(limits["memory_bytes"], limits["cpu_seconds"], limits["isolate_network"], address_space)
    from fxport.workers.sandbox_confine import confine

    # No new processes, writes only here and to out_dir, no TCP, no capabilities (still one thread).
    confinement = confine([work, Path(request["out_dir"])])
    sandbox_info = {"network_isolated": isolated,
                    "memory_limit_mb": limits["memory_bytes"] >> 20 if address_space else None,
                    "cpu_limit_s": limits["cpu_seconds"], **confinement}

    import torch

    # A child forked from a parent that ran a multithreaded op can hang in torch's thread pool
    # (ENVIRONMENT.md); setting the thread count first thing avoids it.
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    events = open(request["events_path"], "w", buffering=1) if request.get("events_path") else None

    def on_progress(event: dict[str, Any]) -> None:
        if events:
            events.write(json.dumps(event) + "\n")

    from fxport.errors import FxportError
    from fxport.spec import JobSpec
    from fxport.workers.engine.pipeline import convert

    try:
        manifest = convert(
            Path(request["model_path"]), JobSpec.model_validate(request["spec"]), Path(request["out_dir"]),
            job_id=request.get("job_id"),
            calibration_path=Path(request["calibration_path"]) if request.get("calibration_path") else None,
            on_progress=on_progress,
            deferred_targets=request.get("deferred_targets") or (),
            input_sha256=request.get("input_sha256"),
            report=False,  # drawn by the parent, which may start `dot` (workers/sandbox.py)
            **_timing_cache_paths(request.get("timing_cache")),
        )
        manifest["sandbox"] = sandbox_info
        result: dict[str, Any] = {"ok": True, "manifest": manifest}
    except FxportError as exc:
        result = {"ok": False, "error": {**exc.to_dict(), "message": str(exc)}}
    except MemoryError:
        result = {"ok": False, "error": {"code": "resource_limit", "stage": None,
                                         "message": "the model ran out of its memory limit"}}
    except Exception as exc:
        traceback.print_exc()
        result = {"ok": False, "error": {"code": "conversion_failed", "stage": None,
                                         "message": f"internal error: {type(exc).__name__}: {exc}"}}
    result["sandbox"] = sandbox_info
    (work / "result.json").write_text(json.dumps(result, default=str))
    if events:
        events.close()
    return 0


def _timing_cache_paths(cache: dict[str, str] | None) -> dict[str, Path]:
    if not cache:
        return {}
    return {"timing_cache_path": Path(cache["read"]), "timing_cache_out": Path(cache["write"])}


if __name__ == "__main__":
    if os.environ.get("FXPORT_SANDBOX_PARENT"):  # a cold child: it dies with the worker that started it
        from fxport.workers.sandbox_confine import die_with_parent

        die_with_parent(int(os.environ["FXPORT_SANDBOX_PARENT"]))
    sys.exit(run_request(sys.argv[1]))
