"""What the worker and the sandbox child say to each other: the request, and the result.

`SandboxRequest`: the engine's request and the child's own terms.

Written by the worker as `request.json` in the child's private folder and read back by the child
(sandbox/child.py) as this type, before it applies its layers. The engine's part is the
`EngineRequest` the worker built; the rest says how the child is bounded. Whether the child may
reach a GPU and whether its address space is capped follow from the engine's request (a
TensorRT build needs the GPU and maps far more address space than it uses), so they are derived
here, not written twice.

`SandboxResult`: what the child answers, as `result.json` in its folder: the run's manifest, or
the error that ended it. The worker reads it as untrusted data (sandbox/run.py), bounded before
it is typed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from fxport.errors import ErrorRecord
from fxport.manifest import Manifest
from fxport.workers.engine.request import EngineRequest


class SandboxLimits(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    memory_bytes: int
    cpu_seconds: int
    isolate_network: bool = True


class SandboxRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    engine: EngineRequest
    limits: SandboxLimits
    events_path: Path
    readable: list[Path]  # the job's inputs the child may read (its folders are writable to it)
    require: list[str]  # layers without which the model must not run (run.required_layers)
    # custom op libraries the child loads, once confined, before it opens the model (FXPORT_OP_LIBRARIES):
    # absolute paths of shared libraries (each also in `readable`) and module names, in order
    op_libraries: list[str] = []

    @property
    def gpu(self) -> bool:
        return self.engine.builds_tensorrt

    @property
    def limit_address_space(self) -> bool:
        return not self.engine.builds_tensorrt


class SandboxResult(BaseModel):
    """The child's answer: `manifest` when the run succeeded, `error` when it did not."""

    model_config = ConfigDict(frozen=True)

    ok: bool
    manifest: Manifest | None = None
    error: ErrorRecord | None = None

    def to_data(self) -> dict[str, Any]:
        """result.json's content: the manifest in manifest.json's own form (Manifest.to_dict)."""
        return {"ok": self.ok, "manifest": self.manifest.to_dict() if self.manifest else None,
                "error": self.error.model_dump() if self.error else None}
