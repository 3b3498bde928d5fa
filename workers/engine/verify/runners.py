"""Runners: one interface over every way an artifact executes (`with runner: runner.infer(args)`).

`infer` returns the flat list of output tensors (pytree leaves), so artifacts that return a
dict, a tuple or a single tensor compare leaf by leaf.
"""

from __future__ import annotations

import importlib.util
import pickle
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch


def flatten_outputs(out: Any) -> list[np.ndarray]:
    """The output's leaves as arrays. Floats become float32; integer and bool outputs keep their
    dtype (detection labels stay labels: the comparator pairs detections by them)."""
    return [_as_array(leaf) for leaf in torch.utils._pytree.tree_leaves(out)]


def output_paths(out: Any) -> list[str]:
    """Where each leaf of `out` sits, in `flatten_outputs` order: `[0]['boxes']`, `['logits']`, or ''
    for a plain tensor. The comparator names outputs by them and finds detection dicts by their keys."""
    leaves, _ = torch.utils._pytree.tree_flatten_with_path(out)
    return [torch.utils._pytree.keystr(path) for path, _ in leaves]


def _as_array(leaf: Any) -> np.ndarray:
    if not isinstance(leaf, torch.Tensor):
        return np.asarray(leaf)
    leaf = leaf.detach().cpu()
    return (leaf.float() if leaf.is_floating_point() or leaf.is_complex() else leaf).numpy()


class Runner:
    name = "runner"
    runtime = "torch"

    def __enter__(self) -> Runner:
        self.activate()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.deactivate()

    def activate(self) -> None:  # load the artifact
        pass

    def deactivate(self) -> None:
        pass

    def infer(self, args: tuple[torch.Tensor, ...]) -> list[np.ndarray]:
        raise NotImplementedError


class EagerRunner(Runner):
    """The original model: the reference every artifact is compared with.

    `output_paths` (after each `infer`): where each output leaf sits in what the model returned,
    which the artifacts' flat outputs do not say."""

    name, runtime = "eager", "torch"

    def __init__(self, module: Any) -> None:
        self.module = module
        self.output_paths: list[str] | None = None

    def infer(self, args: tuple[torch.Tensor, ...]) -> list[np.ndarray]:
        with torch.no_grad():
            out = self.module(*args)
        self.output_paths = output_paths(out)
        return flatten_outputs(out)


