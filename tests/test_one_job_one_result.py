"""One job, one result, wherever it runs (issue 39): a job's outcome never depends on what ran
before it, or on which path ran it.

One set of job specs covering every engine feature (fp32 to every target, packaged for Triton; int8
with calibration; fp16; `capture: fx`; the eager fallback of a model no rung captures; `benchmark`;
a dynamic transformer `.pt2`; an ONNX input model; a data-dependent loop to ONNX; a job that accepts
a failed target with `allow_partial`) runs along four paths:

- `convert`: `fxport convert`, each job in a cold sandbox (a fresh interpreter);
- `no_sandbox`: `fxport convert --no-sandbox`, each job in the CLI's own process;
- `worker`: a real Celery worker with its warm sandbox (zygote, spare child), every spec once in
  order and once in reverse, so that each comes after every other kind of job on the same warm
  worker, and right after a different one each time;
- `one_process`: every spec in one process outside the sandbox, in order and then in reverse
  (tests/fixtures/engine_sequence.py): per-process caches of the engine kept from job to job.

Every run of a spec must give the same status, the same verdict per artifact check, the same
artifact list, and the same bytes for every artifact but two kinds of archive, compared by content
instead (`archive_content`):
- a `.pt2` program: every entry the same bytes but two fields. Its `.data/serialization_id` ends
  in 20 random digits drawn at every save (the first 20 are a checksum of the content), and its
  graph records, per node, the `graph_id` it came from: the memory address of a Python object.
- a TorchScript archive: the same weights (every tensor's bytes) and the same verdicts. Its code
  is not the same bytes from one process to the next: TorchScript names a class it compiles again
  `___torch_mangle_N` by a per-process counter, writes a class's constants in the order of a set
  (which follows the process's hash seed), and its `*.debug_pkl` entries hold source ranges.
  A Triton repository's copy of it (`model.pt`) is compared the same way, and its model card
  (`README.md`), which names each artifact's sha256, with those of the archives left out.
The report is drawn from the manifest and is not an artifact.

The matrix is what would have caught the fp32-then-int8 failure of a warm worker: the ONNX
exporter's op registry, cached per process, was built before the int8 stage's Q/DQ op library was
loaded, so every later int8 ONNX export failed (`No ONNX function found for
quantized_decomposed.quantize_per_tensor`) while `fxport convert` succeeded.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.fixtures.servers import distributed_env, scaled, start_api, start_worker

pytestmark = pytest.mark.slow

FXPORT = [sys.executable, "-m", "fxport.cli"]
BATCH = {"batch": {"min": 1, "opt": 2, "max": 4}}
IMAGE = [{"name": "x", "shape": ["batch", 3, 32, 32], "dtype": "float32"}]
REDIS_DB = 7  # the worker path's broker and job store (tests/security/test_isolation.py uses 1-4)
# compared by content (see the module docstring): model.pt is the TorchScript model in a Triton repository
ARCHIVES = {"model.ts", "model.pt2", "model.pt"}
_GRAPH_ID = re.compile(rb'(graph_id[\\"]*: )[0-9]+')


@dataclass(frozen=True)
class Case:
    name: str
    model: str  # a key of the `models` fixture
    spec: dict[str, Any]
    calibration: bool = False


CASES = [
    Case("fp32_all_targets", "cnn", {"inputs": IMAGE, "dynamic_dims": BATCH, "verify": {"samples": 2},
                                     "targets": ["torchscript", "onnx", "exported_program", "fx_source"],
                                     "package": ["triton"]}),
    Case("int8_calibrated", "cnn", {"inputs": IMAGE, "dynamic_dims": BATCH, "verify": {"samples": 2},
                                    "precision": "int8", "targets": ["onnx", "torchscript"]}, calibration=True),
    Case("fp16", "cnn", {"inputs": IMAGE, "dynamic_dims": BATCH, "verify": {"samples": 2},
                         "precision": "fp16", "targets": ["onnx", "torchscript"]}),
    Case("capture_fx", "cnn", {"inputs": IMAGE, "dynamic_dims": BATCH, "verify": {"samples": 2},
                               "capture": "fx", "targets": ["fx_source", "torchscript", "onnx"]}),
    Case("eager_fallback", "detector", {"inputs": [{"name": "images", "shape": [1, 3, 32, 32]}],
                                        "verify": {"samples": 3}, "targets": ["torchscript", "onnx"]}),
    Case("benchmark", "tiny", {"inputs": [{"name": "x", "shape": ["batch", 8]}], "dynamic_dims": BATCH,
                               "verify": {"samples": 2}, "targets": ["onnx", "torchscript"],
                               "benchmark": {"batches": [1, 2], "warmup": 1, "runs": 3, "max_seconds": 30}}),
    Case("dynamic_transformer", "transformer", {"inputs": [{"name": "x", "shape": ["batch", 16, 64]}],
                                                "dynamic_dims": BATCH, "verify": {"samples": 2},
                                                "targets": ["onnx", "exported_program", "torchscript"]}),
    Case("onnx_input", "onnx", {"targets": ["onnx"], "verify": {"samples": 2}}),
    # ONNX of a data-dependent loop, exported from the scripted model (an ONNX Loop)
    Case("loop_to_onnx", "nms", {"inputs": [{"name": "boxes", "shape": ["n", 4]}, {"name": "scores", "shape": ["n"]}],
                                 "dynamic_dims": {"n": {"min": 8, "opt": 16, "max": 32}},
                                 "targets": ["torchscript", "onnx"], "verify": {"samples": 2}}),
    # the failure policy's accepted form: exported_program needs a graph no rung captures
    Case("allow_partial", "untraceable", {"inputs": [{"name": "x", "shape": [2, 4]}], "allow_partial": True,
                                          "targets": ["torchscript", "exported_program"], "verify": {"samples": 2}}),
]
BY_NAME = {c.name: c for c in CASES}


# ---------------------------------------------------------------------------------------
# What a run leaves: the part of its manifest every path must agree on
# ---------------------------------------------------------------------------------------


def archive_content(path: Path) -> str:
    """A digest of a `.pt2` or TorchScript archive's content (the module docstring says which)."""
    digest = hashlib.sha256()
    with zipfile.ZipFile(path) as archive:
        if path.suffix in (".ts", ".pt"):  # the weights, whichever entries TorchScript filed them under
            for data in sorted(hashlib.sha256(archive.read(n)).digest() for n in archive.namelist()
                               if n.split("/")[-2:-1] == ["data"]):
                digest.update(data)
            return "weights:" + digest.hexdigest()
        for name in sorted(archive.namelist()):
            data = archive.read(name)
            if name.endswith(".data/serialization_id"):
                data = data[:20]  # the content's checksum; the rest is drawn at random per save
            elif name.endswith(".json"):
                data = _GRAPH_ID.sub(rb"\g<1>0", data)
            digest.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
    return "content:" + digest.hexdigest()


