"""Exporters: lazy loaders named <Output>From<Input>; constructing one does nothing, calling it writes.

`REGISTRY` (registry.py) names every target: its path, its exporters (from the graph, and from the
eager model where one exists), its verification runner — or, for a target built after the CPU stage
from the ONNX model (the TensorRT engine), its `LaterStage`. Its docstring says how to add a target.
Heavy imports (onnx) live only in the exporter modules that need them.
"""

from fxport.workers.engine.exporters.registry import REGISTRY, LaterStage, Target

__all__ = ["REGISTRY", "LaterStage", "Target"]
