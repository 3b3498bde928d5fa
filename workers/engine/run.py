"""One conversion's bookkeeping, as every stage of the engine sees it: the request, the manifest
being built, each stage's timing and the error it names, and the progress events.

pipeline.py makes one `Run` per conversion and hands it to each stage (precision.py, publish.py,
onnx_input.py, later_stage.py, package.py, verify/stage.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fxport.errors import ConversionFailed, FxportError, ResourceLimitExceeded
from fxport.manifest import Manifest
from fxport.spec import JobSpec
from fxport.workers.engine.request import EngineRequest

ProgressFn = Callable[[dict[str, Any]], None]


class Run:
    """Per-conversion bookkeeping: the request, the manifest being built, stage timings, progress events."""

    def __init__(self, request: EngineRequest, manifest: Manifest, on_progress: ProgressFn | None) -> None:
        self.request, self.manifest, self.on_progress = request, manifest, on_progress

    @property
    def spec(self) -> JobSpec:
        return self.request.spec

    @property
    def out_dir(self) -> Path:
        return self.request.out_dir

    def warn(self, message: str) -> None:
        self.manifest.warnings.append(message)

    def emit(self, stage: str, progress: float, message: str = "") -> None:
        if self.on_progress:
            self.on_progress({"stage": stage, "progress": round(progress, 3), "message": message})

    @contextmanager
    def stage(self, name: str, message: str = "") -> Iterator[None]:
        self.emit(name, 0.0, message)
        start = time.perf_counter()
        try:
            yield
        except FxportError as exc:
            exc.stage = exc.stage or name
            raise
        except MemoryError as exc:
            raise ResourceLimitExceeded(f"the model ran out of its memory limit during {name}", stage=name) from exc
        except Exception as exc:
            raise ConversionFailed(f"{name} failed: {type(exc).__name__}: {exc}", stage=name) from exc
        finally:
            self.manifest.timings_s[name] = round(time.perf_counter() - start, 4)
        self.emit(name, 1.0, "done")
