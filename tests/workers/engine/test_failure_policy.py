"""One failure policy for every capture path (README, "What a conversion does"): every requested
target is verified or listed in failed_targets with why; a job with a failed target fails unless its
spec sets allow_partial, and a failed job keeps no model file. Here through the engine itself, and
through the job function with the real engine (the worker's path: upload, record, result cache);
tests/client/test_failure_policy_cli.py runs the same through `fxport convert` and a server."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from fxport.cache import ResultCache
from fxport.config import Settings
from fxport.errors import CaptureFailed
from fxport.jobs import InputRef, JobRecord, JobState, SqliteJobStore, new_job_id
from fxport.spec import parse_spec
from fxport.storage import FileStore, input_key, job_prefix
from fxport.workers.engine.pipeline import convert, convert_request
from fxport.workers.engine.publish import output_names, withdraw
from fxport.workers.jobs import WorkerContext, execute_job
from tests.client.packaged import UNTRACEABLE, package_model

# torchscript is scripted from the eager model and verifies; exported_program and fx_source need a graph
TARGETS = ["torchscript", "exported_program", "fx_source"]


@pytest.fixture(scope="module")
def untraceable(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A torch.package whose forward branches in Python on a tensor's value: no capture rung follows it."""
    return package_model(UNTRACEABLE, "policy_untraceable", tmp_path_factory.mktemp("untraceable"))


def _spec(**extra) -> dict:
    return {"inputs": [{"name": "x", "shape": [2, 4]}], "targets": TARGETS, "verify": {"samples": 2}, **extra}


