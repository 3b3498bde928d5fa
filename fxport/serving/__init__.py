"""From verified artifacts to a server: a Triton model repository, a KServe InferenceService and a
model card, written from a job's folder (its manifest.json and artifacts) by `fxport package` or by
the engine when the spec asks (`package: [triton]`). Pure Python over the manifest: no torch, so it
runs from the client install too (docs/serving.md).
"""
