"""Celery app, thin tasks, the conversion engine and the sandbox."""