def _out_with_leftovers(tmp_path: Path) -> Path:
    """An output folder an earlier run used: its model.pt2, and a file of the user's own."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.pt2").write_bytes(b"an earlier run's program")
    (out / "notes.txt").write_text("the user's own file")
    return out


def test_a_failed_target_fails_the_job_and_it_keeps_no_model_file(untraceable: Path, tmp_path: Path) -> None:
    out = _out_with_leftovers(tmp_path)
    with pytest.raises(CaptureFailed) as info:
        convert(untraceable, parse_spec(_spec()), out)
    text = str(info.value)
    assert (info.value.stage, info.value.field) == ("capture", "targets")
    assert "2 of 3 target(s) could not be built: exported_program, fx_source: needs a graph" in text, text
    assert "if y.sum() > 0" in text  # the capture reason, with the user's line
    assert "(torchscript) were built and verified, and are not kept" in text and "--allow-partial" in text

    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "failed" and manifest["error"]["code"] == "capture_failed"
    assert [f["target"] for f in manifest["failed_targets"]] == ["exported_program", "fx_source"]
    assert [a["path"] for a in manifest["artifacts"]] == ["model.ts"]  # what was built...
    assert [v["verdict"] for v in manifest["verification"]] == ["passed"]  # ...and verified...
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "notes.txt", "report.html"]  # ...not kept
    assert (out / "notes.txt").read_text() == "the user's own file"
    assert any("keeps no model file: model.pt2, model.ts removed" in w for w in manifest["warnings"])


def test_allow_partial_keeps_the_verified_artifacts_and_no_file_of_a_failed_target(untraceable: Path,
                                                                                  tmp_path: Path) -> None:
    out = _out_with_leftovers(tmp_path)
    manifest = convert(untraceable, parse_spec(_spec(allow_partial=True)), out)
    assert manifest["status"] == "succeeded" and manifest["spec"]["allow_partial"] is True
    assert [f["target"] for f in manifest["failed_targets"]] == ["exported_program", "fx_source"]
    assert [a["path"] for a in manifest["artifacts"]] == ["model.ts"]
    # the earlier run's model.pt2 is not this job's exported_program: it is gone
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "model.ts", "notes.txt", "report.html"]


def test_allow_partial_describes_the_job_not_its_artifacts() -> None:
    base = parse_spec(_spec())
    assert parse_spec(_spec(allow_partial=False)).digest() == base.digest()  # false is the default: absent
    assert "allow_partial" not in base.normalized()
    partial = parse_spec(_spec(allow_partial=True))
    assert partial.digest() != base.digest()  # another job (an idempotent resubmit tells them apart)...
    assert partial.artifact_digest() == base.artifact_digest()  # ...making the same artifacts


def test_withdraw_removes_links_and_folders_without_following_them(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    (outside / "dir").mkdir(parents=True)
    (outside / "precious.onnx").write_text("not the job's")
    (outside / "dir" / "module.py").write_text("not the job's either")
    out = tmp_path / "out"
    (out / "triton" / "model" / "1").mkdir(parents=True)
    (out / "triton" / "model" / "1" / "model.onnx").write_text("a package file")
    os.symlink(outside / "precious.onnx", out / "model.onnx")
    os.symlink(outside / "dir", out / "fx_source")
    (out / "manifest.json").write_text("{}")
    removed = withdraw(out, output_names())
    assert sorted(removed) == ["fx_source", "model.onnx", "triton"]
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json"]
    assert (outside / "precious.onnx").read_text() == "not the job's"
    assert (outside / "dir" / "module.py").read_text() == "not the job's either"
    assert withdraw(out, ["../outside", "manifest.json/x", ""]) == []  # names only, beneath out


def test_output_names_cover_each_target_and_an_onnx_models_weights() -> None:
    assert output_names(["onnx", "fx_source"]) == ["model.onnx", "model.onnx.data", "fx_source"]
    every = output_names()
    assert {"model.ts", "model.pt2", "model.engine", "model.tensorrt.onnx.data", "samples.npz", "triton"} <= set(every)
    assert "manifest.json" not in every and "report.html" not in every


# -- the worker's path: the job function with the real engine ---------------------------------------


def _in_process_engine(request, *, on_progress, **_):
    """The real engine, in this process (the sandbox's own tests run it confined)."""
    return convert_request(request, on_progress=on_progress)


@pytest.fixture()
def ctx(tmp_path: Path):
    jobs = SqliteJobStore(tmp_path / "jobs.db")
    c = WorkerContext(jobs=jobs, artifacts=FileStore(tmp_path / "store"), engine=_in_process_engine,
                      settings=Settings(home=tmp_path, work_dir=tmp_path / "work", cache_enabled=True),
                      worker_id="policy-test")
    yield c
    jobs.close()


def _job(ctx: WorkerContext, model: Path, spec: dict) -> JobRecord:
    data = model.read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    key = input_key("default", sha)
    ctx.artifacts.put_file(key, model)
    parsed = parse_spec(spec)
    rec, _ = ctx.jobs.create(JobRecord(id=new_job_id(), tenant="default", spec=parsed.normalized(),
                                       spec_digest=parsed.digest(),
                                       model=InputRef(sha256=sha, bytes=len(data), filename="m.pkg", key=key)))
    return rec


def _stored(ctx: WorkerContext, rec: JobRecord) -> list[str]:
    prefix = job_prefix(rec.tenant, rec.id)
    return sorted(o.key[len(prefix):].lstrip("/") for o in ctx.artifacts.list_prefix(prefix))


def test_a_job_with_a_failed_target_fails_and_stores_no_model_file(ctx: WorkerContext, untraceable: Path) -> None:
    rec = _job(ctx, untraceable, _spec())
    done = execute_job(rec.id, ctx)
    assert done is not None and done.state is JobState.FAILED
    assert done.error is not None and (done.error.stage, done.error.code) == ("capture", "capture_failed")
    assert "exported_program, fx_source: needs a graph" in done.error.message
    assert "--allow-partial" in done.error.message
    assert sorted(a.name for a in done.artifacts) == ["manifest.json", "report.html"]
    assert _stored(ctx, rec) == ["manifest.json", "report.html"]  # an early upload of model.ts is deleted
    assert done.staged == []


def test_allow_partial_succeeds_with_the_verified_artifacts_and_is_not_cached(ctx: WorkerContext,
                                                                              untraceable: Path) -> None:
    rec = _job(ctx, untraceable, _spec(allow_partial=True))
    done = execute_job(rec.id, ctx)
    assert done is not None and done.state is JobState.SUCCEEDED, done.error
    assert sorted(a.name for a in done.artifacts) == ["manifest.json", "model.ts", "report.html"]
    assert done.message == "done, without exported_program, fx_source (allow_partial; see failed_targets)"
    # the cache key leaves allow_partial out: a job without it must not be answered with this result
    assert ResultCache(ctx.artifacts).entries() == []
    whole = execute_job(_job(ctx, untraceable, _spec(targets=["torchscript"])).id, ctx)
    assert whole is not None and whole.state is JobState.SUCCEEDED
    assert len(ResultCache(ctx.artifacts).entries()) == 1  # while a job that built every target is cached


def test_a_failed_later_stage_drops_what_the_earlier_stage_stored(ctx: WorkerContext, tmp_path: Path) -> None:
    """A tensorrt job: the CPU stage stores model.onnx and hands on; the engine build fails. The job
    FAILED keeps manifest.json and report.html, and model.onnx leaves the store too."""
    from fxport.errors import ConversionFailed
    from fxport.manifest import Manifest
    from fxport.workers.jobs import execute_stage

    def cpu_stage(request, **_):  # what the CPU stage leaves: the ONNX model the engine is built from
        (request.out_dir / "model.onnx").write_bytes(b"onnx bytes")
        art = {"format": "onnx", "path": "model.onnx", "bytes": 10,
               "sha256": hashlib.sha256(b"onnx bytes").hexdigest()}
        manifest = Manifest.model_validate({"artifacts": [art], "verification": [{"format": "onnx", "passed": True}],
                                            "inputs": {"inputs": [{"name": "x", "shape": [2, 4]}], "dynamic_dims": {}}})
        manifest.write(request.out_dir / "manifest.json")
        return manifest

    def failing_build(request, **_):  # the engine leaves its manifest.json, failed, as it always does
        Manifest.model_validate({"status": "failed"}).write(request.out_dir / "manifest.json")
        raise ConversionFailed("the builder ran out of workspace", stage="tensorrt")

    handed: list[str] = []
    ctx.engine, ctx.enqueue_stage = cpu_stage, lambda stage, job_id: handed.append(stage)
    model = tmp_path / "m.pt2"
    model.write_bytes(b"a .pt2")
    rec = _job(ctx, model, {"inputs": [{"name": "x", "shape": [2, 4]}], "targets": ["tensorrt"]})
    after_cpu = execute_job(rec.id, ctx)
    assert after_cpu is not None and after_cpu.state is JobState.QUEUED and handed == ["tensorrt"]
    assert "model.onnx" in _stored(ctx, rec)

    ctx.engine = failing_build
    done = execute_stage("tensorrt", rec.id, ctx)
    assert done is not None and done.state is JobState.FAILED and done.error is not None
    assert done.error.stage == "tensorrt"
    assert sorted(a.name for a in done.artifacts) == ["manifest.json", "report.html"]
    assert _stored(ctx, rec) == ["manifest.json", "report.html"]  # the CPU stage's model.onnx is gone
