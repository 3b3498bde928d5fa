"""The targets, one entry each: where the artifact goes, what makes it, what runs it to verify it,
and what it does past the spec's ranges.

Two kinds of target:
- written by the export stage (torchscript, onnx, exported_program, fx_source): `from_graph` (and
  `from_eager` where the eager model can give it) writes the artifact, `runner` runs it in the
  verify and benchmark stages;
- built after the CPU stage (tensorrt): `later` says by which job stage (its own task on its own
  worker queue, "gpu"), from which ONNX model (`later.sources`), and how it is preflighted where
  that ONNX is made, built, recorded and verified (`later.build`); `runner` runs it to benchmark it.
  A worker's CPU stage defers it (request.cpu_stage), the pipeline preflights its ONNX model, and
  workers/jobs.py hands the job to that stage; `fxport convert` on a machine that can build it
  builds it in the same run.

Adding a target:
1. its name in the spec's list, `fxport.spec.TARGETS` (the client install, which never imports the
   engine; tests/workers/engine/test_registry.py keeps the two in step);
2. its exporter (exporters/<name>.py, a `<Output>From<Input>` class) and its runner
   (verify/runners.py), each imported lazily by a small function below;
3. one `Target` in REGISTRY: name, path in the output folder, `from_graph`, `runner` — and
   `from_eager`, `onnx`, `past_range` where they apply. A target built from the ONNX model in a
   stage of its own gets `from_graph=None` and a `LaterStage` instead, like tensorrt.
The pipeline, the request, the worker and the CLI read everything else from the entry.

Exporters and runners are imported when a target is written or run, never here: importing the
registry costs nothing, and a job pays only for the targets it asks for.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fxport.jobs import Stage

if TYPE_CHECKING:
    from fxport.manifest import Manifest
    from fxport.spec import JobSpec
    from fxport.workers.engine.inputs import InputSignature
    from fxport.workers.engine.verify.runners import Runner

TENSORRT_ONNX = "onnx_tensorrt"  # int8 with a CPU target and tensorrt: the engine's own (symmetric) ONNX
# an int8 .pt2 / FX source calls torch.ops.quantized_decomposed.*, defined by this import
QDQ_IMPORT = "import torch.ao.quantization.fx._decomposed  # defines torch.ops.quantized_decomposed (the Q/DQ ops)"
RUNS_PAST_RANGE = "runs (not verified): the artifact has no range of its own"


@dataclass(frozen=True)
class ExportJob:
    """What every exporter may need: the graph (None on the eager path), the model itself, the
    example and the inputs at other shapes a trace is checked at (`extremes`: verification's own
    inputs there), the spec, and the provenance to embed."""

    graph: Any
    module: Any
    example: tuple[Any, ...]
    sig: InputSignature
    spec: JobSpec
    extremes: list[tuple[Any, ...]]
    precision: str
    provenance: dict[str, str] = field(default_factory=dict)
    # the original model's outputs at `extremes`, computed once and shared with verification (fp32)
    reference: Callable[[tuple[Any, ...]], list[Any]] | None = None
    # torch.export programs of the graphs, shared by every ExportJob of one export stage: the .pt2
    # and the ONNX model (opset 18 and up) are both made from one, exported once (id(graph) → program)
    programs: dict[int, Any] = field(default_factory=dict)

    def program(self) -> Any:
        """torch.export of `graph` with the spec's dynamic dims, made on first use and then shared."""
        key = id(self.graph)
        if key not in self.programs:
            from fxport.workers.engine.exporters.exported_program import export_graph

            self.programs[key] = export_graph(self.graph, self.example, self.sig.dynamic_shapes())
        return self.programs[key]

    def extra_files(self) -> dict[str, str]:
        from fxport.workers.engine.exporters.interface import provenance_extra_files

        return provenance_extra_files(self.provenance) if self.provenance else {}


Writer = Callable[[ExportJob, Path], tuple[Path, str]]  # (job, path) -> (what was written, a note or '')


@dataclass(frozen=True)
class LaterStage:
    """How a target the export stage does not write is made: after the CPU stage, by a job stage of
    its own (its own task, on its own worker queue), from the ONNX model the CPU stage exported,
    verified and preflighted."""

    name: str  # the job stage that builds it (a fxport.jobs Stage), also its progress events' stage
    queue: str  # the worker queue that stage's task runs on
    label: str  # how messages name it: "TensorRT preflight"
    sources: tuple[str, ...]  # the REGISTRY targets whose ONNX model it is built from, in order of preference
    int8_runtime: str  # the int8 scheme (quantize/scheme.py) of the ONNX model it is built from
    unavailable: Callable[[], str | None]  # why this machine cannot build it; None when it can
    # (manifest, ONNX model, precision): records its findings; raises on what the build would reject
    preflight: Callable[[Manifest, Path, str], object]
    # (manifest, emit, *, onnx_path, sig, spec, path, reference, reference_label, points, timing_cache):
    # builds the artifact at `path`, records it in the manifest and verifies it against `reference`
    build: Callable[..., Path]

    @property
    def source_paths(self) -> tuple[str, ...]:
        """The file names of `sources`, in the same order (what a worker's later stage downloads)."""
        return tuple(REGISTRY[s].path for s in self.sources)


