"""Exporters: lazy loaders named <Output>From<Input>; constructing one does nothing, calling it writes.

Heavy imports (onnx) live only in the exporter modules that need them.
"""

from __future__ import annotations

import hashlib
from pathlib import Path


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
