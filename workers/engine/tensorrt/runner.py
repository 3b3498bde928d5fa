"""TrtRunner: a TensorRT engine behind the verify Runner interface (`with runner: runner.infer(args)`).

Buffers are torch CUDA tensors; execution is TensorRT 10's name-based API:
`set_input_shape` / `set_tensor_address` per I/O tensor, then `execute_async_v3` on a torch
CUDA stream. The optimization profile is chosen per call from the input shapes, so one
runner checks an engine at every profile's min and max shape.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fxport.workers.engine.verify.runners import Runner

# TensorRT DataType name -> torch dtype attribute name
_TORCH_DTYPES = {"FLOAT": "float32", "HALF": "float16", "BF16": "bfloat16", "INT8": "int8", "INT32": "int32",
                 "INT64": "int64", "BOOL": "bool", "UINT8": "uint8", "FP8": "float8_e4m3fn"}


def torch_dtype(trt_dtype: Any) -> Any:
    import torch

    name = getattr(trt_dtype, "name", str(trt_dtype)).rsplit(".", 1)[-1]
    if name not in _TORCH_DTYPES:
        raise TypeError(f"TensorRT tensor type {name} has no torch equivalent here")
    return getattr(torch, _TORCH_DTYPES[name])


class TrtRunner(Runner):
    """Runs a serialized engine (a path, bytes, or a loader of bytes) on CUDA device 0.

    `input_names` maps the positional args of `infer` to engine inputs (default: the
    engine's input order); `output_names` orders the outputs (default: the engine's order),
    so they line up with the reference runner's outputs (ONNX graph output order).
    """

    name, runtime = "tensorrt", "tensorrt"

    def __init__(self, engine: Path | bytes | Callable[[], bytes], input_names: Sequence[str] | None = None,
                 output_names: Sequence[str] | None = None) -> None:
        self.source, self.input_names, self.output_names = engine, input_names, output_names
        self.engine: Any = None
        self.context: Any = None

    def activate(self) -> None:
        import torch

        from fxport.workers.engine.tensorrt.builder import EngineFromBytes, import_tensorrt

        trt = import_tensorrt()
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device is visible: a TensorRT engine runs only on a GPU")
        self._trt, self._torch = trt, torch
        self.device = torch.device("cuda", 0)
        source = self.source
        data = Path(source).read_bytes() if isinstance(source, (str, Path)) else source
        self._loader: EngineFromBytes | None = EngineFromBytes(data)
        self.engine = self._loader()
        self.context = self.engine.create_execution_context()
        if self.context is None:
            raise RuntimeError("TensorRT could not create an execution context (out of GPU memory?)")
        self.stream = torch.cuda.Stream(device=self.device)
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        is_input = {n: self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT for n in names}
        engine_inputs = [n for n in names if is_input[n]]
        engine_outputs = [n for n in names if not is_input[n]]
        self.inputs = list(self.input_names or engine_inputs)
        self.outputs = [n for n in (self.output_names or engine_outputs) if n in engine_outputs]
        unknown = [n for n in self.inputs if n not in engine_inputs]
        if unknown or len(self.inputs) != len(engine_inputs):
            raise RuntimeError(f"inputs {self.inputs} do not match the engine's inputs {engine_inputs}")
        self.profile = -1

    def deactivate(self) -> None:
        self.context = None
        self.engine = None
        self._loader = None

    def profile_ranges(self, index: int) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
        """(min, opt, max) per input of optimization profile `index`."""
        out = {}
        for name in self.inputs:
            lo, opt, hi = self.engine.get_tensor_profile_shape(name, index)
            out[name] = (tuple(lo), tuple(opt), tuple(hi))
        return out

    def _select_profile(self, shapes: dict[str, tuple[int, ...]]) -> int:
        count = int(self.engine.num_optimization_profiles)
        dynamic = any(d < 0 for n in self.inputs for d in self.engine.get_tensor_shape(n))
        if not dynamic or count == 0:
            return 0
        for index in range(count):
            ranges = self.profile_ranges(index)
            if all(len(shapes[n]) == len(r[0]) and all(lo <= s <= hi for s, lo, hi in zip(shapes[n], r[0], r[2]))
                   for n, r in ranges.items()):
                return index
        raise ValueError(f"input shapes {shapes} are outside every optimization profile of the engine "
                         f"({[self.profile_ranges(i) for i in range(count)]})")

    def infer(self, args: tuple[Any, ...]) -> list[np.ndarray]:
        run, outputs, keep = self._bind(args)
        run()
        self.stream.synchronize()
        del keep
        return [o.float().cpu().numpy() if o.is_floating_point() else o.cpu().numpy() for o in outputs]

    def bind(self, args: tuple[Any, ...]) -> Callable[[], None]:
        """Copy `args` to the GPU and allocate the outputs once; the returned call enqueues one
        inference on `self.stream` on those buffers (no copies: engine time only, for benchmarks)."""
        run, outputs, keep = self._bind(args)
        self._bound = (outputs, keep)  # the buffers must live as long as the call may be made
        return run

    def _bind(self, args: tuple[Any, ...]) -> tuple[Callable[[], None], list[Any], list[Any]]:
        torch, ctx = self._torch, self.context
        if len(args) != len(self.inputs):
            raise ValueError(f"the engine takes {len(self.inputs)} inputs, got {len(args)}")
        shapes = {n: tuple(int(d) for d in a.shape) for n, a in zip(self.inputs, args)}
        index = self._select_profile(shapes)
        if index != self.profile:
            ctx.set_optimization_profile_async(index, self.stream.cuda_stream)
            self.profile = index
        keep = []
        for name, arg in zip(self.inputs, args):
            tensor = torch.as_tensor(arg).to(device=self.device, dtype=torch_dtype(self.engine.get_tensor_dtype(name)))
            tensor = tensor.contiguous()
            keep.append(tensor)
            if not ctx.set_input_shape(name, tuple(tensor.shape)):
                raise ValueError(f"TensorRT refused shape {tuple(tensor.shape)} for input {name!r}")
            ctx.set_tensor_address(name, tensor.data_ptr())
        outputs = []
        for name in self.outputs:
            shape = tuple(ctx.get_tensor_shape(name))
            if any(d < 0 for d in shape):
                raise RuntimeError(f"output {name!r} has a data-dependent shape {shape}; this runner needs output "
                                   "shapes that follow from the input shapes")
            out = torch.empty(shape, dtype=torch_dtype(self.engine.get_tensor_dtype(name)), device=self.device)
            ctx.set_tensor_address(name, out.data_ptr())
            outputs.append(out)
        # inputs were copied on the current stream; the engine runs on ours
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

        def run() -> None:
            if not ctx.execute_async_v3(self.stream.cuda_stream):
                raise RuntimeError("TensorRT execute_async_v3 failed")

        return run, outputs, keep + outputs
