"""The conversion engine end to end: load → capture → passes → export → verify → manifest.

`convert` is the one entry point. Workers call it inside the sandbox; `fxport convert` calls
it in-process. It always leaves manifest.json in `out_dir`, also when a stage fails.
"""

from __future__ import annotations

import json
import platform
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

import fxport
from fxport.errors import ConversionFailed, FxportError, InvalidInput, ResourceLimitExceeded, VerificationFailed
from fxport.spec import JobSpec
from fxport.workers.engine.capture import capture_ladder
from fxport.workers.engine.exporters import file_sha256
from fxport.workers.engine.inputs import InputSignature, resolve_signature
from fxport.workers.engine.load import LoadedModel, load_model
from fxport.workers.engine.passes import PassContext, run_passes
from fxport.workers.engine.verify.comparator import SamplePoint, verify_artifacts

ProgressFn = Callable[[dict[str, Any]], None]

ARTIFACT_PATHS = {
    "torchscript": "model.ts",
    "onnx": "model.onnx",
    "exported_program": "model.pt2",
    "fx_source": "fx_source",
}
TORCH_TARGETS = ("torchscript", "exported_program", "fx_source")


def toolchain() -> dict[str, str | None]:
    versions: dict[str, str | None] = {"fxport": fxport.__version__, "python": platform.python_version(),
                                       "torch": torch.__version__}
    for mod in ("onnx", "onnxruntime", "tensorrt"):
        try:
            versions[mod] = __import__(mod).__version__
        except Exception:
            versions[mod] = None
    return versions


class _Run:
    """Per-conversion bookkeeping: the manifest being built, stage timings, progress events."""

    def __init__(self, manifest: dict[str, Any], on_progress: ProgressFn | None) -> None:
        self.manifest, self.on_progress = manifest, on_progress

    def emit(self, stage: str, progress: float, message: str = "") -> None:
        if self.on_progress:
            self.on_progress({"stage": stage, "progress": round(progress, 3), "message": message})

    @contextmanager
    def stage(self, name: str, message: str = "") -> Iterator[None]:
        self.emit(name, 0.0, message)
        start = time.perf_counter()
        try:
            yield
        except FxportError as exc:
            exc.stage = exc.stage or name
            raise
        except MemoryError as exc:
            raise ResourceLimitExceeded(f"the model ran out of its memory limit during {name}", stage=name) from exc
        except Exception as exc:
            raise ConversionFailed(f"{name} failed: {type(exc).__name__}: {exc}", stage=name) from exc
        finally:
            self.manifest["timings_s"][name] = round(time.perf_counter() - start, 4)
        self.emit(name, 1.0, "done")


