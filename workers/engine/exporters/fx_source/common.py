"""What every part of the fx_source exporter shares: the names of the files and the class it writes,
the hint its errors end with, Python literals of plain values, and how objects and errors are named."""

from __future__ import annotations

import importlib
import importlib.util
import math
from typing import Any

import torch

MODULE_CLASS = "FxportModule"
WEIGHTS_FILE = "weights.safetensors"
_HINT = "drop 'fx_source' from targets to get the other artifacts"


class _NotLiteral(Exception):
    pass


def _literal(value: Any) -> str:
    """Python source that evaluates to `value` (with `torch` imported)."""
    if value is None or isinstance(value, (bool, int, str)):
        return repr(value)
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else f'float("{value}")'
    if isinstance(value, torch.Size):
        return f"torch.Size({_literal(list(value))})"
    if isinstance(value, tuple) and type(value) is tuple:
        items = [_literal(v) for v in value]
        return f"({items[0]},)" if len(items) == 1 else f"({', '.join(items)})"
    if isinstance(value, list) and type(value) is list:
        return f"[{', '.join(_literal(v) for v in value)}]"
    if isinstance(value, dict) and type(value) is dict and all(isinstance(k, str) for k in value):
        return "{" + ", ".join(f"{k!r}: {_literal(v)}" for k, v in value.items()) + "}"
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, torch.device):
        return f"torch.device({str(value)!r})"
    raise _NotLiteral(f"{type(value).__module__}.{type(value).__qualname__}")


def _resolve(module: str, qualname: str) -> Any:
    try:
        obj: Any = importlib.import_module(module)
        for part in qualname.split(".") if qualname else ():
            obj = getattr(obj, part)
        return obj
    except Exception:
        return None


def _describe(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__qualname__)}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else ""