class ReferenceOutputs(EagerRunner):
    """The original model, each input's outputs computed once per conversion: the export
    stage's checks of a trace and the verify stage run the same sample inputs (the same tensor
    objects, `samples.sample_points`), and the TensorRT stage runs them again. Keyed by the
    input tuple itself; not for timing (a benchmark wants every run)."""

    def __init__(self, module: Any) -> None:
        super().__init__(module)
        self._memo: dict[int, tuple[tuple[Any, ...], list[np.ndarray], list[str] | None]] = {}

    def infer(self, args: tuple[torch.Tensor, ...]) -> list[np.ndarray]:
        hit = self._memo.get(id(args))
        if hit is not None and hit[0] is args:
            self.output_paths = hit[2]
            return hit[1]
        outputs = super().infer(args)
        self._memo[id(args)] = (args, outputs, self.output_paths)
        return outputs

    def leaves(self, args: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        """The outputs at `args` as tensors, for the exporters' own checks."""
        return [torch.as_tensor(a) for a in self.infer(args)]


class TorchScriptRunner(Runner):
    name, runtime = "torchscript", "torch.jit"

    def __init__(self, path: Path) -> None:
        self.path = path

    def activate(self) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.module = torch.jit.load(str(self.path), map_location="cpu")

    def deactivate(self) -> None:  # its weights freed before the next artifact loads its own
        self.module = None

    def infer(self, args: tuple[torch.Tensor, ...]) -> list[np.ndarray]:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return flatten_outputs(self.module(*args))


class ExportedProgramRunner(Runner):
    name, runtime = "exported_program", "torch.export"

    def __init__(self, path: Path) -> None:
        self.path = path

    def activate(self) -> None:
        # an int8 program holds torch.ops.quantized_decomposed Q/DQ ops, which exist only once
        # their library is imported; loading fails without it
        import torch.ao.quantization.fx._decomposed  # noqa: F401

        from fxport.workers.engine.warm_caches import cache_pt2_type_hints

        cache_pt2_type_hints()
        self.module: Any = torch.export.load(str(self.path)).module()

    def deactivate(self) -> None:
        self.module = None

    def infer(self, args: tuple[torch.Tensor, ...]) -> list[np.ndarray]:
        with torch.no_grad():
            return flatten_outputs(self.module(*args))


class FxSourceRunner(Runner):
    """Imports the generated Python source and runs it: proves the source is complete, and that
    loading it unpickles nothing (the artifact's promise: its tensors come from safetensors)."""

    name, runtime = "fx_source", "python"

    def __init__(self, folder: Path, class_name: str) -> None:
        self.folder, self.class_name = folder, class_name

    def activate(self) -> None:
        mod_name = f"_fxport_fx_source_{abs(hash(str(self.folder)))}"
        spec = importlib.util.spec_from_file_location(mod_name, self.folder / "module.py")
        assert spec and spec.loader
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module
        # no __pycache__ inside the artifact folder: it would ship as stray files
        writes_bytecode, sys.dont_write_bytecode = sys.dont_write_bytecode, True
        try:
            spec.loader.exec_module(module)
            with _no_unpickling(f"{self.class_name}()"):  # where the weights load
                self.module = getattr(module, self.class_name)().eval()
        finally:
            sys.modules.pop(mod_name, None)
            sys.dont_write_bytecode = writes_bytecode

    def deactivate(self) -> None:
        self.module = None

    def infer(self, args: tuple[torch.Tensor, ...]) -> list[np.ndarray]:
        with torch.no_grad():
            return flatten_outputs(self.module(*args))


@contextmanager
def _no_unpickling(what: str) -> Iterator[None]:
    """While inside, torch.load and pickle's loaders raise: what runs in here unpickles nothing
    (torch.load's weights_only unpickler included). Meant for a constructor call, which imports
    nothing that could keep a reference to a stand-in; one artifact loads at a time in a job."""
    def refuse(*_args: Any, **_kwargs: Any) -> Any:
        raise RuntimeError(f"{what} unpickles (torch.load / pickle) while loading; it must read its tensors "
                           "with safetensors only")

    class Refused(pickle.Unpickler):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            refuse()

    stand_ins = {(torch, "load"): refuse, (pickle, "load"): refuse, (pickle, "loads"): refuse,
                 (pickle, "Unpickler"): Refused}
    saved = {key: getattr(*key) for key in stand_ins}
    try:
        for (obj, attr), value in stand_ins.items():
            setattr(obj, attr, value)
        yield
    finally:
        for (obj, attr), value in saved.items():
            setattr(obj, attr, value)


def ort_session_options() -> Any:
    """onnxruntime options for the job's own thread budget: as many intra-op threads as torch
    has (the sandbox sets both from FXPORT_SANDBOX_THREADS). onnxruntime's default is one per
    core of the machine, which in a container with a CPU limit means throttling, and next to
    the worker's other work means contention."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.intra_op_num_threads = max(1, torch.get_num_threads())
    opts.inter_op_num_threads = 1
    return opts


class OnnxRuntimeRunner(Runner):
    """An ONNX model in onnxruntime on the CPU. `int8_kernels=False` turns graph optimizations off, so
    a Q/DQ model runs as written — QuantizeLinear/DequantizeLinear around float ops — instead of
    on int8 kernels: the numbers the model means, whatever this CPU's int8 kernels do (those of
    x86 without VNNI saturate symmetric int8 activations)."""

    name, runtime = "onnx", "onnxruntime"

    def __init__(self, path: Path, input_names: list[str] | None = None, *, int8_kernels: bool = True) -> None:
        self.path, self.input_names, self.int8_kernels = path, input_names, int8_kernels
        if not int8_kernels:
            self.runtime = "onnxruntime (Q/DQ as written, float kernels)"

    def activate(self) -> None:
        import onnxruntime as ort

        opts = ort_session_options()
        if not self.int8_kernels:
            opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        self.session = ort.InferenceSession(str(self.path), opts, providers=["CPUExecutionProvider"])
        self.feed_names = [i.name for i in self.session.get_inputs()]

    def deactivate(self) -> None:
        self.session = None

    def infer(self, args: tuple[torch.Tensor, ...]) -> list[np.ndarray]:
        feed = {name: arg.detach().cpu().numpy() for name, arg in zip(self.feed_names, args)}
        return [np.asarray(o, dtype=np.float32) if np.asarray(o).dtype.kind == "f" else np.asarray(o)
                for o in self.session.run(None, feed)]