@dataclass(frozen=True)
class Outcome:
    status: str
    error: tuple[str | None, str | None] | None
    artifacts: dict[str, str]  # path -> sha256, or archive_content for ARCHIVES
    verdicts: tuple[tuple[str, str | None, str | None], ...]  # (format, runtime, verdict), in order
    failed_targets: tuple[str, ...]
    capture: str | None

    @classmethod
    def of(cls, out: Path) -> Outcome:
        """What the run that left `out` (its manifest.json and artifacts) gave."""
        manifest = json.loads((out / "manifest.json").read_text())
        error = manifest.get("error")
        artifacts = {}
        archives = {a["sha256"] for a in manifest.get("artifacts", []) if Path(a["path"]).name in ARCHIVES}
        for artifact in manifest.get("artifacts", []):
            path = out / artifact["path"]
            assert hashlib.sha256(path.read_bytes()).hexdigest() == artifact["sha256"], path
            if path.name in ARCHIVES:
                artifacts[artifact["path"]] = archive_content(path)
            elif path.name == "README.md":  # a model card: it names each archive's sha256, which differs as they do
                text = path.read_text()
                for digest in archives:
                    text = text.replace(digest, "<an archive's sha256>")
                artifacts[artifact["path"]] = "card:" + hashlib.sha256(text.encode()).hexdigest()
            else:
                artifacts[artifact["path"]] = artifact["sha256"]
        return cls(
            status=manifest["status"],
            error=(error.get("stage"), error.get("code")) if error else None,
            artifacts=artifacts,
            verdicts=tuple((v["format"], v.get("runtime"), v.get("verdict")) for v in manifest.get("verification", [])),
            failed_targets=tuple(t["target"] for t in manifest.get("failed_targets", [])),
            capture=(manifest.get("capture") or {}).get("method"),
        )


Runs = dict[str, list[Outcome]]  # case name -> one outcome per run, in the order they ran


