"""Calibration data for int8: a user's file of named input tensors, or seeded random samples.

File formats, detected by content (the stored upload has no trustworthy name):
- `.npz` (numpy zip; read with allow_pickle=False, so object arrays are refused),
- safetensors (read with `safetensors.torch`, never unpickling anything).
One array per model input, keyed by the input's name. Layouts, the same for every input:
- the input's own rank, when its dim 0 is the dynamic batch dim: dim 0 counts samples
  (any number) and is fed in batches of the batch dim's `opt` size;
- one extra leading dim `[samples, *input shape]`: each sample is one model call.
Every other dim must match the input: static dims exactly, dynamic dims within their range.

Part of the samples is held out: the quantize stage calibrates on the rest and measures
accuracy (the per-layer report, the fallback, int8 verification) on the held-out part only.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fxport.errors import InvalidInput
from fxport.spec import CalibrationSpec
from fxport.workers.engine.inputs import _DTYPES, InputSignature

HOLD_OUT_FRACTION = 0.25
MIN_HELD_OUT_RANDOM = 8  # random data: at least this many held-out samples


@dataclass
class CalibrationData:
    calibration: list[tuple[torch.Tensor, ...]]  # model calls (batches), in order
    held_out: list[tuple[torch.Tensor, ...]]
    info: dict[str, Any]  # manifest["quantization"]["calibration"]
    warnings: list[str] = field(default_factory=list)


def _fail(message: str, hint: str | None = None) -> InvalidInput:
    return InvalidInput(message, stage="quantize", field="calibration", hint=hint)


def batch_size(sig: InputSignature) -> int:
    """How many samples one calibration call carries: the batch dim's opt size (1 when static)."""
    dim = batch_dim_name(sig)
    if dim is None:
        return 1
    rng = sig.dynamic_dims[dim]
    return max(rng.min, min(rng.opt, rng.max))


def batch_dim_name(sig: InputSignature) -> str | None:
    """The dynamic dim that is dim 0 of every input, if there is one."""
    names = {i.shape[0] if i.shape and isinstance(i.shape[0], str) else None for i in sig.inputs}
    if len(names) == 1:
        name = names.pop()
        return name if name in sig.dynamic_dims else None
    return None


# --------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------


def read_tensor_file(path: Path) -> dict[str, torch.Tensor]:
    """Named tensors from an .npz or safetensors file, told apart by their first bytes."""
    with path.open("rb") as fh:
        head = fh.read(16)
    if head.startswith(b"PK\x03\x04") or head.startswith(b"PK\x05\x06"):
        return _read_npz(path)
    if len(head) >= 9:
        (header_len,) = struct.unpack("<Q", head[:8])
        if 0 < header_len < (100 << 20) and head[8:9] == b"{":
            return _read_safetensors(path)
    raise _fail(
        "the calibration file is neither .npz nor safetensors",
        hint="save one array per model input, keyed by input name: np.savez('calib.npz', x=array) "
        "or safetensors.numpy.save_file({'x': array}, 'calib.safetensors')",
    )


def _read_npz(path: Path) -> dict[str, torch.Tensor]:
    import numpy as np

    out: dict[str, torch.Tensor] = {}
    try:
        with np.load(str(path), allow_pickle=False) as archive:
            for name in archive.files:
                try:
                    array = archive[name]
                except ValueError as exc:  # object arrays need pickle, which is refused
                    raise _fail(f"calibration array {name!r} is not a plain numeric array ({exc})",
                                hint="store numeric arrays only (no Python objects)") from None
                out[name] = _from_numpy(name, array)
    except InvalidInput:
        raise
    except Exception as exc:
        raise _fail(f"the calibration .npz file cannot be read: {type(exc).__name__}: {exc}") from None
    return out


def _from_numpy(name: str, array: Any) -> torch.Tensor:
    import numpy as np

    if array.dtype.kind not in "biuf":
        raise _fail(f"calibration array {name!r} has dtype {array.dtype}; expected a numeric or bool array")
    if array.dtype == np.float16 or array.dtype.kind in "biu" or array.dtype in (np.float32, np.float64):
        return torch.from_numpy(np.ascontiguousarray(array))
    return torch.from_numpy(np.ascontiguousarray(array.astype(np.float64)))


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        from safetensors.torch import load_file
    except ImportError as exc:  # pragma: no cover - installed with the worker extra
        raise _fail("safetensors calibration files need the 'safetensors' package on the worker") from exc
    try:
        return dict(load_file(str(path)))
    except Exception as exc:
        raise _fail(f"the calibration safetensors file cannot be read: {type(exc).__name__}: {exc}") from None


