"""Thin client library and the `fxport` CLI. Never imports torch, celery or onnx."""