# ---------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    import torch

    from tests.client.packaged import DETECTOR, UNTRACEABLE, package_model
    from tests.fixtures.models import save_pt2
    from tests.models import CORPUS
    from tests.models.coverage3_nms_llama import save_nms_package

    base = tmp_path_factory.mktemp("matrix-models")
    onnx_path = base / "cnn.onnx"
    case = CORPUS["cnn_bn"]
    torch.onnx.export(case.build(), case.example_inputs(2), str(onnx_path), dynamo=False, input_names=["x"],
                      output_names=["y"], dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}})
    rng = np.random.default_rng(7)
    calibration = base / "calib.npz"
    np.savez(calibration, x=rng.standard_normal((64, 3, 32, 32)).astype(np.float32))
    return {
        "cnn": save_pt2("cnn_bn", base / "cnn.pt2"),
        "tiny": save_pt2("tiny_linear", base / "tiny.pt2"),
        "transformer": save_pt2("transformer_block", base / "transformer.pt2"),
        "detector": package_model(DETECTOR, "matrix_detector", base / "detector"),
        "untraceable": package_model(UNTRACEABLE, "matrix_untraceable", base / "untraceable"),
        "nms": save_nms_package(base),
        "onnx": onnx_path,
        "calibration": calibration,
    }


def _orders() -> list[Case]:
    """Every case in order, then in reverse: in the second round each case runs after every other
    kind of job, and after a different neighbour than in the first."""
    return [*CASES, *reversed(CASES)]


def _convert(models: dict[str, Path], case: Case, base: Path, *extra: str) -> Outcome:
    """`fxport convert` of `case` into its own folder under `base`."""
    spec = base / f"{case.name}.json"
    spec.write_text(json.dumps(case.spec))
    out = base / case.name
    argv = [*FXPORT, "convert", str(models[case.model]), "--spec", str(spec), "--out", str(out), "--json", *extra]
    if case.calibration:
        argv += ["--calibration", str(models["calibration"])]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=scaled(600), cwd=base)
    assert proc.returncode in (0, 1), f"{case.name}: exit {proc.returncode}\n{proc.stderr[-3000:]}"
    return Outcome.of(out)


@dataclass
class LocalRuns:
    convert: Runs  # `fxport convert`: each spec in a cold sandbox
    no_sandbox: Runs  # `fxport convert --no-sandbox`: each spec in the CLI's own process
    one_process: Runs  # every spec in one process, outside the sandbox, in both orders


