"""weights.safetensors: every tensor the module reads, stored once, dense, without pickle."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from fxport.errors import ConversionFailed
from fxport.workers.engine.exporters.fx_source.common import _HINT, WEIGHTS_FILE, _first_line


def _dedupe(slots: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(name -> tensor to store, alias -> stored name): a tensor reachable under several names (tied
    weights) is stored once, under the first. Tensors that merely overlap are stored each on its own."""
    stored: dict[str, torch.Tensor] = {}
    tied: dict[str, str] = {}
    first: dict[tuple[Any, ...], str] = {}
    for name, tensor in slots.items():
        t = tensor.detach()
        key = (t.device, t.dtype, t.untyped_storage().data_ptr() if t.numel() else id(tensor), t.storage_offset(),
               tuple(t.shape), t.stride())
        if key in first:
            tied[name] = first[key]
        else:
            first[key] = name
            stored[name] = t
    return stored, tied


def _save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    try:
        from safetensors.torch import save_file
    except ImportError as exc:
        raise ConversionFailed("fx_source needs the 'safetensors' package on the worker to write its weights",
                               stage="export", hint=f"install fxport[engine] (it brings safetensors); or {_HINT}"
                               ) from exc

    out: dict[str, torch.Tensor] = {}
    seen_storage: set[int] = set()
    for name, t in tensors.items():
        if t.is_sparse or t.layout != torch.strided or t.is_quantized or t.device.type == "meta":
            raise ConversionFailed(
                f"fx_source: tensor {name!r} ({t.layout}, {t.dtype}, {t.device.type}) cannot be stored in "
                f"{WEIGHTS_FILE}: safetensors holds dense tensors only", stage="export",
                hint=f"keep such tensors out of the graph (dequantize or densify them in the model); or {_HINT}")
        t = t.cpu()
        ptr = t.untyped_storage().data_ptr() if t.numel() else 0
        # save_file refuses two entries over one storage (views, slices): those get their own copy
        if not t.is_contiguous() or (ptr and ptr in seen_storage):
            t = t.contiguous().clone()
        if ptr:
            seen_storage.add(ptr)
        out[name] = t
    try:
        save_file(out, str(path), metadata={"format": "pt"})
    except Exception as exc:
        raise ConversionFailed(f"fx_source: {WEIGHTS_FILE} could not be written: {type(exc).__name__}: "
                               f"{_first_line(exc)}", stage="export", hint=_HINT) from exc
