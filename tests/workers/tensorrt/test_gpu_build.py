"""TensorRT engines on a GPU: ResNet-18 in fp32, fp16 and int8 (from Q/DQ) with a dynamic batch,
verified at each profile's min and max; rebuilt with a warm timing cache; the job flow through
the sandbox and the shared cache in the store. Skipped, with the reason, without CUDA + TensorRT.

NOT YET RUN ON A GPU (no GPU machine was available when this was written): see docs/tensorrt.md.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from fxport.spec import parse_spec
from tests.models import get
from tests.workers.engine.conftest import save_pt2, spec_dict

pytestmark = pytest.mark.gpu

BATCH = (1, 4, 16)


@pytest.fixture(scope="module")
def gpu():
    pytest.importorskip("tensorrt", reason="TensorRT is not installed (GPU workers get it from NVIDIA's TensorRT "
                                           "container image; CPU machines cannot install it)")
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device visible (torch.cuda.is_available() is False)")
    return torch.cuda.get_device_name(0)


@pytest.fixture(scope="module")
def resnet_onnx(gpu, tmp_path_factory):
    """The CPU stage's output per precision: model.onnx (fp32, fp16 casts, int8 Q/DQ) or why it failed."""
    from fxport.workers.engine.pipeline import convert

    base = tmp_path_factory.mktemp("resnet_onnx")
    case = get("resnet18")
    pt2 = save_pt2(case, base / "resnet18.pt2")
    out: dict[str, Path | str] = {"pt2": pt2}
    for precision in ("fp32", "fp16", "int8"):
        spec = parse_spec(spec_dict(case, targets=("onnx",), batch=BATCH, precision=precision,
                                    verify={"samples": 2, "fail_on_mismatch": False}))
        try:
            convert(pt2, spec, base / precision, deferred_targets=("tensorrt",))
            # int8: the engine's own ONNX (symmetric), beside onnxruntime's model.onnx
            out[precision] = next(p for p in (base / precision / "model.tensorrt.onnx", base / precision / "model.onnx")
                                  if p.is_file())
        except Exception as exc:  # int8 Q/DQ export comes from the quantization work; say why it is missing
            out[precision] = f"{type(exc).__name__}: {exc}"
    return out


def trt_spec(precision: str, **extra):
    case = get("resnet18")
    spec = spec_dict(case, targets=("tensorrt",), batch=BATCH, precision=precision, verify={"samples": 2}, **extra)
    spec.pop("passes", None)
    return parse_spec(spec)


def onnx_for(resnet_onnx, precision) -> Path:
    value = resnet_onnx[precision]
    if isinstance(value, str):
        pytest.skip(f"no {precision} ONNX model to build from: {value}")
    return value


@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8"])
def test_engine_per_precision_with_dynamic_batch_verified_at_profile_extremes(resnet_onnx, precision, tmp_path, gpu):
    from fxport.workers.engine.pipeline import convert

    onnx_path = onnx_for(resnet_onnx, precision)
    cache = tmp_path / "timing.cache"
    manifest = convert(onnx_path, trt_spec(precision), tmp_path / "out", timing_cache_path=cache)
    engine = tmp_path / "out" / "model.engine"
    assert engine.is_file() and engine.stat().st_size > 1 << 20
    [art] = [a for a in manifest["artifacts"] if a["format"] == "tensorrt"]
    assert art["sha256"] == hashlib.sha256(engine.read_bytes()).hexdigest()

    meta = manifest["tensorrt"]["engine"]
    assert meta["precision"] == precision and meta["gpu_name"] == gpu
    assert meta["tensorrt_version"] and meta["compute_capability"] and meta["cuda_driver_version"]
    assert meta["profiles"] == [{"x": {"min": [1, 3, 224, 224], "opt": [4, 3, 224, 224], "max": [16, 3, 224, 224]}}]
    assert manifest["tensorrt"]["preflight"]["ok"]
    assert manifest["tensorrt"]["build"]["timing_cache"]["status"] == "cold" and cache.stat().st_size > 0

    [record] = [v for v in manifest["verification"] if v["format"] == "tensorrt"]
    assert record["passed"], record
    assert [1, 3, 224, 224] in record["shapes_checked"] and [16, 3, 224, 224] in record["shapes_checked"]
    assert record["reference"].startswith("onnxruntime") and record["precision"] == precision


def test_rebuild_with_a_warm_timing_cache(resnet_onnx, tmp_path):
    from fxport.workers.engine.pipeline import convert

    onnx_path = onnx_for(resnet_onnx, "fp16")
    cache = tmp_path / "timing.cache"
    cold = convert(onnx_path, trt_spec("fp16"), tmp_path / "cold", timing_cache_path=cache)
    size = cache.stat().st_size
    warm = convert(onnx_path, trt_spec("fp16"), tmp_path / "warm", timing_cache_path=cache)
    assert cold["tensorrt"]["build"]["timing_cache"]["status"] == "cold"
    assert warm["tensorrt"]["build"]["timing_cache"]["status"] == "warm"
    assert warm["tensorrt"]["build"]["timing_cache"]["bytes_in"] == size
    assert all(v["passed"] for v in warm["verification"])


