"""Entry point of the sandbox child process: run the engine on request.json, write result.json."""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path


def main(request_path: str) -> int:
    request = json.loads(Path(request_path).read_text())
    work = Path(request_path).parent
    event_fd = int(os.environ.get("FXPORT_SANDBOX_EVENT_FD", "-1"))
    events = os.fdopen(event_fd, "w", buffering=1) if event_fd >= 0 else None

    def on_progress(event: dict) -> None:
        if events:
            events.write(json.dumps(event) + "\n")

    from fxport.workers.sandbox import apply_limits

    limits = request["limits"]
    isolated = apply_limits(limits["memory_bytes"], limits["cpu_seconds"], limits["isolate_network"])
    sandbox_info = {"network_isolated": isolated, "memory_limit_mb": limits["memory_bytes"] >> 20,
                    "cpu_limit_s": limits["cpu_seconds"]}

    from fxport.errors import FxportError
    from fxport.spec import JobSpec
    from fxport.workers.engine.pipeline import convert

    try:
        manifest = convert(
            Path(request["model_path"]), JobSpec.model_validate(request["spec"]), Path(request["out_dir"]),
            job_id=request.get("job_id"),
            calibration_path=Path(request["calibration_path"]) if request.get("calibration_path") else None,
            on_progress=on_progress,
        )
        manifest["sandbox"] = sandbox_info
        result = {"ok": True, "manifest": manifest}
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


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
