"""The tensorrt stage's bookkeeping in the job function (workers/jobs.py), with a real FileStore and
SQLite job store and stand-in engines honouring the engine contract (no GPU here): the CPU stage
asks for the preflight, the GPU stage gets the CPU stage's signature and the shared timing cache,
publishes the cache, and merges manifests — also when it fails."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from fxport.config import Settings
from fxport.errors import ConversionFailed
from fxport.jobs import InputRef, JobRecord, JobState, SqliteJobStore, new_job_id
from fxport.manifest import Manifest
from fxport.spec import parse_spec
from fxport.storage import FileStore, input_key
from fxport.workers.engine.tensorrt import timing_cache as tc
from fxport.workers.jobs import WorkerContext, execute_job, execute_stage

SIG = {"inputs": [{"name": "x", "shape": ["batch", 8], "dtype": "float32"}],
       "dynamic_dims": {"batch": {"min": 1, "opt": 2, "max": 4}}}
IDENTITY = tc.DeviceIdentity("NVIDIA H200", "9.0", "10.15.1.29")


@pytest.fixture()
def ctx(tmp_path, monkeypatch):
    monkeypatch.setattr(tc, "probe_device_identity", lambda: IDENTITY)
    jobs = SqliteJobStore(tmp_path / "jobs.db")
    handed: list = []
    c = WorkerContext(jobs=jobs, artifacts=FileStore(tmp_path / "store"), worker_id="w",
                      settings=Settings(home=tmp_path, work_dir=tmp_path / "work"),
                      enqueue_stage=lambda stage, job_id: handed.append((stage, job_id)),
                      gpu_workers=lambda: False)
    c.handed = handed  # type: ignore[attr-defined]
    yield c
    jobs.close()


def _write(out_dir: Path, name: str, data: bytes, fmt: str) -> dict:
    (out_dir / name).write_bytes(data)
    return {"format": fmt, "path": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def cpu_engine(calls: list):
    def engine(request, **_):
        out_dir = request.out_dir
        calls.append({"targets": list(request.spec.targets), "deferred": request.deferred_targets})
        manifest = {"artifacts": [_write(out_dir, "model.onnx", b"onnx bytes", "onnx")],
                    "verification": [{"format": "onnx", "passed": True}], "inputs": SIG, "warnings": [],
                    "tensorrt": {"preflight": {"ok": True, "errors": []}}, "toolchain": {"torch": "2.13.0"}}
        (out_dir / "manifest.json").write_text(json.dumps(manifest))
        return Manifest.model_validate(manifest)
    return engine


def submit(ctx, spec: dict) -> JobRecord:
    data = b"a .pt2"
    sha = hashlib.sha256(data).hexdigest()
    src = ctx.settings.home / "m.pt2"
    src.write_bytes(data)
    ctx.artifacts.put_file(input_key("default", sha), src)
    parsed = parse_spec(spec)
    rec, _ = ctx.jobs.create(JobRecord(id=new_job_id(), tenant="default", spec=parsed.normalized(),
                                       spec_digest=parsed.digest(),
                                       model=InputRef(sha256=sha, bytes=len(data), filename="m.pt2",
                                                      key=input_key("default", sha))))
    return rec


def stored_json(ctx, key: str, tmp: Path) -> dict:
    ctx.artifacts.get(key, tmp)
    return json.loads(tmp.read_text())


def test_cpu_stage_defers_tensorrt_and_waits_queued(ctx):
    calls: list = []
    ctx.engine = cpu_engine(calls)
    rec = submit(ctx, {"targets": ["tensorrt"]})
    after = execute_job(rec.id, ctx)
    assert calls == [{"targets": ["onnx"], "deferred": ("tensorrt",)}]
    assert after.state is JobState.QUEUED and after.stage == "tensorrt"
    assert after.message == "waiting for a GPU worker (queue gpu has no consumers)"
    assert ctx.handed == [("tensorrt", rec.id)]
    # a redelivered CPU task after the hand-off only hands on again
    again = execute_job(rec.id, ctx)
    assert again.state is JobState.QUEUED and len(calls) == 1 and ctx.handed == [("tensorrt", rec.id)] * 2


def test_gpu_stage_gets_the_signature_and_the_shared_cache_and_publishes_it(ctx, tmp_path):
    ctx.engine = cpu_engine([])
    rec = submit(ctx, {"targets": ["tensorrt"], "precision": "fp32"})
    execute_job(rec.id, ctx)
    seen: dict = {}

    def gpu_engine(request, **_):
        spec, out_dir, timing_cache_path = request.spec, request.out_dir, request.timing_cache.read
        seen.update(targets=spec.targets, inputs=[i.model_dump() for i in spec.inputs],
                    dims={k: v.model_dump() for k, v in spec.dynamic_dims.items()},
                    cache_in=timing_cache_path.read_bytes() if timing_cache_path.exists() else None)
        timing_cache_path.write_bytes((seen["cache_in"] or b"") + b"+timings")  # what the sandbox hands back
        art = _write(out_dir, "model.engine", b"engine", "tensorrt")
        manifest = {"artifacts": [art], "verification": [{"format": "tensorrt", "passed": True}],
                    "tensorrt": {"engine": {"precision": "fp32", "gpu_name": "NVIDIA H200"},
                                 "build": {"timing_cache": {"status": "cold"}}},
                    "toolchain": {"tensorrt": "10.15.1.29"}, "timings_s": {"tensorrt": 2.0}, "warnings": []}
        (out_dir / "manifest.json").write_text(json.dumps(manifest))
        (out_dir / "report.html").write_text("stage-only report")
        return Manifest.model_validate(manifest)

    ctx.engine = gpu_engine
    done = execute_stage("tensorrt", rec.id, ctx)
    assert done.state is JobState.SUCCEEDED, done.error
    assert seen["targets"] == ["tensorrt"] and seen["inputs"] == SIG["inputs"] and seen["dims"] == SIG["dynamic_dims"]
    assert seen["cache_in"] is None  # first build on this GPU model: cold
    key = tc.cache_key(IDENTITY, "default")  # the job's tenant's cache
    assert ctx.artifacts.exists(key)
    merged = stored_json(ctx, f"default/jobs/{rec.id}/manifest.json", tmp_path / "m.json")
    assert {a["format"] for a in merged["artifacts"]} == {"onnx", "tensorrt"}
    assert merged["tensorrt"]["preflight"]["ok"] and merged["tensorrt"]["engine"]["gpu_name"] == "NVIDIA H200"
    shared = merged["tensorrt"]["shared_timing_cache"]
    assert shared["published"] and shared["key"] == key
    assert merged["toolchain"] == {"torch": "2.13.0", "tensorrt": "10.15.1.29"}
    ctx.artifacts.get(f"default/jobs/{rec.id}/report.html", tmp_path / "r.html")
    assert (tmp_path / "r.html").read_text() != "stage-only report"  # rewritten from the merged manifest

    # the next job on this GPU model starts from that cache
    ctx.engine = cpu_engine([])
    second = submit(ctx, {"targets": ["tensorrt"], "labels": {"n": "2"}})
    execute_job(second.id, ctx)
    ctx.engine = gpu_engine
    assert execute_stage("tensorrt", second.id, ctx).state is JobState.SUCCEEDED
    assert seen["cache_in"] == b"+timings"


def test_a_failed_gpu_stage_keeps_the_cpu_manifest_and_adds_its_error(ctx, tmp_path):
    ctx.engine = cpu_engine([])
    rec = submit(ctx, {"targets": ["tensorrt"]})
    execute_job(rec.id, ctx)

    def failing(request, **_):
        out_dir = request.out_dir
        err = ConversionFailed("TensorRT's ONNX parser rejected the model: node 'n7' (op Foo): unsupported",
                               stage="tensorrt")
        (out_dir / "manifest.json").write_text(json.dumps({"status": "failed", "error": err.to_dict(),
                                                           "artifacts": [], "verification": [], "warnings": []}))
        raise err

    ctx.engine = failing
    done = execute_stage("tensorrt", rec.id, ctx)
    assert done.state is JobState.FAILED and done.error.stage == "tensorrt" and "node 'n7'" in done.error.message
    merged = stored_json(ctx, f"default/jobs/{rec.id}/manifest.json", tmp_path / "m.json")
    assert merged["status"] == "failed" and "n7" in merged["error"]["message"]
    assert merged["tensorrt"]["preflight"]["ok"] and merged["inputs"] == SIG  # the CPU stage's record survives


def test_gpu_stage_builds_from_the_tensorrt_onnx_when_int8_made_one_for_each_runtime(ctx, tmp_path):
    """int8 with a CPU target and tensorrt: model.onnx is onnxruntime's (uint8 activations), and the engine
    must come from model.tensorrt.onnx (symmetric int8), the one TensorRT takes."""
    def cpu_int8_engine(request, **_):
        out_dir = request.out_dir
        arts = [_write(out_dir, "model.onnx", b"uint8 activations", "onnx"),
                _write(out_dir, "model.tensorrt.onnx", b"symmetric int8", "onnx_tensorrt")]
        manifest = {"artifacts": arts, "verification": [{"format": "onnx", "passed": True}], "inputs": SIG,
                    "warnings": [], "tensorrt": {"preflight": {"ok": True, "errors": []}}}
        (out_dir / "manifest.json").write_text(json.dumps(manifest))
        return Manifest.model_validate(manifest)

    seen: dict = {}

    def gpu_engine(request, **_):
        out_dir = request.out_dir
        seen["bytes"] = request.model_path.read_bytes()
        art = _write(out_dir, "model.engine", b"engine", "tensorrt")
        manifest = {"artifacts": [art], "verification": [{"format": "tensorrt", "passed": True}], "warnings": []}
        (out_dir / "manifest.json").write_text(json.dumps(manifest))
        return Manifest.model_validate(manifest)

    ctx.engine = cpu_int8_engine
    rec = submit(ctx, {"targets": ["onnx", "tensorrt"], "precision": "int8"})
    assert execute_job(rec.id, ctx).stage == "tensorrt"
    ctx.engine = gpu_engine
    done = execute_stage("tensorrt", rec.id, ctx)
    assert done.state is JobState.SUCCEEDED, done.error
    assert seen["bytes"] == b"symmetric int8"
    assert {a.name for a in done.artifacts} >= {"model.onnx", "model.tensorrt.onnx", "model.engine"}


@pytest.mark.parametrize(("targets", "runtime"), [(["tensorrt"], "tensorrt"), (["onnx", "tensorrt"], None)])
def test_the_cpu_stage_keeps_the_int8_schemes_the_job_asked_for(ctx, targets, runtime):
    """The CPU stage runs with tensorrt deferred and onnx as a target either way; tensorrt alone must still
    get TensorRT's scheme only, and onnx with tensorrt both (the engine's ONNX from the deferred target)."""
    seen: list = []

    def engine(request, **_):
        seen.append(request.spec.int8_runtimes(also_targets=request.deferred_targets))
        raise ConversionFailed("stop here", stage="load")

    ctx.engine = engine
    execute_job(submit(ctx, {"targets": targets, "precision": "int8"}).id, ctx)
    assert seen == [["tensorrt"] if runtime else ["onnxruntime", "tensorrt"]]