def test_a_corrupt_timing_cache_is_discarded_with_a_warning(resnet_onnx, tmp_path):
    from fxport.workers.engine.pipeline import convert

    cache = tmp_path / "timing.cache"
    cache.write_bytes(b"\x00garbage, not a TensorRT timing cache" * 64)
    manifest = convert(onnx_for(resnet_onnx, "fp32"), trt_spec("fp32"), tmp_path / "out", timing_cache_path=cache)
    assert manifest["tensorrt"]["build"]["timing_cache"]["status"] == "discarded"
    assert any("timing cache discarded" in w for w in manifest["warnings"])
    assert (tmp_path / "out" / "model.engine").is_file()


def test_pt2_to_engine_in_one_process_is_verified_against_the_eager_model(resnet_onnx, tmp_path):
    from fxport.workers.engine.pipeline import convert

    case = get("resnet18")
    spec = parse_spec(spec_dict(case, targets=("tensorrt",), batch=BATCH, verify={"samples": 2}))
    manifest = convert(resnet_onnx["pt2"], spec, tmp_path / "out")
    assert {a["format"] for a in manifest["artifacts"]} >= {"onnx", "tensorrt"}
    [record] = [v for v in manifest["verification"] if v["format"] == "tensorrt"]
    assert record["passed"] and record["reference"] == "the original model (eager)"


def test_parser_error_names_the_node_and_op(gpu, tmp_path):
    import onnx
    from onnx import TensorProto, helper

    from fxport.errors import ConversionFailed
    from fxport.workers.engine.tensorrt.builder import NetworkFromOnnxPath

    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["r"], name="fine"),
                               helper.make_node("Unique", ["r"], ["y"], name="no_such_layer")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["k"])])
    path = tmp_path / "u.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]), str(path))
    with pytest.raises(ConversionFailed) as err:
        NetworkFromOnnxPath(path)()  # the preflight is bypassed on purpose: this is the parser's own error
    assert "no_such_layer" in str(err.value) and "Unique" in str(err.value) and err.value.stage == "tensorrt"


def test_runner_refuses_shapes_outside_every_profile(resnet_onnx, tmp_path):
    import torch

    from fxport.workers.engine.pipeline import convert
    from fxport.workers.engine.tensorrt.runner import TrtRunner

    convert(onnx_for(resnet_onnx, "fp32"), trt_spec("fp32"), tmp_path / "out")
    with TrtRunner(tmp_path / "out" / "model.engine", ["x"]) as runner:
        assert runner.infer((torch.randn(2, 3, 224, 224),))[0].shape == (2, 1000)
        with pytest.raises(ValueError, match="outside every optimization profile"):
            runner.infer((torch.randn(32, 3, 224, 224),))


def test_job_flow_through_the_sandbox_and_the_shared_cache_in_the_store(gpu, tmp_path, monkeypatch):
    """CPU stage → tensorrt stage as the workers run them (sandboxed engine, file store, SQLite
    jobs): the engine is built, merged into the manifest, and the timing cache published under
    its key; a second job on the same GPU model builds warm from it."""
    from fxport.config import Settings
    from fxport.jobs import InputRef, JobRecord, JobState, SqliteJobStore, new_job_id
    from fxport.storage import FileStore, input_key
    from fxport.workers.engine.tensorrt.timing_cache import probe_device_identity
    from fxport.workers.jobs import WorkerContext, execute_job, execute_stage

    if probe_device_identity() is None:
        pytest.skip("nvidia-smi with the compute_cap field is needed to key the shared timing cache")
    monkeypatch.setenv("FXPORT_SANDBOX_THREADS", "4")
    case = get("resnet18_small")
    pt2 = save_pt2(case, tmp_path / "m.pt2")
    store, jobs = FileStore(tmp_path / "store"), SqliteJobStore(tmp_path / "jobs.db")
    handed: list[tuple[str, str]] = []
    ctx = WorkerContext(jobs=jobs, artifacts=store, settings=Settings(home=tmp_path, work_dir=tmp_path / "work"),
                        enqueue_stage=lambda stage, job_id: handed.append((stage, job_id)), worker_id="gpu-test")
    sha = hashlib.sha256(pt2.read_bytes()).hexdigest()
    store.put_file(input_key("default", sha), pt2)
    statuses = []
    for _ in range(2):
        spec = parse_spec(spec_dict(case, targets=("tensorrt",), verify={"samples": 2}))
        rec, _ = jobs.create(JobRecord(id=new_job_id(), tenant="default", spec=spec,
                                       spec_digest=spec.digest(),
                                       model=InputRef(sha256=sha, bytes=pt2.stat().st_size, filename="m.pt2",
                                                      key=input_key("default", sha))))
        after_cpu = execute_job(rec.id, ctx)
        assert after_cpu.state is JobState.QUEUED and after_cpu.stage == "tensorrt", after_cpu.error
        done = execute_stage("tensorrt", rec.id, ctx)
        assert done.state is JobState.SUCCEEDED, done.error
        assert {"model.engine", "model.onnx", "manifest.json"} <= {a.name for a in done.artifacts}
        store.get(f"default/jobs/{rec.id}/manifest.json", tmp_path / f"{rec.id}.json")
        merged = json.loads((tmp_path / f"{rec.id}.json").read_text())
        assert merged["tensorrt"]["engine"]["precision"] == "fp32" and merged["tensorrt"]["preflight"]["ok"]
        assert {v["format"] for v in merged["verification"]} >= {"onnx", "tensorrt"}
        assert merged["tensorrt"]["shared_timing_cache"]["key"].startswith("cache/tensorrt/")
        statuses.append(merged["tensorrt"]["build"]["timing_cache"]["status"])
    assert statuses == ["cold", "warm"]
    jobs.close()
