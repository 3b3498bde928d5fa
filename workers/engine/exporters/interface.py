"""What a serving config sees of an artifact: output names, dynamic dim names, provenance.

The torch.export-based ONNX exporter names outputs after the op that made them (`linear`,
`linear_8`: they change when the model does) and dynamic dims after the input and position
they came from (`tokens_dim1`); only `batch` survived. Triton-style configs hard-code both.
`finish_onnx` rewrites the exported model in place:

- outputs: the spec's `outputs` names, in flattened output order, else `output_0`, `output_1`, …
- dims: every dynamic dim takes the name the spec (or the model's own signature) gives it, on
  the inputs and wherever the exporter carried it (outputs, value infos);
- `metadata_props`: fxport's version, the source model's sha256 and the spec digest (not the
  job id: the same inputs must give the same bytes in every job; the manifest names the job).

TorchScript and `.pt2` archives get the same provenance as extra files (`PROVENANCE_FILE`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fxport.errors import InvalidInput

PROVENANCE_FILE = "fxport_provenance.json"  # the extra file in .ts and .pt2 archives
METADATA_PREFIX = "fxport."  # ONNX metadata_props keys


def default_output_names(count: int) -> list[str]:
    return [f"output_{i}" for i in range(count)]


def finish_onnx(path: Path, *, input_shapes: Sequence[tuple[str, Sequence[int | str]]],
                output_names: Sequence[str] | None, provenance: dict[str, str]) -> dict[str, Any]:
    """Rename outputs and dynamic dims and write provenance into the ONNX model at `path` (weights
    stored beside it stay where they are). Returns the interface for the manifest."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    count = len(graph.output)
    if output_names is not None and len(output_names) != count:
        raise InvalidInput(
            f"spec.outputs names {len(output_names)} output(s) but the model has {count} (flattened in order)",
            stage="export", field="outputs", hint=f"give exactly {count} names, or leave outputs out for "
            f"{', '.join(default_output_names(count))}")
    names = list(output_names) if output_names is not None else default_output_names(count)
    renames = {out.name: new for out, new in zip(graph.output, names)}
    _name_constant_outputs(graph, renames)
    _rename_tensors(graph, renames)
    _rename_dims(graph, input_shapes)
    kept = [p for p in model.metadata_props if not p.key.startswith(METADATA_PREFIX)]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    for key, value in provenance.items():
        model.metadata_props.add(key=METADATA_PREFIX + key, value=str(value))
    onnx.save(model, str(path))
    return {"inputs": [_describe(v) for v in graph.input if v.name not in {i.name for i in graph.initializer}],
            "outputs": [_describe(v) for v in graph.output]}


def provenance_extra_files(provenance: dict[str, str]) -> dict[str, str]:
    """TorchScript `_extra_files` / torch.export `extra_files`: the provenance as one JSON file."""
    return {PROVENANCE_FILE: json.dumps(provenance, sort_keys=True)}


def _name_constant_outputs(graph: Any, renames: dict[str, str]) -> None:
    """An output that is an initializer (a model whose output folded to a constant) or a graph input
    (an identity model) is made by no node to rename: an Identity node gives it its new name, and the
    initializer or input keeps its own. Such entries leave `renames`, the graph output is renamed here."""
    import onnx

    sources = {i.name for i in graph.input} | {i.name for i in graph.initializer}
    taken = sources | {o for n in graph.node for o in n.output}
    for out in graph.output:
        new = renames.get(out.name)
        if out.name in sources and new is not None and new != out.name:
            if new in taken:
                raise InvalidInput(f"output name {new!r} is already the name of a tensor inside the ONNX graph",
                                   stage="export", field="outputs", hint="pick other output names")
            graph.node.append(onnx.helper.make_node("Identity", [out.name], [new], name=f"fxport_output_{new}"))
            del renames[out.name]
            out.name = new


def _rename_tensors(graph: Any, renames: dict[str, str]) -> None:
    renames = {old: new for old, new in renames.items() if old != new}
    if not renames:
        return
    taken = ({o for n in graph.node for o in n.output} | {i.name for i in graph.input}
             | {i.name for i in graph.initializer})
    clash = (set(renames.values()) & taken) - set(renames)
    if clash:
        raise InvalidInput(f"output name(s) {sorted(clash)} are already names of tensors inside the ONNX graph",
                           stage="export", field="outputs", hint="pick other output names")
    for node in graph.node:
        node.input[:] = [renames.get(n, n) for n in node.input]
        node.output[:] = [renames.get(n, n) for n in node.output]
        for attr in node.attribute:  # subgraphs (If/Loop) may read a renamed tensor
            for sub in [attr.g, *attr.graphs] if attr.HasField("g") or attr.graphs else []:
                _rename_tensors(sub, renames)
    for value in [*graph.output, *graph.value_info]:
        value.name = renames.get(value.name, value.name)


def _rename_dims(graph: Any, input_shapes: Sequence[tuple[str, Sequence[int | str]]]) -> None:
    """dim_param: the exporter's name → the spec's, learned on the inputs, applied everywhere."""
    by_input = {v.name: v for v in graph.input}
    renames: dict[str, str] = {}
    for name, shape in input_shapes:
        value = by_input.get(name)
        if value is None or not value.type.HasField("tensor_type"):
            continue
        dims = value.type.tensor_type.shape.dim
        for dim, want in zip(dims, shape):
            if isinstance(want, str) and dim.dim_param and dim.dim_param != want:
                renames.setdefault(dim.dim_param, want)
    if not renames:
        return
    for value in [*graph.input, *graph.output, *graph.value_info]:
        if value.type.HasField("tensor_type"):
            for dim in value.type.tensor_type.shape.dim:
                if dim.dim_param:
                    dim.dim_param = _replace_symbols(dim.dim_param, renames)


def _replace_symbols(expr: str, renames: dict[str, str]) -> str:
    """Rename whole symbols in a dim expression (`2*tokens_dim1` → `2*seq`)."""
    import re

    return re.sub(r"[A-Za-z_][A-Za-z0-9_]*", lambda m: renames.get(m.group(0), m.group(0)), expr)


def _describe(value: Any) -> dict[str, Any]:
    import onnx

    t = value.type.tensor_type
    return {"name": value.name,
            "dtype": onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name if t.elem_type else None,
            "shape": [d.dim_param or (d.dim_value if d.HasField("dim_value") else None) for d in t.shape.dim]}
