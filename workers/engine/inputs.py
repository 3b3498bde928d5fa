"""The model's input signature (names, shapes, dynamic dims, dtypes) and sample tensors for it.

Comes from the spec, or — for a .pt2 — from the exported program itself. Sample inputs are
seeded, so two runs of the same job see the same numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from fxport.errors import InvalidInput
from fxport.spec import DynamicDim, InputSpec, JobSpec

_DTYPES = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64,
    "int64": torch.int64, "int32": torch.int32, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}
_NAMES = {v: k for k, v in _DTYPES.items()}
UNBOUNDED_DIM_CAP = 64  # a .pt2 whose dynamic dim has no upper bound is verified up to this


@dataclass
class InputSignature:
    inputs: list[InputSpec]
    dynamic_dims: dict[str, DynamicDim]
    int_ranges: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> [low, high)
    notes: list[str] = field(default_factory=list)

    def shape_points(self) -> list[dict[str, int]]:
        """Dim assignments to verify at: every dynamic dim at min, opt and max (deduplicated)."""
        points: list[dict[str, int]] = []
        for which in ("min", "opt", "max"):
            point = {name: getattr(rng, which) for name, rng in self.dynamic_dims.items()}
            if point not in points:
                points.append(point)
        return points or [{}]

    def export_point(self) -> dict[str, int]:
        """Example dims for torch.export: a dynamic dim sized 1 would be specialized, so use >= 2."""
        return {n: max(2, r.opt) if r.max >= 2 else 1 for n, r in self.dynamic_dims.items()}

    def concrete_shape(self, inp: InputSpec, point: dict[str, int]) -> list[int]:
        return [point[d] if isinstance(d, str) else d for d in inp.shape]

    def make_inputs(self, point: dict[str, int], seed: int) -> tuple[torch.Tensor, ...]:
        gen = torch.Generator().manual_seed(seed)
        out = []
        for inp in self.inputs:
            shape = self.concrete_shape(inp, point)
            dtype = _DTYPES[inp.dtype]
            if dtype == torch.bool:
                out.append(torch.randint(0, 2, shape, generator=gen).bool())
            elif dtype.is_floating_point:
                out.append(torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype))
            else:
                lo, hi = self.int_ranges.get(inp.name, (0, 2))
                out.append(torch.randint(lo, hi, shape, generator=gen, dtype=dtype))
        return tuple(out)

    def dynamic_shapes(self) -> tuple[dict[int, Any] | None, ...] | None:
        """torch.export dynamic_shapes (positional form) for the dynamic dims."""
        if not self.dynamic_dims:
            return None
        dims = {
            name: torch.export.Dim(name, min=rng.min, max=rng.max)
            for name, rng in self.dynamic_dims.items()
            if rng.max >= 2
        }
        spec = []
        for inp in self.inputs:
            entry = {i: dims[d] for i, d in enumerate(inp.shape) if isinstance(d, str) and d in dims}
            spec.append(entry or None)
        return tuple(spec)


def resolve_signature(spec: JobSpec, loaded: Any) -> InputSignature:
    """Inputs from the spec, checked against a .pt2's own signature; or taken from the .pt2."""
    ep = getattr(loaded, "exported_program", None)
    from_program = _signature_from_program(ep, loaded.example_inputs) if ep is not None else None
    if spec.inputs:
        sig = InputSignature(inputs=list(spec.inputs), dynamic_dims=dict(spec.dynamic_dims))
        if from_program is not None:
            _check_against_program(sig, from_program)
            sig.int_ranges = from_program.int_ranges
        _ranges_for_named_dims(sig, from_program, getattr(loaded, "format", None) or "model")
        return sig
    if from_program is not None:
        return from_program
    raise InvalidInput(
        f"spec.inputs is required for a {loaded.format.replace('_', ' ')} model: it carries no example inputs",
        stage="load",
        field="inputs",
        hint="add e.g. inputs: [{name: x, shape: [batch, 3, 224, 224]}] and dynamic_dims: "
        "{batch: {min: 1, opt: 8, max: 64}}, or pass --input x:batch,3,224,224 --dynamic-batch 1:8:64",
    )