def convert(
    model_path: Path,
    spec: JobSpec,
    out_dir: Path,
    *,
    job_id: str | None = None,
    calibration_path: Path | None = None,
    on_progress: ProgressFn | None = None,
) -> dict[str, Any]:
    """Convert the model at `model_path` per `spec` into `out_dir`. Returns the manifest.

    Raises an FxportError subclass naming the stage; manifest.json is written either way.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest: dict[str, Any] = {
        "fxport_version": fxport.__version__,
        "job_id": job_id,
        "toolchain": toolchain(),
        "input": {"format": None, "sha256": file_sha256(model_path), "bytes": model_path.stat().st_size},
        "spec": spec.normalized(),
        "capture": None,
        "passes": [],
        "artifacts": [],
        "verification": [],
        "profile": None,
        "warnings": [],
        "timings_s": {},
        "status": "running",
        "error": None,
    }
    run = _Run(manifest, on_progress)
    try:
        _convert(run, model_path, spec, out_dir)
        manifest["status"] = "succeeded"
    except FxportError as exc:
        manifest["status"] = "failed"
        manifest["error"] = exc.to_dict()
        raise
    except Exception as exc:  # an engine bug: still a clean, named failure
        manifest["status"] = "failed"
        err = ConversionFailed(f"internal error: {type(exc).__name__}: {exc}", stage="export")
        manifest["error"] = err.to_dict()
        raise err from exc
    finally:
        (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2, default=str))
        _write_report(out_dir / "manifest.json", manifest)
    return manifest


def _write_report(manifest_path: Path, manifest: dict[str, Any]) -> None:
    """report.html beside the manifest. A report problem never fails the conversion."""
    from fxport.report import write_report

    try:
        write_report(manifest_path)
    except Exception as exc:
        manifest["warnings"].append(f"report.html could not be written: {type(exc).__name__}: {exc}")
        manifest_path.write_text(json.dumps(manifest, indent=2, default=str))


def _convert(run: _Run, model_path: Path, spec: JobSpec, out_dir: Path) -> None:
    manifest = run.manifest
    torch.manual_seed(spec.verify.seed)
    with run.stage("load"):
        loaded = load_model(model_path)
        manifest["input"]["format"] = loaded.format
        _check_targets(loaded, spec)
        sig = resolve_signature(spec, loaded) if loaded.format != "onnx" else None
        if sig is not None:
            manifest["inputs"] = {
                "inputs": [i.model_dump() for i in sig.inputs],
                "dynamic_dims": {k: v.model_dump() for k, v in sig.dynamic_dims.items()},
            }
            manifest["warnings"].extend(sig.notes)
    if loaded.format == "onnx":
        _convert_onnx_input(run, loaded, spec, out_dir)
        return
    assert sig is not None

    with run.stage("capture"):
        captured = capture_ladder(loaded, sig, spec.capture)
        manifest["capture"] = {"method": captured.method, "level": captured.level, "attempts": captured.attempts}
    gm = captured.graph_module
    example = sig.make_inputs(sig.export_point(), seed=spec.verify.seed)

    with run.stage("passes"):
        ctx = PassContext(level=captured.level, example_inputs=example)
        manifest["graph_before"] = _graph_summary(gm)
        gm, records = run_passes(gm, spec.passes, ctx)
        manifest["passes"] = records
        manifest["graph_after"] = _graph_summary(gm)
        if "profile" in ctx.report:
            manifest["profile"] = ctx.report["profile"]

    if spec.precision != "fp32":
        raise InvalidInput(
            f"precision {spec.precision!r} is not available yet in this build",
            stage="quantize", field="precision", hint="use precision: fp32",
        )

    written: dict[str, Path] = {}
    with run.stage("export"):
        targets = [t for t in spec.targets if t in ARTIFACT_PATHS]
        extremes = [sig.make_inputs(dims, seed=spec.verify.seed) for dims in sig.shape_points()]
        for i, target in enumerate(targets):
            run.emit("export", i / max(len(targets), 1), target)
            written[target], note = _export_one(target, gm, example, sig, spec, out_dir,
                                                original=loaded.module, extremes=extremes)
            if note:
                manifest["warnings"].append(f"{target}: {note}")
        for target, path in written.items():
            manifest["artifacts"].extend(_artifact_records(target, path, out_dir))

    with run.stage("verify"):
        points = _sample_points(sig, spec)
        runners = _runners(written, sig)
        from fxport.workers.engine.verify.runners import EagerRunner

        records = verify_artifacts(
            EagerRunner(loaded.module), runners, points, spec.verify,
            on_runner=lambda name: run.emit("verify", 0.5, name),
        )
        manifest["verification"] = records
        failed = [r for r in records if not r["passed"]]
        if failed:
            table = "; ".join(
                f"{r['format']}: " + (r.get("error") or
                                      f"max_abs_diff={r['max_abs_diff']:.3g} cosine={r['cosine']:.6f}")
                for r in failed
            )
            if spec.verify.fail_on_mismatch:
                raise VerificationFailed(
                    f"{len(failed)} artifact(s) do not match the original model (atol={spec.verify.atol}, "
                    f"rtol={spec.verify.rtol}, min_cosine={spec.verify.min_cosine}): {table}",
                    stage="verify",
                    hint="inspect manifest.json 'verification'; loosen spec.verify only if the difference is expected",
                )
            manifest["warnings"].append(f"verification mismatches allowed by spec.verify.fail_on_mismatch=false: {table}")


def _check_targets(loaded: LoadedModel, spec: JobSpec) -> None:
    if loaded.format == "onnx":
        bad = [t for t in spec.targets if t not in ("onnx", "tensorrt")]
        if bad:
            raise InvalidInput(
                f"an ONNX model converts only to onnx and tensorrt; it cannot give {', '.join(bad)}",
                stage="load", field="targets", hint="upload the PyTorch model (.pt2) for torch targets",
            )
    if "tensorrt" in spec.targets:
        raise InvalidInput(
            "the tensorrt target needs a GPU worker, which this build does not have yet",
            stage="load", field="targets", hint="drop tensorrt from targets",
        )


def _export_one(target: str, gm: Any, example: tuple[Any, ...], sig: InputSignature, spec: JobSpec, out_dir: Path,
                *, original: Any, extremes: list[tuple[Any, ...]]) -> tuple[Path, str]:
    """Write one artifact. Returns its path and a note for the manifest ('' when none)."""
    path = out_dir / ARTIFACT_PATHS[target]
    try:
        if target == "torchscript":
            from fxport.workers.engine.exporters.torchscript import TorchScriptFromGraphModule

            exporter = TorchScriptFromGraphModule(gm, example, spec.torchscript.method,
                                                  check_inputs=extremes, fallback=original)
            return exporter(path), exporter.note
        if target == "exported_program":
            from fxport.workers.engine.exporters.exported_program import ExportedProgramFromGraphModule

            return ExportedProgramFromGraphModule(gm, example, sig.dynamic_shapes())(path), ""
        if target == "fx_source":
            from fxport.workers.engine.exporters.fx_source import FxSourceFromGraphModule

            if path.exists():
                shutil.rmtree(path)
            return FxSourceFromGraphModule(gm)(path), ""
        from fxport.workers.engine.exporters.onnx import OnnxFromGraphModule

        return OnnxFromGraphModule(
            gm, example, input_names=[i.name for i in sig.inputs], dynamic_shapes=sig.dynamic_shapes(),
            opset=spec.onnx.opset, single_file=spec.onnx.single_file,
        )(path), ""
    except FxportError:
        raise
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ConversionFailed(
            f"{target} export failed: {type(exc).__name__}: {first}", stage="export",
            hint=f"drop {target!r} from targets to get the other artifacts",
        ) from exc


def _artifact_records(target: str, path: Path, out_dir: Path) -> list[dict[str, Any]]:
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    if target == "onnx" and (out_dir / "model.onnx.data").exists():
        files.append(out_dir / "model.onnx.data")
    return [
        {"format": target, "path": str(f.relative_to(out_dir)), "bytes": f.stat().st_size, "sha256": file_sha256(f)}
        for f in files
    ]


def _sample_points(sig: InputSignature, spec: JobSpec) -> list[SamplePoint]:
    """spec.verify.samples inputs at the opt shape, one at every other dynamic-shape extreme."""
    points = []
    shape_points = sig.shape_points()
    opt = {n: r.opt for n, r in sig.dynamic_dims.items()}
    for s in range(spec.verify.samples):
        points.append(SamplePoint(opt, sig.make_inputs(opt, seed=spec.verify.seed + 1 + s)))
    for i, dims in enumerate(shape_points):
        if dims != opt:
            points.append(SamplePoint(dims, sig.make_inputs(dims, seed=spec.verify.seed + 1000 + i)))
    return points


def _runners(written: dict[str, Path], sig: InputSignature) -> list[Any]:
    from fxport.workers.engine.exporters.fx_source import MODULE_CLASS
    from fxport.workers.engine.verify import runners as r

    out = []
    for target, path in written.items():
        if target == "torchscript":
            out.append(r.TorchScriptRunner(path))
        elif target == "exported_program":
            out.append(r.ExportedProgramRunner(path))
        elif target == "fx_source":
            out.append(r.FxSourceRunner(path, MODULE_CLASS))
        elif target == "onnx":
            out.append(r.OnnxRuntimeRunner(path, [i.name for i in sig.inputs]))
    return out


def _graph_summary(gm: Any) -> dict[str, Any]:
    """Node list of the graph (op, target, inputs) — enough to draw it later from the manifest alone."""
    nodes = []
    for n in gm.graph.nodes:
        nodes.append({
            "name": n.name, "op": n.op, "target": _target_name(n.target),
            "inputs": [a.name for a in n.all_input_nodes],
        })
    counts: dict[str, int] = {}
    for n in nodes:
        if n["op"] in ("call_module", "call_function", "call_method"):
            counts[n["target"]] = counts.get(n["target"], 0) + 1
    return {"node_count": len(nodes), "op_counts": counts, "nodes": nodes if len(nodes) <= 2000 else nodes[:2000]}


def _target_name(target: Any) -> str:
    if isinstance(target, str):
        return target
    name = getattr(target, "__name__", None) or str(target)
    module = getattr(target, "__module__", "") or ""
    if "aten" in str(target) or module.startswith("torch._ops"):
        return str(target)
    return f"{module}.{name}" if module and module != "builtins" else name


def _convert_onnx_input(run: _Run, loaded: LoadedModel, spec: JobSpec, out_dir: Path) -> None:
    """An ONNX upload: check it, copy it as the onnx artifact, and record it. No torch graph exists."""
    import onnx

    with run.stage("export", "checking the ONNX model"):
        assert loaded.onnx_path is not None
        try:
            onnx.checker.check_model(str(loaded.onnx_path), full_check=True)
        except Exception as exc:
            raise InvalidInput(f"the ONNX model fails onnx.checker: {exc}", stage="load") from exc
        dest = out_dir / "model.onnx"
        shutil.copyfile(loaded.onnx_path, dest)
        run.manifest["artifacts"].extend(_artifact_records("onnx", dest, out_dir))
        run.manifest["capture"] = {"method": "none", "level": "onnx", "attempts": []}