@dataclass(frozen=True)
class Target:
    name: str
    path: str  # its name in the output folder (a folder for fx_source)
    from_graph: Writer | None  # None: the export stage does not write it (`later` builds it)
    runner: Callable[[Path, InputSignature], Runner]
    from_eager: Writer | None = None  # None: needs a captured graph
    onnx: bool = False  # outputs named and provenance written by finish_onnx; weights may sit in PATH.data
    past_range: Callable[[Path], str] = lambda _path: RUNS_PAST_RANGE
    later: LaterStage | None = None  # built after the CPU stage, from its ONNX model

    def files(self, path: Path) -> list[Path]:
        """Every file the artifact at `path` is made of (a folder's files; an ONNX model's .data)."""
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        data = path.with_name(path.name + ".data")
        if self.onnx and data.exists():
            files.append(data)
        return files


def exported_targets(targets: Iterable[str]) -> list[str]:
    """Those of `targets` the export stage writes, in their order."""
    return [t for t in targets if t in REGISTRY and REGISTRY[t].from_graph is not None]


def later_targets(targets: Iterable[str]) -> list[str]:
    """Those of `targets` a later stage builds from the ONNX model, in their order."""
    return [t for t in targets if t in REGISTRY and REGISTRY[t].later is not None]


def later_stage_of(target: str) -> LaterStage:
    """The later stage that builds `target` (one of `later_targets`)."""
    stage = REGISTRY[target].later
    assert stage is not None, f"{target} is written by the export stage"
    return stage


def later_stage(name: str) -> LaterStage:
    """The later stage called `name` (a job's stage, as workers/jobs.py runs it); ValueError for any other."""
    for target in REGISTRY.values():
        if target.later is not None and target.later.name == name:
            return target.later
    raise ValueError(f"unknown stage {name!r}")


# -- exporters ---------------------------------------------------------------------------------

def _torchscript(job: ExportJob, path: Path) -> tuple[Path, str]:
    if job.precision == "int8":
        from fxport.workers.engine.exporters.torchscript_int8 import TorchScriptInt8FromQdqGraph

        int8 = TorchScriptInt8FromQdqGraph(job.graph, job.example, check_inputs=job.extremes,
                                           extra_files=job.extra_files())
        return int8(path), int8.note
    from fxport.workers.engine.exporters.torchscript import TorchScriptFromGraphModule

    # the original model is fp32: never a stand-in for an fp16 archive
    fp32 = job.precision == "fp32"
    exporter = TorchScriptFromGraphModule(job.graph, job.example, job.spec.torchscript.method,
                                          check_inputs=job.extremes, fallback=job.module if fp32 else None,
                                          extra_files=job.extra_files(), reference=job.reference if fp32 else None)
    return exporter(path), exporter.note


def _exported_program(job: ExportJob, path: Path) -> tuple[Path, str]:
    from fxport.workers.engine.exporters.exported_program import ExportedProgramFromGraphModule

    qdq_import = QDQ_IMPORT.split("  #")[0]
    note = f"load it after `{qdq_import}`: its Q/DQ ops live there" if job.precision == "int8" else ""
    exporter = ExportedProgramFromGraphModule(job.graph, job.example, job.sig.dynamic_shapes(),
                                              extra_files=job.extra_files(), program=job.program)
    return exporter(path), note


def _fx_source(job: ExportJob, path: Path) -> tuple[Path, str]:
    from fxport.workers.engine.exporters.fx_source import FxSourceFromGraphModule

    imports = (QDQ_IMPORT,) if job.precision == "int8" else ()
    return FxSourceFromGraphModule(job.graph, imports=imports)(path), ""


def _onnx(job: ExportJob, path: Path) -> tuple[Path, str]:
    from fxport.workers.engine.exporters.onnx import OnnxFromGraphModule

    sig, spec = job.sig, job.spec
    exporter = OnnxFromGraphModule(
        job.graph, job.example, input_names=[i.name for i in sig.inputs], dynamic_shapes=sig.dynamic_shapes(),
        opset=spec.onnx.opset, single_file=spec.onnx.single_file, dynamic_axes=_dynamic_axes(sig),
        trace_checks=job.extremes, trace_fallback=job.module if job.precision == "fp32" else None,
        trace_reference=job.reference if job.precision == "fp32" else None, program=job.program,
    )
    return exporter(path), exporter.note