@pytest.fixture(scope="module")
def local_runs(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> LocalRuns:
    """The three paths without servers, side by side (each a process of its own, so the two cores
    are both used): the one-process sequence in the background while the CLI runs two at a time."""
    from concurrent.futures import ThreadPoolExecutor

    base = tmp_path_factory.mktemp("matrix-one-process")
    plan = [{"model": str(models[case.model]), "spec": case.spec, "out": str(base / f"{i:02d}-{case.name}"),
             "calibration": str(models["calibration"]) if case.calibration else None}
            for i, case in enumerate(_orders())]
    (base / "plan.json").write_text(json.dumps(plan))
    sequence = subprocess.Popen([sys.executable, "-m", "tests.fixtures.engine_sequence", str(base / "plan.json")],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                cwd=Path(__file__).parent.parent)
    try:
        folders = {"": tmp_path_factory.mktemp("matrix-convert"),
                   "--no-sandbox": tmp_path_factory.mktemp("matrix-no-sandbox")}
        with ThreadPoolExecutor(max_workers=2) as pool:
            futures = {(mode, case.name): pool.submit(_convert, models, case, folder, *([mode] if mode else []))
                       for mode, folder in folders.items() for case in CASES}
            outcomes = {key: future.result() for key, future in futures.items()}
        _, stderr = sequence.communicate(timeout=scaled(900))
    finally:
        if sequence.poll() is None:
            sequence.kill()
            sequence.wait()
    assert sequence.returncode == 0, stderr[-3000:]
    one_process: Runs = {}
    for step, case in zip(plan, _orders()):
        one_process.setdefault(case.name, []).append(Outcome.of(Path(step["out"])))
    return LocalRuns(convert={c.name: [outcomes[("", c.name)]] for c in CASES},
                     no_sandbox={c.name: [outcomes[("--no-sandbox", c.name)]] for c in CASES},
                     one_process=one_process)


@dataclass
class WorkerRuns:
    runs: Runs
    folders: dict[str, list[Path]]  # case name -> each run's downloaded folder
    worker_log: Path


@pytest.fixture(scope="module")
def worker_runs(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory, redis_server,
                s3_server) -> WorkerRuns:
    """A stack of its own (API and one cpu worker, concurrency 1: one warm sandbox), every case in
    order and in reverse, each waited for before the next is submitted."""
    from fxport.client import Client

    base = tmp_path_factory.mktemp("matrix-worker")
    # a Redis database of its own: its queue and job store, apart from the session's stack (whose
    # workers would otherwise take these jobs from the shared "cpu" queue)
    env = {**distributed_env(redis_server, s3_server, base, prefix="matrix"),
           "FXPORT_BROKER_URL": f"redis://127.0.0.1:{redis_server.port}/{REDIS_DB}"}
    api = start_api(base, env, name="matrix-api")
    worker = None
    try:
        worker = start_worker(base, env, "cpu", concurrency=1, name="matrix-worker")
        runs: Runs = {}
        folders: dict[str, list[Path]] = {}
        with Client(api.address) as client:
            for i, case in enumerate(_orders()):
                calibration = models["calibration"] if case.calibration else None
                job = client.submit(models[case.model], case.spec, calibration=calibration)
                job.wait(timeout=scaled(600))
                assert job.terminal and job.artifacts, (case.name, job.state, job.error)
                out = base / f"{i:02d}-{case.name}"
                job.download(out)
                runs.setdefault(case.name, []).append(Outcome.of(out))
                folders.setdefault(case.name, []).append(out)
        return WorkerRuns(runs, folders, worker.log)
    finally:
        if worker is not None:
            worker.stop()
        api.stop()


# ---------------------------------------------------------------------------------------
# The comparisons
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_every_path_and_every_order_gives_the_same_result(name: str, local_runs: LocalRuns,
                                                          worker_runs: WorkerRuns) -> None:
    case = BY_NAME[name]
    reference = local_runs.convert[name][0]
    assert reference.status == "succeeded", f"{name} through `fxport convert`: {reference}"
    assert all(v[2] == "passed" for v in reference.verdicts), reference.verdicts
    assert reference.verdicts or case.model == "onnx", f"{name}: nothing verified"
    paths = {"convert --no-sandbox": local_runs.no_sandbox[name], "warm worker": worker_runs.runs[name],
             "one process": local_runs.one_process[name]}
    for path, outcomes in paths.items():
        for run, outcome in enumerate(outcomes):
            assert outcome == reference, (f"{name}: run {run + 1} through {path} differs from `fxport convert`:\n"
                                          f"  {path}: {outcome}\n  convert: {reference}")


def test_an_int8_job_after_an_fp32_job_on_a_warm_worker_keeps_its_accuracy(worker_runs: WorkerRuns) -> None:
    """The int8 ONNX that a warm worker built after fp32 jobs computes what the fp32 eager model
    computes on inputs it was never calibrated on (cosine >= 0.99)."""
    import onnx
    import onnxruntime as ort
    import torch

    from tests.models import CORPUS

    order = [c.name for c in _orders()]
    assert order.index("fp32_all_targets") < order.index("int8_calibrated")  # the case of the issue
    model = CORPUS["cnn_bn"].build()
    x = torch.from_numpy(np.random.default_rng(1234).standard_normal((4, 3, 32, 32)).astype(np.float32))
    with torch.no_grad():
        expected = model(x).numpy().ravel()
    for folder in worker_runs.folders["int8_calibrated"]:
        session = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
        got = session.run(None, {session.get_inputs()[0].name: x.numpy()})[0].ravel()
        cosine = float(np.dot(got, expected) / (np.linalg.norm(got) * np.linalg.norm(expected)))
        assert cosine >= 0.99, f"{folder.name}: int8 ONNX cosine {cosine:.5f} against the fp32 eager model"
        quantized = [n.op_type for n in onnx.load(str(folder / "model.onnx")).graph.node]
        assert "QuantizeLinear" in quantized, f"{folder.name}: no Q/DQ nodes: not an int8 model"


def test_the_paths_ran_what_they_say(local_runs: LocalRuns, worker_runs: WorkerRuns) -> None:
    """Each path ran each case the number of times the matrix says: the worker and the single
    process twice (once per order), the CLI once per mode; and the worker really ran them in its
    warm sandbox (its log names no cold start)."""
    for case in CASES:
        assert len(local_runs.convert[case.name]) == len(local_runs.no_sandbox[case.name]) == 1
        assert len(worker_runs.runs[case.name]) == len(local_runs.one_process[case.name]) == 2
    log = worker_runs.worker_log.read_text(errors="replace")
    assert "starting a cold one" not in log, log[-3000:]
    assert os.path.getsize(worker_runs.worker_log) > 0
