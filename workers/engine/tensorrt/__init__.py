"""The TensorRT target: CPU preflight, optimization profiles, shared timing cache, engine builder, runner.

Nothing here imports `tensorrt` (or CUDA) at module level: TensorRT exists only on GPU
workers (NVIDIA's container images), and importing fxport must work everywhere else.
`preflight`, `profiles`, `support_matrix` and the key derivation in `timing_cache` are
plain Python and run on CPU machines; `builder` and `runner` import TensorRT inside the
functions that need it.
"""