def _signature_from_program(ep: Any, example: tuple[Any, ...] | None) -> InputSignature:
    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    names = list(ep.graph_signature.user_inputs)
    inputs: list[InputSpec] = []
    dyn: dict[str, DynamicDim] = {}
    int_ranges: dict[str, tuple[int, int]] = {}
    notes: list[str] = []
    # A .pt2 keeps its dims as symbols (s0, s1, ...), not the names torch.export.Dim was given. One name per
    # symbol: inputs that share a dim (ids and mask: the same seq) share its name, and so its range.
    named: dict[str, str] = {}
    for pos, name in enumerate(names):
        val = placeholders[name].meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise InvalidInput(
                f"the exported program's input {name!r} is not a tensor; fxport converts tensor inputs only",
                stage="load",
            )
        ex = example[pos] if example is not None and pos < len(example) else None
        shape: list[int | str] = []
        for i, d in enumerate(val.shape):
            if isinstance(d, int):
                shape.append(d)
                continue
            sym = str(d)
            if sym not in named:
                named[sym] = "batch" if i == 0 and "batch" not in named.values() else f"{name}_dim{i}"
            dim_name = named[sym]
            vr = ep.range_constraints.get(d.node.expr) if hasattr(d, "node") else None
            lo = int(vr.lower) if vr is not None and math.isfinite(float(vr.lower)) else 1
            hi_raw = float(vr.upper) if vr is not None else math.inf
            opt = int(ex.shape[i]) if ex is not None else max(lo, 2)
            if math.isfinite(hi_raw):
                hi = int(hi_raw)
            else:
                hi = max(opt, UNBOUNDED_DIM_CAP)
                notes.append(f"input {name!r} dim {i} ({sym}) has no upper bound; verified up to {hi}")
            existing = dyn.get(dim_name)
            if existing is None:
                dyn[dim_name] = DynamicDim(min=max(lo, 1), opt=min(max(opt, lo), hi), max=hi)
            shape.append(dim_name)
        dtype = _NAMES.get(val.dtype)
        if dtype is None:
            raise InvalidInput(f"input {name!r} has dtype {val.dtype}, which fxport does not support", stage="load")
        if ex is not None and not ex.dtype.is_floating_point and ex.dtype != torch.bool and ex.numel():
            int_ranges[name] = (int(ex.min()), int(ex.max()) + 1)
        inputs.append(InputSpec(name=name, shape=shape, dtype=dtype))
    return InputSignature(inputs=inputs, dynamic_dims=dyn, int_ranges=int_ranges, notes=notes)


def _ranges_for_named_dims(sig: InputSignature, prog: InputSignature | None, fmt: str) -> None:
    """A dynamic dim the spec names without a range takes the exported program's at the same place
    (the program names its dims its own way: position says which); with no program, the model is
    refused naming the dim. The filled ranges are held to the spec's element limit too."""
    from fxport.spec import check_elements

    for idx, inp in enumerate(sig.inputs):
        for d_i, d in enumerate(inp.shape):
            if not isinstance(d, str) or d in sig.dynamic_dims:
                continue
            theirs = prog.inputs[idx].shape[d_i] if prog is not None else None
            if prog is None or not isinstance(theirs, str):
                raise InvalidInput(
                    f"inputs[{idx}].shape[{d_i}] names dynamic dim {d!r}, which has no range, and a "
                    f"{fmt.replace('_', ' ')} model carries none",
                    stage="load", field="dynamic_dims",
                    hint=f"add dynamic_dims: {{{d}: {{min: 1, opt: 8, max: 64}}}}, or --dynamic-dim {d}=1:8:64")
            sig.dynamic_dims[d] = prog.dynamic_dims[theirs]
            sig.notes.append(f"dynamic dim {d!r} takes the exported program's range "
                             f"{prog.dynamic_dims[theirs].min}..{prog.dynamic_dims[theirs].max}")
        try:
            check_elements(idx, inp, sig.dynamic_dims)
        except ValueError as exc:
            raise InvalidInput(str(exc), stage="load", field=f"inputs[{idx}].shape") from None


def _check_against_program(sig: InputSignature, prog: InputSignature) -> None:
    if len(sig.inputs) != len(prog.inputs):
        raise InvalidInput(
            f"spec.inputs lists {len(sig.inputs)} inputs but the exported model takes {len(prog.inputs)} "
            f"({', '.join(i.name for i in prog.inputs)})",
            stage="load", field="inputs",
            hint="list the model's inputs in order, or leave spec.inputs out to use the model's own",
        )
    for idx, (mine, theirs) in enumerate(zip(sig.inputs, prog.inputs)):
        if mine.name != theirs.name:
            # Bound by position, a wrong name would ship an artifact whose named inputs are swapped.
            raise InvalidInput(
                f"inputs[{idx}] is named {mine.name!r} but the exported model's input {idx} is {theirs.name!r} "
                f"(its inputs: {', '.join(i.name for i in prog.inputs)})",
                stage="load", field=f"inputs[{idx}].name",
                hint="name the inputs as the model does, in order, or leave spec.inputs out to use the model's own",
            )
        if len(mine.shape) != len(theirs.shape):
            raise InvalidInput(
                f"inputs[{idx}] ({mine.name}) has rank {len(mine.shape)} but the exported model's input "
                f"{theirs.name!r} has rank {len(theirs.shape)} (shape {theirs.shape})",
                stage="load", field=f"inputs[{idx}].shape",
            )
        for d_i, (a, b) in enumerate(zip(mine.shape, theirs.shape)):
            if isinstance(a, int) and isinstance(b, int) and a != b:
                raise InvalidInput(
                    f"inputs[{idx}].shape[{d_i}] is {a} but the exported model's input {theirs.name!r} "
                    f"expects {b} there (shape {theirs.shape})",
                    stage="load", field=f"inputs[{idx}].shape[{d_i}]",
                )
            if isinstance(a, str) and isinstance(b, int) and b != 1:
                raise InvalidInput(
                    f"inputs[{idx}].shape[{d_i}] is dynamic ({a!r}) but the .pt2 was exported with a static "
                    f"size {b} there",
                    stage="load", field=f"inputs[{idx}].shape[{d_i}]",
                    hint="re-export with dynamic_shapes for that dim, or use the static size in the spec",
                )
        if mine.dtype != theirs.dtype:
            raise InvalidInput(
                f"inputs[{idx}].dtype is {mine.dtype} but the exported model expects {theirs.dtype}",
                stage="load", field=f"inputs[{idx}].dtype",
            )
