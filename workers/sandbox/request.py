"""What the worker hands the sandbox child: the engine's request and the child's own terms.

Written by the worker as `request.json` in the child's private folder and read back by the child
(sandbox/child.py) as this type, before it applies its layers. The engine's part is the
`EngineRequest` the worker built; the rest says how the child is bounded. Whether the child may
reach a GPU and whether its address space is capped follow from the engine's request (a
TensorRT build needs the GPU and maps far more address space than it uses), so they are derived
here, not written twice.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict

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

    @property
    def gpu(self) -> bool:
        return self.engine.builds_tensorrt

    @property
    def limit_address_space(self) -> bool:
        return not self.engine.builds_tensorrt
