"""fxport: turn PyTorch models into verified deployment artifacts (shared core, no heavy imports)."""

__version__ = "0.1.0"
