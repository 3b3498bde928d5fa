"""The job function (workers/jobs.py) against a real FileStore + SQLite job store.

The engine is replaced by small functions honouring its contract (files in out_dir,
progress callbacks, manifest returned / FxportError raised), so each test pins one piece of
bookkeeping; the real sandboxed engine runs in tests/service/test_distributed.py.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from pathlib import Path

import pytest

from fxport.config import Settings
from fxport.errors import VerificationFailed
from fxport.jobs import InputRef, JobRecord, JobState, SqliteJobStore, new_job_id
from fxport.manifest import Manifest
from fxport.spec import parse_spec
from fxport.storage import FileStore, input_key, job_prefix
from fxport.workers.engine.publish import WRITING_DIR
from fxport.workers.jobs import WorkerContext, execute_job, execute_stage

MODEL = b"pretend this is a .pt2"


@pytest.fixture()
def ctx(tmp_path):
    store = FileStore(tmp_path / "store")
    jobs = SqliteJobStore(tmp_path / "jobs.db")
    c = WorkerContext(jobs=jobs, artifacts=store, settings=Settings(home=tmp_path, work_dir=tmp_path / "work"),
                      worker_id="test-worker")
    yield c
    jobs.close()


def make_job(ctx: WorkerContext, spec: dict | None = None, **kw) -> JobRecord:
    sha = hashlib.sha256(MODEL).hexdigest()
    key = input_key("default", sha)
    src = ctx.settings.home / "model.pt2"
    src.write_bytes(MODEL)
    ctx.artifacts.put_file(key, src)
    parsed = parse_spec(spec or {"targets": ["onnx", "torchscript", "fx_source"]})
    rec, _ = ctx.jobs.create(JobRecord(id=new_job_id(), tenant="default", spec=parsed.normalized(),
                                       spec_digest=parsed.digest(),
                                       model=InputRef(sha256=sha, bytes=len(MODEL), filename="m.pt2", key=key), **kw))
    return rec


def write_outputs(out_dir: Path, names=("model.onnx", "model.ts", "fx_source/module.py")) -> Manifest:
    arts = []
    for name in names:
        p = out_dir / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(f"contents of {name}".encode())
        fmt = {"model.onnx": "onnx", "model.ts": "torchscript"}.get(name, "fx_source")
        arts.append({"format": fmt, "path": name, "bytes": p.stat().st_size,
                     "sha256": hashlib.sha256(p.read_bytes()).hexdigest()})
    manifest = {"artifacts": arts, "verification": [{"format": "onnx", "passed": True}]}
    (out_dir / "manifest.json").write_text(json.dumps(manifest))
    return Manifest.model_validate(manifest)


def ok_engine(calls: list):
    def engine(request, *, on_progress, **_):
        calls.append({"model": request.model_path.read_bytes(), "targets": list(request.spec.targets),
                      "job_id": request.job_id})
        for stage in ("load", "capture", "passes", "export", "verify"):
            on_progress({"stage": stage, "progress": 0.0, "message": ""})
            on_progress({"stage": stage, "progress": 1.0, "message": "done"})
        return write_outputs(request.out_dir)
    return engine


def test_success_uploads_every_file_under_deterministic_keys(ctx):
    rec = make_job(ctx)
    calls: list = []
    ctx.engine = ok_engine(calls)
    done = execute_job(rec.id, ctx)
    assert calls == [{"model": MODEL, "targets": ["onnx", "torchscript", "fx_source"], "job_id": rec.id}]
    assert done.state is JobState.SUCCEEDED and done.worker == "test-worker" and done.attempts == 1
    by_name = {a.name: a for a in done.artifacts}
    assert set(by_name) == {"model.onnx", "model.ts", "fx_source/module.py", "manifest.json"}
    assert by_name["model.onnx"].format == "onnx" and by_name["manifest.json"].format == "manifest"
    for name, art in by_name.items():
        assert art.key == f"default/jobs/{rec.id}/{name}"
        assert ctx.artifacts.head(art.key).sha256 == art.sha256
    stages = [e.stage for e in ctx.jobs.read_events(rec.id) if e.state is JobState.RUNNING]
    assert stages[0] == "load" and "verify" in stages and stages[-1] == "upload"
    assert not list((ctx.settings.work_dir).iterdir())  # the temp dir is gone


def test_verification_failure_records_stage_and_keeps_the_manifest(ctx):
    rec = make_job(ctx)

    def engine(request, **_):
        write_outputs(request.out_dir)
        raise VerificationFailed("onnx output differs: max |Δ| 0.3 > atol 1e-4", stage="verify")

    ctx.engine = engine
    done = execute_job(rec.id, ctx)
    assert done.state is JobState.FAILED
    assert (done.error.stage, done.error.code) == ("verify", "verification_failed")
    assert "max |Δ| 0.3" in done.error.message
    # The report of what differed is published; the artifacts that failed are not.
    assert [a.name for a in done.artifacts] == ["manifest.json"]
    assert ctx.artifacts.exists(done.artifacts[0].key)


def test_unexpected_exception_fails_the_job_naming_the_stage(ctx):
    rec = make_job(ctx)

    def engine(request, *, on_progress, **_):
        on_progress({"stage": "capture", "progress": 0.1, "message": ""})
        raise RuntimeError("boom")

    ctx.engine = engine
    done = execute_job(rec.id, ctx)
    assert done.state is JobState.FAILED and done.error.stage == "capture" and done.error.code == "internal"
    assert "RuntimeError: boom" in done.error.message and "Traceback" in done.error.detail


def test_replayed_task_on_a_finished_job_does_nothing(ctx):
    rec = make_job(ctx)
    calls: list = []
    ctx.engine = ok_engine(calls)
    first = execute_job(rec.id, ctx)
    again = execute_job(rec.id, ctx)  # at-least-once delivery: the same message again
    assert len(calls) == 1 and again == first


def test_redelivery_starts_from_a_clean_prefix(ctx):
    rec = make_job(ctx)
    # A first attempt died mid-upload: RUNNING, attempt 1, a stray file under the job's prefix.
    ctx.jobs.transition(rec.id, state=JobState.RUNNING, new_attempt=True, stage="upload")
    stray = ctx.settings.home / "stray"
    stray.write_bytes(b"half")
    ctx.artifacts.put_file(f"default/jobs/{rec.id}/model.engine", stray)
    ctx.engine = ok_engine([])
    done = execute_job(rec.id, ctx)
    assert done.state is JobState.SUCCEEDED and done.attempts == 2
    keys = {o.key for o in ctx.artifacts.list_prefix(job_prefix("default", rec.id))}
    assert f"default/jobs/{rec.id}/model.engine" not in keys and keys == {a.key for a in done.artifacts}


def test_a_job_that_keeps_killing_its_worker_fails(ctx):
    rec = make_job(ctx)
    for _ in range(3):
        ctx.jobs.transition(rec.id, state=JobState.RUNNING, new_attempt=True, stage="export")
    ctx.engine = ok_engine(calls := [])
    done = execute_job(rec.id, ctx)
    assert done.state is JobState.FAILED and done.error.code == "worker_lost" and not calls


def test_cancel_while_running_leaves_no_artifacts(ctx):
    rec = make_job(ctx)
    started = threading.Event()

    def engine(request, *, cancel_event, on_progress, **_):
        write_outputs(request.out_dir)
        on_progress({"stage": "export", "progress": 0.5, "message": ""})
        started.set()
        assert cancel_event.wait(10), "the cancel watch never fired"
        raise RuntimeError("sandbox killed")

    ctx.engine = engine
    result: list = []
    worker = threading.Thread(target=lambda: result.append(execute_job(rec.id, ctx)))
    worker.start()
    assert started.wait(10)
    ctx.jobs.transition(rec.id, state=JobState.CANCELLED)  # what CancelJob does
    worker.join(15)
    assert result and result[0].state is JobState.CANCELLED and result[0].error is None
    assert ctx.artifacts.list_prefix(job_prefix("default", rec.id)) == []


def _wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _staging_engine(ctx, job_id, seen: dict, rewrite_onnx: bool = False, fail: bool = False):
    """Writes model.ts during export and model.onnx when verify begins, as the engine does;
    then waits until the worker has offered both to clients before finishing."""

    def write_whole(out_dir: Path, name: str, data: bytes) -> None:  # as the engine's _export_one does
        (out_dir / WRITING_DIR).mkdir(exist_ok=True)
        (out_dir / WRITING_DIR / name).write_bytes(data)
        (out_dir / WRITING_DIR / name).replace(out_dir / name)

    def engine(request, *, on_progress, **_):
        out_dir = request.out_dir
        on_progress({"stage": "export", "progress": 0.0, "message": ""})
        write_whole(out_dir, "model.ts", b"torchscript bytes")
        on_progress({"stage": "export", "progress": 0.5, "message": "onnx"})
        write_whole(out_dir, "model.onnx", b"onnx bytes, first write")
        (out_dir / WRITING_DIR).rmdir()
        on_progress({"stage": "verify", "progress": 0.0, "message": ""})
        _wait_for(lambda: len(ctx.jobs.get(job_id).staged) == 2)
        seen["staged"] = {a.name: a for a in ctx.jobs.get(job_id).staged}
        if rewrite_onnx:  # the guess was early: the file changed after it went up
            (out_dir / "model.onnx").write_bytes(b"onnx bytes, final")
        if fail:
            raise VerificationFailed("onnx output differs", stage="verify")
        return _manifest_of(out_dir)

    return engine


def _manifest_of(out_dir: Path) -> Manifest:
    arts = [{"format": fmt, "path": name, "bytes": (out_dir / name).stat().st_size,
             "sha256": hashlib.sha256((out_dir / name).read_bytes()).hexdigest()}
            for name, fmt in (("model.onnx", "onnx"), ("model.ts", "torchscript"))]
    manifest = {"artifacts": arts, "verification": [{"format": "onnx", "passed": True}]}
    (out_dir / "manifest.json").write_text(json.dumps(manifest))
    return Manifest.model_validate(manifest)


def test_artifacts_stored_during_the_run_are_offered_to_clients_until_the_job_ends(ctx):
    rec = make_job(ctx, {"targets": ["onnx", "torchscript"]})
    seen: dict = {}
    ctx.engine = _staging_engine(ctx, rec.id, seen)
    done = execute_job(rec.id, ctx)
    assert done.state is JobState.SUCCEEDED
    final = {a.name: a for a in done.artifacts}
    # While it ran: each file, stored under its final key with the digest it has.
    for name, art in seen["staged"].items():
        assert art.key == f"default/jobs/{rec.id}/{name}" and art.format == final[name].format
        stored = hashlib.sha256(b"".join(ctx.artifacts.iter_chunks(art.key))).hexdigest()
        assert art.sha256 == final[name].sha256 == stored
    # Each one was announced by an event of its own, and the ended job offers only its results.
    staged_events = [e.staged.name for e in ctx.jobs.read_events(rec.id) if e.staged is not None]
    assert sorted(staged_events) == ["model.onnx", "model.ts"]
    assert done.staged == []


def test_early_upload_passes_over_hidden_folders_and_outlives_a_failed_scan(ctx, tmp_path, monkeypatch):
    from fxport.workers.artifact_upload import EarlyUpload

    out = tmp_path / "out"
    (out / WRITING_DIR).mkdir(parents=True)
    (out / WRITING_DIR / "model.onnx").write_bytes(b"half an onnx")  # the engine is still writing it
    announced: list[str] = []
    early = EarlyUpload(ctx.artifacts, "default", new_job_id(), out, tmp_path / "spool",
                        on_stored=lambda name, stored: announced.append(name))
    scans = {"n": 0}
    scan = early._scan

    def first_scan_fails():
        scans["n"] += 1
        if scans["n"] == 1:
            raise FileNotFoundError("a folder went away while it was listed")
        return scan()

    monkeypatch.setattr(early, "_scan", first_scan_fails)
    early.offer()
    _wait_for(lambda: scans["n"] == 1)
    (out / "model.ts").write_bytes(b"torchscript bytes")
    early.offer()  # the thread is still there to take it
    _wait_for(lambda: announced == ["model.ts"])
    assert set(early.wait()) == {"model.ts"}


def test_a_file_changed_after_it_was_staged_ends_with_its_final_digest(ctx):
    rec = make_job(ctx, {"targets": ["onnx", "torchscript"]})
    seen: dict = {}
    ctx.engine = _staging_engine(ctx, rec.id, seen, rewrite_onnx=True)
    done = execute_job(rec.id, ctx)
    assert done.state is JobState.SUCCEEDED
    final = {a.name: a for a in done.artifacts}
    expected = hashlib.sha256(b"onnx bytes, final").hexdigest()
    assert seen["staged"]["model.onnx"].sha256 != expected  # a client's early copy no longer matches ...
    assert final["model.onnx"].sha256 == expected  # ... the result, which is what the store holds now
    assert ctx.artifacts.head(final["model.onnx"].key).sha256 == expected


def test_a_failed_job_withdraws_what_it_staged(ctx):
    rec = make_job(ctx, {"targets": ["onnx", "torchscript"]})
    seen: dict = {}
    ctx.engine = _staging_engine(ctx, rec.id, seen, fail=True)
    done = execute_job(rec.id, ctx)
    assert done.state is JobState.FAILED and done.staged == []
    assert all(not ctx.artifacts.exists(a.key) for a in seen["staged"].values())


def test_tensorrt_target_hands_the_job_to_the_gpu_stage(ctx):
    rec = make_job(ctx, {"targets": ["torchscript", "tensorrt"]})
    handed: list = []
    ctx.enqueue_stage = lambda stage, job_id: handed.append((stage, job_id))
    calls: list = []
    ctx.engine = ok_engine(calls)
    after = execute_job(rec.id, ctx)
    # The CPU part made the ONNX the engine build needs, and stopped short of SUCCEEDED.
    assert calls[0]["targets"] == ["torchscript", "onnx"]
    assert handed == [("tensorrt", rec.id)]
    # Back in the queue until a GPU worker takes the tensorrt stage, and the record says so.
    assert after.state is JobState.QUEUED and after.stage == "tensorrt"
    assert after.message.startswith("waiting for a GPU worker (queue gpu")

    def trt_engine(request, **_):
        out_dir = request.out_dir
        assert request.model_path.read_bytes() == b"contents of model.onnx" and request.spec.targets == ["tensorrt"]
        p = out_dir / "model.engine"
        p.write_bytes(b"engine")
        art = {"format": "tensorrt", "path": "model.engine", "bytes": 6,
               "sha256": hashlib.sha256(b"engine").hexdigest()}
        manifest = {"artifacts": [art], "verification": [{"format": "tensorrt", "passed": True}],
                    "toolchain": {"tensorrt": "10.0"}, "timings_s": {"build": 1.0}}
        (out_dir / "manifest.json").write_text(json.dumps(manifest))
        return Manifest.model_validate(manifest)

    ctx.engine = trt_engine
    done = execute_stage("tensorrt", rec.id, ctx)
    assert done.state is JobState.SUCCEEDED
    names = {a.name for a in done.artifacts}
    assert {"model.engine", "model.onnx", "model.ts", "manifest.json"} <= names
    merged_path = ctx.settings.home / "merged.json"
    ctx.artifacts.get(f"default/jobs/{rec.id}/manifest.json", merged_path)
    merged = json.loads(merged_path.read_text())
    assert {a["format"] for a in merged["artifacts"]} >= {"onnx", "tensorrt"}
    assert merged["toolchain"]["tensorrt"] == "10.0"


def test_the_tensorrt_stage_benchmark_joins_the_cpu_stages_and_the_pick_is_made_again():

    def row(artifact: str, batch: int, p50: float) -> dict:
        return {"artifact": artifact, "batch": batch, "p50_ms": p50, "throughput_per_s": batch * 1000 / p50,
                "verified": True}

    cpu_rows = [row("eager", 1, 10.0), row("onnx", 1, 4.0)]
    cpu = {"benchmark": {"results": cpu_rows, "skipped": [], "machine": {"cpu": "Xeon", "gpu": None},
                         "recommendation": {"artifact": "onnx"}, "seconds": 2.0}}
    trt = {"benchmark": {"results": [row("tensorrt", 1, 0.5)], "skipped": [],
                         "machine": {"cpu": "EPYC", "gpu": "NVIDIA H200"}, "seconds": 1.0}}
    merged = Manifest.model_validate(cpu).merge_stage(Manifest.model_validate(trt), name="tensorrt").benchmark
    assert merged is not None
    assert [r["artifact"] for r in merged["results"]] == ["eager", "onnx", "tensorrt"]
    assert merged["recommendation"]["artifact"] == "tensorrt" and merged["machine"]["gpu"] == "NVIDIA H200"
    neither = Manifest().merge_stage(Manifest(), name="tensorrt")  # neither stage benchmarked
    assert "benchmark" not in neither.to_dict()
