"""The model's signature as a server needs it: inputs and outputs in order, and the batch axis.

The engine records the input signature (`manifest.inputs`: names, dtypes, shapes with named
dynamic dims, their ranges) and the outputs the exporter saw (`manifest.outputs`). A server
needs one more fact, which had to be guessed before: which axis is the batch. Here it is
decided, and said when it cannot be: the batch axis is a dynamic dim that is dim 0 of every
input and of every output. The benchmark's and calibration's "batch" are looser (the first
input's dim 0): they only pick a size to run at, while a server that batches requests splits
and joins every input and output along this axis, so all of them must carry it.
"""

from __future__ import annotations

from typing import Any

from fxport.manifest import BatchAxis, Signature, TensorSignature


def model_signature(inputs: dict[str, Any] | None, outputs: list[dict[str, Any]] | None) -> Signature | None:
    """The signature from the manifest's `inputs` and `outputs` sections; None without inputs."""
    if not inputs or not inputs.get("inputs"):
        return None
    dims = {name: dict(rng) for name, rng in (inputs.get("dynamic_dims") or {}).items()}
    ins = [TensorSignature(name=i["name"], dtype=i.get("dtype"), shape=list(i.get("shape") or []))
           for i in inputs["inputs"]]
    outs = [TensorSignature(name=o.get("name") or f"output_{k}", dtype=o.get("dtype"),
                            shape=list(o["shape"]) if o.get("shape") is not None else None)
            for k, o in enumerate(outputs or [])]
    return Signature(inputs=ins, outputs=outs, dynamic_dims=dims, batch=batch_axis(ins, outs, dims))


def batch_axis(inputs: list[TensorSignature], outputs: list[TensorSignature],
               dynamic_dims: dict[str, dict[str, int]]) -> BatchAxis:
    """The dynamic dim that is dim 0 of every input and output, or why there is none."""
    firsts = [(t.name, t.shape[0] if t.shape else None) for t in inputs]
    static = [(name, d) for name, d in firsts if not isinstance(d, str)]
    if static:
        name, d = static[0]
        what = "is a scalar" if d is None else f"has a static dim 0 ({d})"
        return BatchAxis(note=f"no batch axis: input {name!r} {what}; give it a dynamic first dim "
                              "(e.g. --dynamic-batch 1:8:64) to batch requests")
    names = sorted({str(d) for _, d in firsts})
    if len(names) > 1:
        return BatchAxis(note=f"no batch axis: the inputs start with different dims ({', '.join(names)})")
    dim = names[0]
    if not outputs:
        return BatchAxis(note=f"no batch axis: the outputs are not known, so dim {dim!r} cannot be checked "
                              "against them")
    for out in outputs:
        if out.shape is None:
            return BatchAxis(note=f"no batch axis: output {out.name!r} has no recorded shape, so it cannot be "
                                  f"checked to start with {dim!r}")
        if not out.shape or out.shape[0] != dim:
            start = "is a scalar" if not out.shape else f"starts with {out.shape[0]!r}"
            return BatchAxis(note=f"no batch axis: output {out.name!r} {start}, not the inputs' dim {dim!r}")
    rng = dynamic_dims.get(dim) or {}
    return BatchAxis(dim=dim, min=rng.get("min"), opt=rng.get("opt"), max=rng.get("max"),
                     note=f"dim 0 of every input and output is the dynamic dim {dim!r}")