def _torchscript_from_eager(job: ExportJob, path: Path) -> tuple[Path, str]:
    from fxport.workers.engine.exporters.eager import TorchScriptFromEagerModule

    scripted = TorchScriptFromEagerModule(job.module, job.example, check_inputs=job.extremes,
                                          extra_files=job.extra_files())
    return scripted(path), scripted.note


def _onnx_from_eager(job: ExportJob, path: Path) -> tuple[Path, str]:
    from fxport.workers.engine.exporters.eager import OnnxFromEagerModule

    sig, spec = job.sig, job.spec
    exporter = OnnxFromEagerModule(job.module, job.example, input_names=[i.name for i in sig.inputs],
                                   opset=spec.onnx.opset, single_file=spec.onnx.single_file,
                                   dynamic_axes=_dynamic_axes(sig), check_inputs=job.extremes,
                                   reference=job.reference, verify=spec.verify)
    return exporter(path), exporter.note


def _dynamic_axes(sig: InputSignature) -> dict[str, dict[int, str]]:
    return {i.name: {k: d for k, d in enumerate(i.shape) if isinstance(d, str)} for i in sig.inputs}


# -- runners -----------------------------------------------------------------------------------

def _torchscript_runner(path: Path, sig: InputSignature) -> Runner:
    from fxport.workers.engine.verify.runners import TorchScriptRunner

    return TorchScriptRunner(path)


def _exported_program_runner(path: Path, sig: InputSignature) -> Runner:
    from fxport.workers.engine.verify.runners import ExportedProgramRunner

    return ExportedProgramRunner(path)


def _fx_source_runner(path: Path, sig: InputSignature) -> Runner:
    from fxport.workers.engine.exporters.fx_source import MODULE_CLASS
    from fxport.workers.engine.verify.runners import FxSourceRunner

    return FxSourceRunner(path, MODULE_CLASS)


def _onnx_runner(name: str) -> Callable[[Path, InputSignature], Runner]:
    def make(path: Path, sig: InputSignature) -> Runner:
        from fxport.workers.engine.verify.runners import OnnxRuntimeRunner

        runner = OnnxRuntimeRunner(path, [i.name for i in sig.inputs])
        runner.name = name
        return runner

    return make


# -- past the spec's ranges (tests/workers/engine/test_interface.py runs each artifact there) ----

def _exported_program_past_range(path: Path) -> str:
    return "refused: torch.export's guards check every dim against its range"


def _fx_source_past_range(path: Path) -> str:
    source = (path / "module.py").read_text(errors="replace") if (path / "module.py").is_file() else ""
    if any(op in source for op in ("_assert_scalar", "sym_constrain_range", "_assert_async")):
        return "refused: the graph kept torch.export's runtime asserts on the dims"
    return RUNS_PAST_RANGE


# -- the TensorRT engine: built from the ONNX model on the GPU queue (workers/engine/tensorrt/) --

def _tensorrt_unavailable() -> str | None:
    from fxport.workers.engine.tensorrt.builder import tensorrt_unavailable

    return tensorrt_unavailable()


def _tensorrt_preflight(manifest: Manifest, onnx_path: Path, precision: str) -> object:
    from fxport.workers.engine.tensorrt.stage import preflight_stage

    return preflight_stage(manifest, onnx_path, precision)


def _tensorrt_build(manifest: Manifest, emit: Callable[[str, float, str], None], **how: Any) -> Path:
    from fxport.workers.engine.tensorrt.stage import build_stage

    return build_stage(manifest, emit, **how)


def _tensorrt_runner(path: Path, sig: InputSignature) -> Runner:
    from fxport.workers.engine.tensorrt.runner import TrtRunner

    return TrtRunner(path, [i.name for i in sig.inputs])


TENSORRT_STAGE = LaterStage(
    name=Stage.TENSORRT.value, queue="gpu", label="TensorRT",
    # an int8 job with a CPU target makes the engine its own (symmetric) ONNX beside model.onnx
    sources=(TENSORRT_ONNX, "onnx"), int8_runtime="tensorrt",
    unavailable=_tensorrt_unavailable, preflight=_tensorrt_preflight, build=_tensorrt_build,
)

REGISTRY: dict[str, Target] = {t.name: t for t in (
    Target("torchscript", "model.ts", _torchscript, _torchscript_runner, from_eager=_torchscript_from_eager),
    Target("onnx", "model.onnx", _onnx, _onnx_runner("onnx"), from_eager=_onnx_from_eager, onnx=True),
    Target("exported_program", "model.pt2", _exported_program, _exported_program_runner,
           past_range=_exported_program_past_range),
    Target("fx_source", "fx_source", _fx_source, _fx_source_runner, past_range=_fx_source_past_range),
    Target("tensorrt", "model.engine", None, _tensorrt_runner, later=TENSORRT_STAGE),
    Target(TENSORRT_ONNX, "model.tensorrt.onnx", _onnx, _onnx_runner(TENSORRT_ONNX), onnx=True),
)}