# --------------------------------------------------------------------------------------
# Validation against the input signature
# --------------------------------------------------------------------------------------


def validate_tensors(
    tensors: dict[str, torch.Tensor], sig: InputSignature
) -> tuple[list[tuple[torch.Tensor, ...]], str, list[str]]:
    """Check names, dtypes and shapes; return one tuple per sample, the layout, and notes.

    Each returned sample holds one tensor per input in signature order, with the input's
    rank ("batch" layout: a batch of one sample; "samples" layout: one full model call).
    """
    expected = [i.name for i in sig.inputs]
    extra = sorted(set(tensors) - set(expected))
    missing = [n for n in expected if n not in tensors]
    if extra:
        raise _fail(
            f"the calibration file has {', '.join(map(repr, extra))}, which "
            f"{'is not an input' if len(extra) == 1 else 'are not inputs'} of the model "
            f"(its inputs: {', '.join(expected)})",
            hint="key each array by the model input it feeds",
        )
    if missing:
        raise _fail(
            f"the calibration file has no array for input {', '.join(map(repr, missing))} "
            f"(it has: {', '.join(sorted(tensors)) or 'nothing'})",
            hint="store one array per model input, keyed by the input's name",
        )
    notes: list[str] = []
    batch_dim = batch_dim_name(sig)
    layouts: dict[str, str] = {}
    counts: dict[str, int] = {}
    converted: dict[str, torch.Tensor] = {}
    for inp in sig.inputs:
        t = tensors[inp.name]
        want = _DTYPES[inp.dtype]
        converted[inp.name], note = _check_dtype(inp.name, t, want, inp.dtype)
        if note:
            notes.append(note)
        rank = len(inp.shape)
        shape = list(t.shape)
        if len(shape) == rank + 1:
            layouts[inp.name], counts[inp.name] = "samples", shape[0]
            _check_dims(inp, shape[1:], sig, skip_first=False, leading=1)
        elif len(shape) == rank and batch_dim is not None and rank > 0:
            layouts[inp.name], counts[inp.name] = "batch", shape[0]
            _check_dims(inp, shape, sig, skip_first=True, leading=0)
        else:
            layout_hint = (f"{_fmt(inp.shape)} with dim 0 counting samples, or " if batch_dim is not None else "")
            raise _fail(
                f"calibration input {inp.name!r} has shape {shape} (rank {len(shape)}); the model's input is "
                f"{_fmt(inp.shape)}: expected {layout_hint}[samples, {', '.join(map(str, inp.shape))}]",
                hint="add a leading samples dimension: np.stack(list_of_inputs)",
            )
        if not converted[inp.name].dtype == torch.bool and converted[inp.name].is_floating_point():
            if not bool(torch.isfinite(converted[inp.name]).all()):
                raise _fail(f"calibration input {inp.name!r} contains NaN or Inf values")
    if len(set(layouts.values())) > 1:
        raise _fail(
            "calibration inputs mix layouts: " + ", ".join(f"{n} {layout}" for n, layout in layouts.items())
            + " — give every input the same extra leading samples dim, or none",
        )
    if len(set(counts.values())) > 1:
        raise _fail(
            "calibration inputs hold different numbers of samples: "
            + ", ".join(f"{n}: {c}" for n, c in counts.items()),
            hint="every input needs one entry per sample",
        )
    layout = next(iter(layouts.values()))
    n = next(iter(counts.values()))
    if layout == "batch":
        samples = [tuple(converted[name][i:i + 1] for name in expected) for i in range(n)]
    else:
        samples = [tuple(converted[name][i] for name in expected) for i in range(n)]
    for idx, sample in enumerate(samples):
        _check_consistent(sample, sig, idx, layout)
    return samples, layout, notes


def _check_dtype(name: str, t: torch.Tensor, want: torch.dtype, want_name: str) -> tuple[torch.Tensor, str]:
    if t.dtype == want:
        return t, ""
    if t.is_floating_point() and want.is_floating_point:
        return t.to(want), f"calibration input {name!r} was {str(t.dtype).replace('torch.', '')}; cast to {want_name}"
    got = str(t.dtype).replace("torch.", "")
    raise _fail(
        f"calibration input {name!r} has dtype {got}; the model expects {want_name}",
        hint=f"convert it, e.g. array.astype('{want_name}')" if want != torch.bool else "store it as a bool array",
    )


