"""FXPORT_OP_LIBRARIES: custom op libraries the sandbox loads before it opens a model.

A model calling an op no loaded library registers (a scripted torchvision detector calls
`torchvision::nms`) fails at load, and the hint names the setting; with its library listed, the
child loads it confined and the model converts. What was loaded goes in the manifest and in the
result cache's key. The library is a real one, built from C++ (tests/workers/op_library.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from fxport.cache import ResultCache
from fxport.config import Settings
from fxport.jobs import InputRef, JobRecord, JobState, SqliteJobStore, new_job_id
from fxport.spec import parse_spec
from fxport.storage import FileStore, input_key
from fxport.toolchain import CPU_PACKAGES, configured_op_libraries, job_fingerprint, local_toolchain
from fxport.workers.jobs import WorkerContext, execute_job
from fxport.workers.sandbox.run import readable_inputs
from tests.workers.op_library import CACHE, build, save_model

FXPORT = [sys.executable, "-m", "fxport.cli"]


# -- the setting, the read rules and the cache key (no library loaded) -------------------------


def test_the_setting_is_comma_separated_and_each_entry_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FXPORT_OP_LIBRARIES", " torchvision, /opt/ops/libmy.so,,torchvision ")
    assert Settings().op_libraries == ("torchvision", "/opt/ops/libmy.so")  # order kept, repeats dropped
    assert configured_op_libraries() == ("torchvision", "/opt/ops/libmy.so")  # what the sandbox and publisher read
    assert Settings(op_libraries="torchaudio").op_libraries == ("torchaudio",)
    monkeypatch.delenv("FXPORT_OP_LIBRARIES")
    assert Settings().op_libraries == () and configured_op_libraries() == ()
    with pytest.raises(ValidationError, match=r"FXPORT_OP_LIBRARIES entry 'libs/libmy\.so' is neither"):
        Settings(op_libraries="torchvision,libs/libmy.so")  # a relative path: which folder would it be in?


def test_the_child_may_read_a_shared_library_file_and_nothing_beside_it(tmp_path: Path) -> None:
    model, lib = tmp_path / "model.pt2", tmp_path / "ops" / "libmy.so"
    paths = readable_inputs(model, None, None, ["torchvision", str(lib)])
    assert paths == [model.resolve(), lib.resolve()]  # the file, not its folder; a module needs no rule
    assert readable_inputs(model, None, None) == [model.resolve()]


def test_op_libraries_are_part_of_the_toolchain_fingerprint(tmp_path: Path) -> None:
    lib = tmp_path / "libmy.so"
    lib.write_bytes(b"one build")
    plain = local_toolchain(op_libraries=())
    assert set(plain) == set(CPU_PACKAGES)  # none set: the fingerprint every existing cache entry has
    with_lib = local_toolchain(op_libraries=[str(lib), "torch"])
    assert with_lib["op_libraries"] == [
        {"library": str(lib), "sha256": hashlib.sha256(b"one build").hexdigest()},
        {"module": "torch", "version": plain["torch"]},
    ]
    cache = ResultCache(FileStore(tmp_path / "store"))
    spec = parse_spec({"targets": ["torchscript"]})

    def key(toolchain: dict) -> str | None:
        return cache.key_for("t", "a" * 64, None, spec, job_fingerprint(toolchain, None, engine=False))

    assert job_fingerprint(plain, None, engine=False) == plain
    assert key(with_lib) != key(plain)
    lib.write_bytes(b"another build of the same library")  # replaced in place: hashed again
    assert key(local_toolchain(op_libraries=[str(lib), "torch"])) not in (key(with_lib), key(plain))


# -- a real library, loaded in the sandbox ------------------------------------------------------


@pytest.fixture(scope="session")
def fxtest_library() -> Path:
    return build(CACHE)


@pytest.fixture(scope="session")
def scripted_model(fxtest_library: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_model(fxtest_library, tmp_path_factory.mktemp("op-library") / "twice.ts")


def convert(model: Path, out: Path, op_libraries: str | None, *flags: str) -> subprocess.CompletedProcess[str]:
    """`fxport convert` (sandboxed) as a user runs it, with FXPORT_OP_LIBRARIES as given (None: unset)."""
    env = {k: v for k, v in os.environ.items() if k != "FXPORT_OP_LIBRARIES"}
    if op_libraries is not None:
        env["FXPORT_OP_LIBRARIES"] = op_libraries
    return subprocess.run([*FXPORT, "convert", str(model), "--input", "x:2,3", "-t", "torchscript", "--out", str(out),
                           "--json", *flags], capture_output=True, text=True, timeout=300,
                          env={**env, "COLUMNS": "200"}, cwd=out.parent)


@pytest.fixture(scope="session")
def exported_program(fxtest_library: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_model(fxtest_library, tmp_path_factory.mktemp("op-library") / "twice.pt2")


@pytest.mark.slow
@pytest.mark.parametrize("model", ["scripted_model", "exported_program"])
@pytest.mark.parametrize("sandbox", [True, False], ids=["sandboxed", "no-sandbox"])
def test_convert_names_the_unknown_op_and_the_setting(model: str, sandbox: bool, tmp_path: Path,
                                                      request: pytest.FixtureRequest) -> None:
    """In the result document and the manifest, not only on the terminal; torch.export.load logs the
    real cause and raises a generic error, which must not hide it."""
    proc = convert(request.getfixturevalue(model), tmp_path / "out", None, *(() if sandbox else ("--no-sandbox",)))
    assert proc.returncode != 0
    error = json.loads(proc.stdout)["error"]
    assert "fxtest" in error["message"] and "twice" in error["message"] and error["stage"] == "load"
    assert "calls the custom op fxtest::twice, which no loaded op library registers (FXPORT_OP_LIBRARIES: none " \
           "set)" in error["message"]  # the record's message carries the hint
    assert "adds the library that defines it to FXPORT_OP_LIBRARIES" in error["message"]
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["error"]["message"] == error["message"]


@pytest.mark.slow
def test_a_program_with_the_op_converts_once_its_library_is_set(exported_program: Path, fxtest_library: Path,
                                                               tmp_path: Path) -> None:
    proc = convert(exported_program, tmp_path / "out", str(fxtest_library), "-t", "exported_program")
    assert proc.returncode == 0, proc.stderr[-3000:]
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert {v["format"]: v["verdict"] for v in manifest["verification"]} == {
        "torchscript": "passed", "exported_program": "passed"}


@pytest.mark.slow
def test_convert_loads_the_library_confined_and_records_it(scripted_model: Path, fxtest_library: Path,
                                                           tmp_path: Path) -> None:
    proc = convert(scripted_model, tmp_path / "out", str(fxtest_library))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["state"] == "SUCCEEDED"
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert [(a["format"], a["path"]) for a in manifest["artifacts"]] == [("torchscript", "model.ts")]
    assert [v["verdict"] for v in manifest["verification"]] == ["passed"]  # the op ran in the artifact too
    digest = hashlib.sha256(fxtest_library.read_bytes()).hexdigest()
    assert manifest["toolchain"]["op_libraries"] == [{"library": str(fxtest_library), "sha256": digest}]
    box = manifest["sandbox"]  # loaded after these were applied (child.py), and the job still ran
    assert box["filesystem_reads_confined"] and box["sockets_blocked"] and box["no_new_processes"]


@pytest.mark.slow
def test_convert_no_sandbox_loads_the_same_libraries(scripted_model: Path, fxtest_library: Path,
                                                     tmp_path: Path) -> None:
    proc = convert(scripted_model, tmp_path / "out", str(fxtest_library), "--no-sandbox")
    assert proc.returncode == 0, proc.stderr[-3000:]
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert [v["verdict"] for v in manifest["verification"]] == ["passed"]
    assert manifest["toolchain"]["op_libraries"][0]["library"] == str(fxtest_library)


@pytest.mark.slow
def test_a_library_that_cannot_be_loaded_fails_the_job_naming_it(scripted_model: Path, tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "libgone.so"
    proc = convert(scripted_model, tmp_path / "out", f"{missing}")
    assert proc.returncode == 1  # a failed conversion, not a crash
    error = json.loads(proc.stdout)["error"]
    assert error["stage"] == "load" and error["field"] == "FXPORT_OP_LIBRARIES"
    assert f"the op library '{missing}' (FXPORT_OP_LIBRARIES) could not be loaded" in error["message"]
    assert "or removes it from FXPORT_OP_LIBRARIES" in error["message"]
    proc = convert(scripted_model, tmp_path / "out2", "fxport_no_such_module")
    assert "the op library 'fxport_no_such_module' (FXPORT_OP_LIBRARIES) could not be loaded: " \
           "ModuleNotFoundError" in json.loads(proc.stdout)["error"]["message"]


@pytest.mark.slow
def test_a_worker_loads_its_libraries_and_keys_its_cache_entries_with_them(
        scripted_model: Path, fxtest_library: Path, tmp_path: Path) -> None:
    """execute_job with the real sandbox (the warm zygote): the worker's setting reaches the child,
    and the cache entry it writes carries the library, so a worker without it never finds it."""
    store = FileStore(tmp_path / "store")
    jobs = SqliteJobStore(tmp_path / "jobs.db")
    settings = Settings(home=tmp_path, work_dir=tmp_path / "work", op_libraries=str(fxtest_library))
    ctx = WorkerContext(jobs=jobs, artifacts=store, settings=settings, worker_id="test-worker")
    try:
        data = scripted_model.read_bytes()
        sha = hashlib.sha256(data).hexdigest()
        store.put_file(input_key("default", sha), scripted_model)
        spec = parse_spec({"inputs": [{"name": "x", "shape": [2, 3]}], "targets": ["torchscript"]})
        rec, _ = jobs.create(JobRecord(id=new_job_id(), tenant="default", spec=spec.normalized(),
                                       spec_digest=spec.digest(), model=InputRef(
                                           sha256=sha, bytes=len(data), filename="twice.ts",
                                           key=input_key("default", sha))))
        done = execute_job(rec.id, ctx)
        assert done is not None and done.state is JobState.SUCCEEDED, done and done.error
        cache = ResultCache.from_settings(store, settings)

        def entry(op_libraries: tuple[str, ...]):  # what a lookup with this worker's publication finds
            fingerprint = job_fingerprint(local_toolchain(op_libraries=op_libraries), None, engine=False)
            key = cache.key_for("default", sha, None, spec, fingerprint)
            assert key is not None
            return cache.read(key)

        found = entry(settings.op_libraries)
        assert found is not None and found.job_id == rec.id
        assert found.toolchain["op_libraries"][0]["library"] == str(fxtest_library)
        assert entry(()) is None  # a worker without the library: another key
    finally:
        jobs.close()


@pytest.mark.slow
def test_a_worker_without_the_library_names_the_op_and_the_setting(exported_program: Path, tmp_path: Path) -> None:
    """The same words as `fxport convert` gives (above), from a worker job in the warm sandbox: the
    hint comes from the engine, wherever it runs."""
    store = FileStore(tmp_path / "store")
    jobs = SqliteJobStore(tmp_path / "jobs.db")
    ctx = WorkerContext(jobs=jobs, artifacts=store, settings=Settings(home=tmp_path, work_dir=tmp_path / "work"),
                        worker_id="test-worker")
    try:
        data = exported_program.read_bytes()
        sha = hashlib.sha256(data).hexdigest()
        store.put_file(input_key("default", sha), exported_program)
        spec = parse_spec({"targets": ["exported_program"]})
        rec, _ = jobs.create(JobRecord(id=new_job_id(), tenant="default", spec=spec.normalized(),
                                       spec_digest=spec.digest(), model=InputRef(
                                           sha256=sha, bytes=len(data), filename="twice.pt2",
                                           key=input_key("default", sha))))
        done = execute_job(rec.id, ctx)
        assert done is not None and done.state is JobState.FAILED and done.error is not None
        assert done.error.stage == "load", done.error
        assert "calls the custom op fxtest::twice, which no loaded op library registers (FXPORT_OP_LIBRARIES: none " \
               "set)" in done.error.message, done.error
    finally:
        jobs.close()
