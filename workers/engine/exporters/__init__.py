"""Exporters: lazy loaders named <Output>From<Input>; constructing one does nothing, calling it writes.

`REGISTRY` (registry.py) names every export target: its path, its exporters (from the graph, and
from the eager model where one exists), its verification runner. Heavy imports (onnx) live only in
the exporter modules that need them.
"""

from fxport.workers.engine.exporters.registry import REGISTRY, Target

__all__ = ["REGISTRY", "Target"]