def _check_dims(inp: Any, shape: list[int], sig: InputSignature, *, skip_first: bool, leading: int) -> None:
    for i, (got, want) in enumerate(zip(shape, inp.shape)):
        if skip_first and i == 0:
            continue
        where = i + leading
        if isinstance(want, int):
            if got != want:
                raise _fail(
                    f"calibration input {inp.name!r} dim {where} is {got}; the model expects {want} there "
                    f"(input shape {_fmt(inp.shape)})",
                )
        else:
            rng = sig.dynamic_dims.get(want)
            if rng is not None and not (rng.min <= got <= rng.max):
                raise _fail(
                    f"calibration input {inp.name!r} dim {where} ({want!r}) is {got}, outside the spec's range "
                    f"{want} in [{rng.min}, {rng.max}]",
                    hint=f"use samples with {want} between {rng.min} and {rng.max}, or widen dynamic_dims.{want}",
                )


def _check_consistent(sample: tuple[torch.Tensor, ...], sig: InputSignature, idx: int, layout: str) -> None:
    """A dynamic dim named in several inputs must have one size within a model call."""
    seen: dict[str, tuple[int, str]] = {}
    for t, inp in zip(sample, sig.inputs):
        for i, want in enumerate(inp.shape):
            if not isinstance(want, str) or (layout == "batch" and i == 0):
                continue
            size = int(t.shape[i])
            if want in seen and seen[want][0] != size:
                raise _fail(
                    f"calibration sample {idx}: dim {want!r} is {seen[want][0]} in input {seen[want][1]!r} "
                    f"but {size} in input {inp.name!r}",
                )
            seen[want] = (size, inp.name)


def _fmt(shape: list[Any]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


# --------------------------------------------------------------------------------------
# The calibration set
# --------------------------------------------------------------------------------------


def load_calibration(path: Path | None, sig: InputSignature, spec: CalibrationSpec, seed: int) -> CalibrationData:
    """The calibration and held-out batches for a job: from `path`, or seeded random samples."""
    bs = batch_size(sig)
    if path is None:
        return _random(sig, spec, seed, bs)
    tensors = read_tensor_file(path)
    samples, layout, notes = validate_tensors(tensors, sig)
    n = len(samples)
    if n < 2:
        raise _fail(
            f"the calibration file holds {n} sample; at least 2 are needed, one to calibrate and one held out "
            "to measure accuracy on",
            hint="give more samples (dim 0 counts them)",
        )
    held = max(1, int(round(n * HOLD_OUT_FRACTION)))
    used = min(spec.samples, n - held)
    cal_samples, held_samples = samples[:used], samples[n - held:]
    info = {
        "source": "file", "layout": layout, "file_samples": n, "samples": used, "held_out": held,
        "batch_size": bs if layout == "batch" else 1, "observer": spec.observer,
        "held_out_note": f"the last {held} of {n} samples are held out: accuracy figures come from them only",
    }
    if used < n - held:
        info["unused"] = n - held - used
    return CalibrationData(_batches(cal_samples, layout, bs), _batches(held_samples, layout, bs), info, notes)


def _batches(samples: list[tuple[torch.Tensor, ...]], layout: str, bs: int) -> list[tuple[torch.Tensor, ...]]:
    if layout == "samples":
        return [tuple(t.contiguous() for t in s) for s in samples]
    out = []
    for start in range(0, len(samples), bs):
        chunk = samples[start:start + bs]
        out.append(tuple(torch.cat([s[i] for s in chunk], 0) for i in range(len(chunk[0]))))
    return out


RANDOM_WARNING = (
    "int8 calibration used {n} seeded random samples, not real data: the activation ranges, the "
    "per-layer errors and the accuracy figures reflect random inputs and can be far off for real ones — "
    "pass calibration data (--calibration FILE: .npz or .safetensors, one array per input)"
)


def _random(sig: InputSignature, spec: CalibrationSpec, seed: int, bs: int) -> CalibrationData:
    point = {n: r.opt for n, r in sig.dynamic_dims.items()}
    batch_dim = batch_dim_name(sig)
    if batch_dim is not None:
        point[batch_dim] = bs
    calls = max(1, math.ceil(spec.samples / bs))
    held_calls = max(1, math.ceil(max(MIN_HELD_OUT_RANDOM, spec.samples // 4) / bs))
    calibration = [sig.make_inputs(point, seed=seed + 10_000 + i) for i in range(calls)]
    held_out = [sig.make_inputs(point, seed=seed + 20_000 + i) for i in range(held_calls)]
    warning = RANDOM_WARNING.format(n=calls * bs)
    info = {
        "source": "random", "samples": calls * bs, "held_out": held_calls * bs, "batch_size": bs,
        "observer": spec.observer, "seed": seed, "warning": warning,
        "held_out_note": "held-out samples are drawn with other seeds than the calibration samples",
    }
    return CalibrationData(calibration, held_out, info, [warning])

