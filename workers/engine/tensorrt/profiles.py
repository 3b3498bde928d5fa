"""TensorRT optimization profiles from the spec's dynamic dims, and the ONNX model's input signature.

An engine built from a network with dynamic input dims runs only at shapes inside one of its
optimization profiles; each profile gives every dynamic input a min / opt / max shape, and
TensorRT tunes its kernels for opt. fxport's spec names dynamic dims once
(`dynamic_dims: {batch: {min: 1, opt: 8, max: 64}}`) and uses the names in input shapes, so a
profile is that substitution, per input. All pure functions: no TensorRT needed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from fxport.errors import InvalidInput
from fxport.spec import DynamicDim, InputSpec

Which = Literal["min", "opt", "max"]
Shape = tuple[int, ...]


@dataclass(frozen=True)
class ShapeRange:
    min: Shape
    opt: Shape
    max: Shape

    def __getitem__(self, which: Which) -> Shape:
        return getattr(self, which)

    @property
    def dynamic(self) -> bool:
        return not (self.min == self.opt == self.max)


@dataclass(frozen=True)
class OptimizationProfile:
    """One TensorRT optimization profile: a shape range per network input (static inputs too,
    as min = opt = max, so the profile says every shape the engine was verified at)."""

    shapes: tuple[tuple[str, ShapeRange], ...]

    def __getitem__(self, name: str) -> ShapeRange:
        return dict(self.shapes)[name]

    @property
    def names(self) -> list[str]:
        return [n for n, _ in self.shapes]

    def point(self, which: Which) -> dict[str, Shape]:
        """Every input's shape at this profile's min, opt or max."""
        return {name: rng[which] for name, rng in self.shapes}

    def covers(self, shapes: Mapping[str, Sequence[int]]) -> bool:
        for name, rng in self.shapes:
            got = tuple(shapes.get(name, ()))
            if len(got) != len(rng.min) or any(not lo <= g <= hi for g, lo, hi in zip(got, rng.min, rng.max)):
                return False
        return True

    def as_dict(self) -> dict[str, dict[str, list[int]]]:
        return {name: {"min": list(r.min), "opt": list(r.opt), "max": list(r.max)} for name, r in self.shapes}


def build_profiles(inputs: Sequence[InputSpec], dynamic_dims: Mapping[str, DynamicDim]) -> list[OptimizationProfile]:
    """The optimization profiles for `inputs`: none when every dim is static, else one profile
    with each input's shape at the spec's min, opt and max of its dynamic dims.

    One profile covers the whole range: the spec has one min/opt/max per dim, and a dim shared
    by two inputs (a batch) must take the same value in both, which one profile guarantees.
    """
    if not any(isinstance(d, str) for inp in inputs for d in inp.shape):
        return []
    shapes = []
    for inp in inputs:
        triple = []
        for which in ("min", "opt", "max"):
            dims = []
            for i, d in enumerate(inp.shape):
                if isinstance(d, str):
                    rng = dynamic_dims.get(d)
                    if rng is None:
                        raise InvalidInput(
                            f"input {inp.name!r} dim {i} is the dynamic dim {d!r}, which has no range in dynamic_dims",
                            stage="tensorrt", field="dynamic_dims",
                            hint=f"add dynamic_dims: {{{d}: {{min: 1, opt: 8, max: 64}}}}",
                        )
                    dims.append(int(getattr(rng, which)))
                else:
                    dims.append(int(d))
            triple.append(tuple(dims))
        shapes.append((inp.name, ShapeRange(*triple)))
    return [OptimizationProfile(tuple(shapes))]


def check_against_network(
    profile: OptimizationProfile | None, network_inputs: Mapping[str, Sequence[int]]
) -> list[str]:
    """Problems between a profile and the parsed network's inputs (-1 marks a dynamic dim).

    Each problem names the input and dim. Empty when the profile fits (or no profile is needed).
    """
    problems: list[str] = []
    ranges = dict(profile.shapes) if profile is not None else {}
    for name, dims in network_inputs.items():
        dims = tuple(int(d) for d in dims)
        rng = ranges.get(name)
        if rng is None:
            if any(d < 0 for d in dims):
                problems.append(f"network input {name!r} has dynamic dims {list(dims)} but the spec gives it no shape "
                                f"range (spec inputs: {', '.join(ranges) or 'none'})")
            continue
        if len(dims) != len(rng.min):
            problems.append(f"network input {name!r} has rank {len(dims)}; the spec's shape has rank {len(rng.min)}")
            continue
        for i, d in enumerate(dims):
            if d >= 0 and not (rng.min[i] == rng.max[i] == d):
                problems.append(f"network input {name!r} dim {i} is {d} in the ONNX model; the spec asks "
                                f"{rng.min[i]}..{rng.max[i]}")
    extra = [n for n in ranges if n not in network_inputs]
    if extra:
        problems.append(f"spec input(s) {', '.join(map(repr, extra))} are not inputs of the ONNX model "
                        f"(its inputs: {', '.join(map(repr, network_inputs))})")
    return problems


# ONNX element type -> fxport spec dtype
_ONNX_DTYPES = {1: "float32", 10: "float16", 16: "bfloat16", 11: "float64", 7: "int64", 6: "int32", 3: "int8",
                2: "uint8", 9: "bool"}


def onnx_inputs(model: Any) -> list[tuple[str, list[int | str | None], int]]:
    """(name, dims, element type) of the model's real inputs (initializers listed as inputs dropped).
    A dim is an int, a dim_param name, or None when unknown."""
    inits = {i.name for i in model.graph.initializer}
    out = []
    for value in model.graph.input:
        if value.name in inits:
            continue
        tensor = value.type.tensor_type
        dims: list[int | str | None] = []
        for d in tensor.shape.dim:
            if d.HasField("dim_value") and d.dim_value > 0:
                dims.append(int(d.dim_value))
            else:
                dims.append(d.dim_param or None)
        out.append((value.name, dims, tensor.elem_type))
    return out


def signature_from_onnx(model: Any, inputs: Sequence[InputSpec], dynamic_dims: Mapping[str, DynamicDim]) -> Any:
    """The InputSignature of an ONNX model, in its input order: from the spec's inputs when given
    (checked against the model: names, ranks, static dims, dtypes), else from the model itself,
    which works only when all its dims are static (ONNX carries no min/max for a dynamic dim)."""
    from fxport.workers.engine.inputs import InputSignature

    graph_inputs = onnx_inputs(model)
    if inputs:
        by_name = {i.name: i for i in inputs}
        names = [n for n, _, _ in graph_inputs]
        missing, extra = [n for n in names if n not in by_name], [n for n in by_name if n not in names]
        if missing or extra:
            raise InvalidInput(
                f"spec.inputs ({', '.join(by_name)}) do not match the ONNX model's inputs ({', '.join(names)})",
                stage="load", field="inputs", hint="name the inputs as the ONNX model does",
            )
        ordered = []
        for name, dims, elem in graph_inputs:
            spec_input = by_name[name]
            if len(spec_input.shape) != len(dims):
                raise InvalidInput(f"input {name!r} has rank {len(dims)} in the ONNX model; spec.inputs gives rank "
                                   f"{len(spec_input.shape)}", stage="load", field="inputs")
            for i, (mine, theirs) in enumerate(zip(spec_input.shape, dims)):
                if isinstance(mine, int) and isinstance(theirs, int) and mine != theirs:
                    raise InvalidInput(f"input {name!r} dim {i} is {theirs} in the ONNX model; spec.inputs says {mine}",
                                       stage="load", field="inputs")
            want = _ONNX_DTYPES.get(elem)
            if want is not None and want != spec_input.dtype:
                raise InvalidInput(f"input {name!r} is {want} in the ONNX model; spec.inputs says {spec_input.dtype}",
                                   stage="load", field="inputs")
            ordered.append(spec_input)
        used = {d for i in ordered for d in i.shape if isinstance(d, str)}
        unranged = sorted(used - set(dynamic_dims))
        if unranged:
            raise InvalidInput(f"spec.inputs names dynamic dim {unranged[0]!r}, which has no range, and an ONNX model "
                               "carries none", stage="load", field="dynamic_dims",
                               hint=f"add dynamic_dims: {{{unranged[0]}: {{min: 1, opt: 8, max: 64}}}}, or "
                                    f"--dynamic-dim {unranged[0]}=1:8:64")
        return InputSignature(inputs=ordered, dynamic_dims={k: v for k, v in dynamic_dims.items() if k in used})
    specs = []
    for name, dims, elem in graph_inputs:
        unknown = [(i, d) for i, d in enumerate(dims) if not isinstance(d, int)]
        if unknown:
            i, d = unknown[0]
            raise InvalidInput(
                f"input {name!r} dim {i} ({d or 'unnamed'}) is dynamic in the ONNX model, and the spec gives no range "
                "for it (ONNX records no min/max)",
                stage="load", field="inputs",
                hint=f"add spec.inputs (e.g. {{name: {name}, shape: [batch, ...]}}) and dynamic_dims "
                     "(e.g. {batch: {min: 1, opt: 8, max: 64}})",
            )
        dtype = _ONNX_DTYPES.get(elem)
        if dtype is None:
            raise InvalidInput(f"input {name!r} has ONNX element type {elem}, which fxport cannot feed", stage="load")
        specs.append(InputSpec(name=name, shape=list(dims), dtype=dtype))
    return InputSignature(inputs=specs, dynamic_dims={})


def verification_points(profiles: Iterable[OptimizationProfile]) -> list[dict[str, Shape]]:
    """Per-input shapes to verify an engine at: each profile's min and max (then opt), deduplicated."""
    points: list[dict[str, Shape]] = []
    for profile in profiles:
        for which in ("min", "max", "opt"):
            point = profile.point(which)
            if point not in points:
                points.append(point)
    return points
