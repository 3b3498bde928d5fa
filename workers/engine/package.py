"""The package stage: a Triton model repository (fxport/serving/triton.py) made of the verified
artifacts, with samples.npz (an input verification checked every artifact with, and the original
model's outputs for it), every file of it an artifact of the job.
"""

from __future__ import annotations

import shutil

from fxport.serving.signature import model_signature
from fxport.workers.engine.publish import records_of
from fxport.workers.engine.run import Run
from fxport.workers.engine.samples import Checks


def package_triton(run: Run, checks: Checks) -> None:
    """samples.npz (the first input verification checked every artifact with, and the original
    model's outputs for it), then the Triton repository under triton/ from the verified artifacts
    (fxport/serving/triton.py), every file of it an artifact of the job."""
    import numpy as np

    from fxport.serving.triton import MODEL_NAME_RE, SAMPLES, write_samples, write_triton_repository

    manifest, out_dir = run.manifest, run.out_dir
    manifest.signature = model_signature(manifest.inputs, manifest.outputs)
    assert manifest.signature is not None  # a model with no input signature never gets here
    point = checks.points[0]
    arrays = {f"inputs/{t.name}": np.asarray(a) for t, a in zip(manifest.signature.inputs, point.args)}
    arrays.update({f"outputs/{t.name}": np.asarray(a)
                   for t, a in zip(manifest.signature.outputs, checks.reference.infer(point.args))})
    write_samples(out_dir / SAMPLES, arrays)
    manifest.artifacts.extend(records_of([("samples", out_dir / SAMPLES, None)], out_dir))
    # The repository's model names: the job's label `model` where it makes a Triton name, else "model".
    name = manifest.spec.get("labels", {}).get("model") or "model"
    shutil.rmtree(out_dir / "triton", ignore_errors=True)  # an earlier convert's, in the same --out
    package = write_triton_repository(out_dir, name if MODEL_NAME_RE.match(name) else "model", out_dir / "triton",
                                      manifest=manifest)
    files = sorted(p for p in (out_dir / "triton").rglob("*") if p.is_file())
    manifest.artifacts.extend(records_of([("triton", f, None) for f in files], out_dir))
    manifest.package = {"triton": package.to_dict()}
    for note in package.notes:
        run.warn(f"triton package: {note}")

