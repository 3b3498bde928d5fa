"""TensorRT engine building as lazy loaders: `SaveEngine(EngineBytesFromNetwork(NetworkFromOnnxPath(p)), out)`.

Each loader only stores its arguments; calling it does the work (Polygraphy's style), so a
pipeline is built first and run once. Written against TensorRT 10's Python API:
`Builder`, `create_network`, `OnnxParser.parse_from_file`, `IBuilderConfig` (memory pool
limit, builder flags, optimization profiles, timing cache), `build_serialized_network`.
TensorRT is imported inside the calls, never at module level.

Precision (`plan_precision`, a pure function):
- fp32: no reduced-precision flag, TF32 off — fp32 means fp32 (TensorRT enables TF32 by
  default on Ampere and newer).
- fp16: an ONNX model that already computes in fp16 (fxport's fp16 graph: casts, with the
  ops that must stay fp32 kept so) builds as a *strongly typed* network, which keeps those
  types exactly; an fp32 ONNX model builds with the FP16 builder flag (TensorRT 10).
- int8: explicit quantization from the Q/DQ pairs in the ONNX model: the INT8 flag on
  TensorRT 10 (layers outside Q/DQ stay fp32), a strongly typed network where the flags no
  longer exist (TensorRT 11 removed them). Implicit (calibrator) int8 is not offered.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fxport.errors import ConversionFailed
from fxport.workers.engine.tensorrt.profiles import OptimizationProfile, check_against_network


def import_tensorrt() -> Any:
    """`import tensorrt`, or a ConversionFailed that says where TensorRT comes from."""
    try:
        import tensorrt as trt
    except ImportError as exc:
        raise ConversionFailed(
            f"TensorRT is not installed on this machine ({exc})", stage="tensorrt",
            hint="the tensorrt target builds on a GPU worker (queue gpu) from NVIDIA's TensorRT container image; "
                 "submit the job to a server that has one, or `pip install 'fxport[gpu]'` on a machine with CUDA",
        ) from exc
    return trt


def tensorrt_unavailable() -> str | None:
    """Why a TensorRT engine cannot be built in this process, or None when it can."""
    try:
        import tensorrt  # noqa: F401
    except Exception as exc:
        return f"TensorRT is not installed ({type(exc).__name__}: {exc})"
    try:
        import torch

        if not torch.cuda.is_available():
            return "no CUDA device is visible to this process (torch.cuda.is_available() is False)"
    except Exception as exc:
        return f"CUDA could not be queried ({type(exc).__name__}: {exc})"
    return None


_LOGGER: Any = None


def make_logger(trt: Any) -> Any:
    """This process's TensorRT logger, keeping warnings and errors so a failed build can say why.

    One per process, never freed: TensorRT keeps the first logger it is given for its global
    messages, so a logger that was garbage-collected would leave it a dangling pointer."""
    global _LOGGER
    if _LOGGER is not None:
        return _LOGGER

    class _Logger(trt.ILogger):
        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self.messages: deque[tuple[int, str, str]] = deque(maxlen=500)  # (seq, level, text)
            self.seq = 0

        def log(self, severity: Any, msg: str) -> None:
            level = getattr(severity, "name", str(severity)).rsplit(".", 1)[-1]
            if level in ("INTERNAL_ERROR", "ERROR", "WARNING"):
                self.seq += 1
                self.messages.append((self.seq, "warning" if level == "WARNING" else "error", msg))

        def mark(self) -> int:
            return self.seq

        def errors(self, since: int = 0, last: int = 5) -> list[str]:
            return [m for seq, level, m in self.messages if seq > since and level == "error"][-last:]

    _LOGGER = _Logger()
    return _LOGGER


# ---------------------------------------------------------------------------------------
# Precision plan (pure)
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PrecisionPlan:
    precision: str
    strongly_typed: bool
    set_flags: tuple[str, ...] = ()
    clear_flags: tuple[str, ...] = ()
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"precision": self.precision, "network": "strongly_typed" if self.strongly_typed else "weakly_typed",
                "builder_flags": list(self.set_flags), "cleared_flags": list(self.clear_flags), "note": self.note}


def plan_precision(precision: str, *, onnx_has_fp16: bool, onnx_has_qdq: bool, builder_flags: set[str],
                   tensorrt_version: str = "") -> PrecisionPlan:
    """How to ask TensorRT for `precision`, given what the ONNX model carries and which
    BuilderFlag names this TensorRT has. Raises ConversionFailed when it cannot be had."""
    legacy_flags = "FP16" in builder_flags  # TensorRT 10: weakly typed networks + precision flags
    tf32 = ("TF32",) if "TF32" in builder_flags else ()
    if precision == "fp32":
        return PrecisionPlan("fp32", strongly_typed=not legacy_flags, clear_flags=tf32,
                             note="fp32 kernels only (TF32 disabled)")
    if precision == "fp16":
        if onnx_has_fp16:
            return PrecisionPlan("fp16", strongly_typed=True,
                                 note="strongly typed: the fp16/fp32 types of the ONNX graph are kept as they are")
        if legacy_flags:
            return PrecisionPlan("fp16", strongly_typed=False, set_flags=("FP16",),
                                 note="FP16 builder flag: TensorRT picks fp16 or fp32 kernels per layer")
        raise ConversionFailed(
            f"TensorRT {tensorrt_version or ''} has no FP16 builder flag (networks are strongly typed), and this ONNX "
            "model computes in fp32", stage="tensorrt", field="precision",
            hint="upload the PyTorch model: fxport's fp16 stage makes an fp16 ONNX model the engine keeps as it is")
    if precision == "int8":
        if not onnx_has_qdq:
            raise ConversionFailed(
                "precision int8 builds from explicit quantization, and this ONNX model has no QuantizeLinear/"
                "DequantizeLinear pairs", stage="tensorrt", field="precision",
                hint="upload the PyTorch model with calibration data: fxport's int8 stage inserts the Q/DQ pairs")
        if "INT8" in builder_flags:
            return PrecisionPlan("int8", strongly_typed=False, set_flags=("INT8",),
                                 note="explicit quantization (Q/DQ) with the INT8 flag; layers outside Q/DQ run fp32")
        return PrecisionPlan("int8", strongly_typed=True, note="explicit quantization (Q/DQ), strongly typed network")
    raise ConversionFailed(f"unknown precision {precision!r}", stage="tensorrt", field="precision")


def onnx_precision_traits(model: Any) -> tuple[bool, bool]:
    """(computes in fp16, has Q/DQ pairs) for an ONNX ModelProto — graph and subgraphs."""
    has_fp16 = has_qdq = False

    def walk(graph: Any) -> None:
        nonlocal has_fp16, has_qdq
        if any(i.data_type == 10 for i in graph.initializer):  # 10 = FLOAT16
            has_fp16 = True
        for node in graph.node:
            if node.op_type in ("QuantizeLinear", "DequantizeLinear"):
                has_qdq = True
            if node.op_type == "Cast" and any(a.name == "to" and a.i == 10 for a in node.attribute):
                has_fp16 = True
            for attr in node.attribute:
                if attr.type == 5:
                    walk(attr.g)
                elif attr.type == 10:
                    for g in attr.graphs:
                        walk(g)

    walk(model.graph)
    return has_fp16, has_qdq


# ---------------------------------------------------------------------------------------
# Loaders
# ---------------------------------------------------------------------------------------


@dataclass
class ParsedNetwork:
    """What TensorRT's ONNX parser produced. The parser owns the weights' memory: it must live
    as long as the network does, so the three travel together."""

    trt: Any
    logger: Any
    builder: Any
    network: Any
    parser: Any
    strongly_typed: bool
    log_mark: int = 0  # where this network's messages start in the process logger

    def input_shapes(self) -> dict[str, tuple[int, ...]]:
        return {self.network.get_input(i).name: tuple(self.network.get_input(i).shape)
                for i in range(self.network.num_inputs)}


class NetworkFromOnnxPath:
    """ONNX file → TensorRT network (parsed). A parser error names the node and op."""

    def __init__(self, path: Path, *, strongly_typed: bool = False) -> None:
        self.path, self.strongly_typed = Path(path), strongly_typed

    def __call__(self) -> ParsedNetwork:
        trt = import_tensorrt()
        logger = make_logger(trt)
        mark = logger.mark()
        builder = trt.Builder(logger)
        flags = 0
        if self.strongly_typed and hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED"):
            flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
        network = builder.create_network(flags)
        parser = trt.OnnxParser(network, logger)
        # parse_from_file (not parse(bytes)) so weights in model.onnx.data beside the file load too
        if not parser.parse_from_file(str(self.path)):
            errors = parser_errors(parser, self.path)
            first = errors[0] if errors else "no error recorded"
            raise ConversionFailed(
                f"TensorRT's ONNX parser rejected the model: {first}"
                + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""),
                stage="tensorrt", field="targets", detail="\n".join(errors + logger.errors(mark)),
                hint="the named node's op or attributes are not supported by this TensorRT; drop tensorrt from targets "
                     "or change the model so that op is not exported",
            )
        return ParsedNetwork(trt, logger, builder, network, parser, self.strongly_typed, mark)


def parser_errors(parser: Any, onnx_path: Path | None = None) -> list[str]:
    """One line per parser error: node name, op type, description, error code."""
    lookup: list[tuple[str, str]] | None = None
    lines = []
    for i in range(int(parser.num_errors)):
        err = parser.get_error(i)
        name, op = _call(err, "node_name"), _call(err, "node_operator")
        index = _call(err, "node")
        if (not name or not op) and isinstance(index, int) and index >= 0:
            if lookup is None:
                lookup = _onnx_nodes(onnx_path)
            if index < len(lookup):
                name, op = name or lookup[index][0], op or lookup[index][1]
        desc = _call(err, "desc") or str(err)
        code = _call(err, "code")
        subject = f"node {name!r} (op {op or '?'})" if name or op else "the model"
        lines.append(f"{subject}: {desc}" + (f" [{getattr(code, 'name', code)}]" if code is not None else ""))
    return lines


def _call(obj: Any, attr: str) -> Any:
    value = getattr(obj, attr, None)
    try:
        return value() if callable(value) else value
    except Exception:
        return None


def _onnx_nodes(path: Path | None) -> list[tuple[str, str]]:
    if path is None:
        return []
    try:
        import onnx

        model = onnx.load(str(path), load_external_data=False)
        return [(n.name or f"#{i} (output {n.output[0] if n.output else ''})", n.op_type)
                for i, n in enumerate(model.graph.node)]
    except Exception:
        return []


@dataclass
class BuildReport:
    build_s: float = 0.0
    engine_bytes: int = 0
    timing_cache: dict[str, Any] = field(default_factory=dict)
    plan: dict[str, Any] = field(default_factory=dict)
    workspace_mb: int = 0
    warnings: list[str] = field(default_factory=list)


class EngineBytesFromNetwork:
    """Parsed network → serialized engine (bytes), built with the precision plan, a workspace
    limit, the optimization profiles and (optionally) a timing cache file read before the build;
    the merged cache (what was read + this build's timings) goes to `timing_cache_out` (default:
    the same file). `report` describes the build."""

    def __init__(self, network: Callable[[], ParsedNetwork], *, plan: PrecisionPlan, workspace_mb: int,
                 profiles: Sequence[OptimizationProfile] = (), timing_cache: Path | None = None,
                 timing_cache_out: Path | None = None, use_timing_cache: bool = True) -> None:
        self.network, self.plan, self.workspace_mb = network, plan, workspace_mb
        self.profiles, self.timing_cache, self.use_timing_cache = list(profiles), timing_cache, use_timing_cache
        self.timing_cache_out = timing_cache_out or timing_cache
        self.report = BuildReport()

    def __call__(self) -> bytes:
        from fxport.workers.engine.tensorrt.timing_cache import load_timing_cache, save_timing_cache

        parsed = self.network()
        trt, builder, network = parsed.trt, parsed.builder, parsed.network
        problems = []
        candidates: Sequence[OptimizationProfile | None] = self.profiles or [None]
        for profile in candidates:
            problems += check_against_network(profile, parsed.input_shapes())
        if problems:
            raise ConversionFailed("the spec's input shapes do not fit the ONNX model: " + "; ".join(problems),
                                   stage="tensorrt", field="inputs")
        config = builder.create_builder_config()
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(self.workspace_mb) << 20)
        for name in self.plan.set_flags:
            config.set_flag(getattr(trt.BuilderFlag, name))
        for name in self.plan.clear_flags:
            config.clear_flag(getattr(trt.BuilderFlag, name))
        network_inputs = parsed.input_shapes()
        for profile in self.profiles:
            trt_profile = builder.create_optimization_profile()
            for name, rng in profile.shapes:
                if name in network_inputs:
                    trt_profile.set_shape(name, rng.min, rng.opt, rng.max)
            config.add_optimization_profile(trt_profile)
        loaded = None
        if self.use_timing_cache:
            loaded = load_timing_cache(config, self.timing_cache)
            if loaded.warning:
                self.report.warnings.append(loaded.warning)
        else:
            config.set_flag(trt.BuilderFlag.DISABLE_TIMING_CACHE)
        start = time.perf_counter()
        serialized = builder.build_serialized_network(network, config)
        self.report.build_s = round(time.perf_counter() - start, 3)
        if serialized is None:
            reasons = parsed.logger.errors(parsed.log_mark) or ["TensorRT logged no error"]
            raise ConversionFailed(f"TensorRT could not build the engine: {reasons[-1]}", stage="tensorrt",
                                   detail="\n".join(reasons),
                                   hint="raise spec.tensorrt.workspace_mb, or check the GPU's free memory")
        data = bytes(memoryview(serialized))
        self.report.engine_bytes = len(data)
        self.report.plan = self.plan.as_dict()
        self.report.workspace_mb = int(self.workspace_mb)
        if loaded is not None:
            self.report.timing_cache = loaded.as_dict()
            if self.timing_cache_out is not None:
                try:
                    self.report.timing_cache["bytes_out"] = save_timing_cache(config, self.timing_cache_out)
                except Exception as exc:  # a cache that cannot be saved costs the next build time, nothing more
                    self.report.warnings.append(f"timing cache not saved: {type(exc).__name__}: {exc}")
        else:
            self.report.timing_cache = {"status": "disabled"}
        return data


class EngineFromBytes:
    """Serialized engine (bytes, or a loader of them) → ICudaEngine."""

    def __init__(self, data: bytes | Callable[[], bytes]) -> None:
        self.data = data

    def __call__(self) -> Any:
        trt = import_tensorrt()
        data = self.data() if callable(self.data) else self.data
        self.runtime = trt.Runtime(make_logger(trt))  # kept here: the runtime must outlive the engine
        engine = self.runtime.deserialize_cuda_engine(data)
        if engine is None:
            raise ConversionFailed("TensorRT could not deserialize the engine (built for another GPU model or "
                                   "TensorRT version?)", stage="tensorrt")
        return engine


class SaveEngine:
    """Serialized engine (from a loader) → file at `path`. Returns the path."""

    def __init__(self, data: Callable[[], bytes], path: Path) -> None:
        self.data, self.path = data, Path(path)

    def __call__(self) -> Path:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_bytes(self.data())
        return self.path


# ---------------------------------------------------------------------------------------
# Engine metadata for the manifest
# ---------------------------------------------------------------------------------------


def cuda_driver_version() -> str | None:
    """The CUDA version the driver supports (cuDriverGetVersion), e.g. "12.4"; None without libcuda."""
    import ctypes

    try:
        lib = ctypes.CDLL("libcuda.so.1")
        value = ctypes.c_int(0)
        if lib.cuDriverGetVersion(ctypes.byref(value)) != 0:
            return None
        return f"{value.value // 1000}.{(value.value % 1000) // 10}"
    except OSError:
        return None


def engine_metadata(trt: Any, engine: Any, *, report: BuildReport, profiles: Sequence[OptimizationProfile],
                    precision: str) -> dict[str, Any]:
    """What the engine needs to run, and how it was built: TensorRT version, GPU, compute
    capability, CUDA versions, precision, optimization profiles, I/O tensors."""
    import torch

    major, minor = torch.cuda.get_device_capability(0)
    cc = f"{major}.{minor}"
    gpu_name = torch.cuda.get_device_name(0)
    io = []
    for i in range(engine.num_io_tensors):
        name = engine.get_tensor_name(i)
        io.append({"name": name, "mode": engine.get_tensor_mode(name).name,
                   "dtype": engine.get_tensor_dtype(name).name, "shape": list(engine.get_tensor_shape(name))})
    return {
        "tensorrt_version": str(trt.__version__),
        "gpu_name": gpu_name,
        "compute_capability": cc,
        "cuda_driver_version": cuda_driver_version(),
        "cuda_runtime_version_torch": torch.version.cuda,
        "precision": precision,
        **report.plan,
        "profiles": [p.as_dict() for p in profiles],
        "num_optimization_profiles": int(engine.num_optimization_profiles),
        "io_tensors": io,
        "workspace_mb": report.workspace_mb,
        "build_s": report.build_s,
        "engine_bytes": report.engine_bytes,
        "runs_on": f"{gpu_name} (compute capability {cc}) with TensorRT {trt.__version__}: an engine is tied "
                   "to the GPU model and TensorRT version it was built with",
    }
