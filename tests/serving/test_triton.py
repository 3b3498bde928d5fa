"""From verified artifacts to a Triton model repository (issue 41), through the real CLI.

A model with two inputs and two outputs, dynamic batch (1..32) and sequence (2..128), is converted
to ONNX and TorchScript by `fxport convert --package triton` (in its sandbox, as a user runs it),
and packaged again from that folder by `fxport package triton`. Both repositories are held to what
Triton needs: every config parses into Triton's ModelConfig (its own model_config.proto) and passes
its load checks; the names, data types and ranks agree with the artifacts themselves (read with
onnx and torch.jit); `max_batch_size` is the spec's batch max; and the samples reproduce in
onnxruntime and TorchScript. No Triton server runs here (docs/serving.md says what that leaves).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fxport.manifest import TensorSignature
from fxport.serving.signature import batch_axis
from fxport.serving.triton import (
    BACKENDS,
    PackageError,
    check_config,
    model_config_class,
    parse_config,
    write_triton_repository,
)
from tests.fixtures.client_venv import client_venv
from tests.fixtures.servers import scaled

FXPORT = [sys.executable, "-m", "fxport.cli"]
BATCH_MAX = 32
ONNX_TYPES = {1: "TYPE_FP32", 7: "TYPE_INT64", 9: "TYPE_BOOL", 10: "TYPE_FP16"}
TORCH_TYPES = {"torch.float32": "TYPE_FP32", "torch.int64": "TYPE_INT64"}


def _two_in_two_out(path: Path) -> Path:
    import torch
    from torch import nn

    class TwoInTwoOut(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.head = nn.Linear(16, 32), nn.Linear(32, 4)

        def forward(self, tokens: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            hidden = self.embed(tokens) * mask.unsqueeze(-1)  # [batch, seq, 32]
            pooled = hidden.sum(1) / mask.sum(1, keepdim=True).clamp(min=1)
            return self.head(torch.relu(pooled)), hidden  # [batch, 4], [batch, seq, 32]

    torch.manual_seed(0)
    batch, seq = torch.export.Dim("batch", min=1, max=BATCH_MAX), torch.export.Dim("seq", min=2, max=128)
    program = torch.export.export(TwoInTwoOut().eval(), (torch.randn(2, 8, 16), torch.ones(2, 8)),
                                  dynamic_shapes=({0: batch, 1: seq}, {0: batch, 1: seq}))
    torch.export.save(program, path)
    return path


def _fxport(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*FXPORT, *args], capture_output=True, text=True, timeout=scaled(600), cwd=cwd)


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Path:
    """`fxport convert --package triton --benchmark` of the two-in, two-out model: its --out folder."""
    base = tmp_path_factory.mktemp("triton")
    model = _two_in_two_out(base / "two.pt2")
    spec = base / "spec.json"
    spec.write_text(json.dumps({"targets": ["onnx", "torchscript"], "verify": {"samples": 2},
                                "labels": {"model": "two"},
                                "benchmark": {"batches": [1, 4], "warmup": 1, "runs": 3, "max_seconds": 30}}))
    out = base / "out"
    proc = _fxport("convert", str(model), "--spec", str(spec), "--package", "triton", "--out", str(out), cwd=base)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def packaged(job) -> Path:
    """The same job folder packaged again by `fxport package triton`."""
    repo = job.parent / "repo"
    proc = _fxport("package", "triton", str(job), "--name", "two", "--out", str(repo), "--json", cwd=job.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    written = json.loads(proc.stdout)
    assert [m["name"] for m in written["models"]] == ["two_onnx", "two_torchscript"]
    return repo


def _configs(repo: Path) -> dict[str, object]:
    cls = model_config_class()
    return {p.parent.name: parse_config(p.read_text(), cls, p.parent.name) for p in sorted(repo.glob("*/config.pbtxt"))}


def test_the_job_and_the_package_command_write_the_same_repository(job, packaged):
    manifest = json.loads((job / "manifest.json").read_text())
    listed = {a["path"] for a in manifest["artifacts"]}
    written = {str(p.relative_to(job)) for p in (job / "triton").rglob("*") if p.is_file()}
    assert written <= listed and "samples.npz" in listed  # every file of it is an artifact of the job
    assert manifest["package"]["triton"]["name"] == "two"  # the job's label `model`
    for path in sorted(packaged.rglob("*")):
        if path.is_file():
            assert path.read_bytes() == (job / "triton" / path.relative_to(packaged)).read_bytes(), path


def test_the_manifest_names_the_batch_axis(job):
    signature = json.loads((job / "manifest.json").read_text())["signature"]
    assert [t["name"] for t in signature["inputs"]] == ["tokens", "mask"]
    assert [t["name"] for t in signature["outputs"]] == ["output_0", "output_1"]
    assert signature["batch"]["dim"] == "batch" and signature["batch"]["max"] == BATCH_MAX
    assert signature["outputs"][1]["shape"][0] == "batch"


def test_every_config_is_one_triton_loads_and_agrees_with_its_artifact(packaged):
    import onnx
    import torch

    configs = _configs(packaged)
    assert set(configs) == {"two_onnx", "two_torchscript"}
    for name, cfg in configs.items():
        check_config(cfg, name)
        assert cfg.max_batch_size == BATCH_MAX  # the spec's batch max
        assert list(cfg.dynamic_batching.preferred_batch_size) in ([1], [4])  # from the benchmark
        assert [g.kind for g in cfg.instance_group] == [type(cfg.instance_group[0]).DESCRIPTOR.enum_types_by_name[
            "Kind"].values_by_name["KIND_CPU"].number]
    type_name = type(configs["two_onnx"].input[0]).DESCRIPTOR.fields_by_name["data_type"].enum_type \
        .values_by_number

    onnx_cfg = configs["two_onnx"]
    graph = onnx.load(packaged / "two_onnx" / "1" / "model.onnx").graph
    for tensors, declared in ((graph.input, onnx_cfg.input), (graph.output, onnx_cfg.output)):
        assert [t.name for t in tensors] == [t.name for t in declared]
        for t, d in zip(tensors, declared):
            assert ONNX_TYPES[t.type.tensor_type.elem_type] == type_name[d.data_type].name
            assert len(t.type.tensor_type.shape.dim) == len(d.dims) + 1  # + the batch axis

    ts_cfg = configs["two_torchscript"]
    module = torch.jit.load(str(packaged / "two_torchscript" / "1" / "model.pt"))
    assert len(module.forward.schema.arguments) - 1 == len(ts_cfg.input)  # but self
    samples = np.load(packaged / "two_torchscript" / "samples.npz")
    outputs = module(*(torch.from_numpy(samples[f"inputs/{t.name}"]) for t in ts_cfg.input))
    assert len(outputs) == len(ts_cfg.output)
    for out, declared in zip(outputs, ts_cfg.output):
        assert TORCH_TYPES[str(out.dtype)] == type_name[declared.data_type].name
        assert out.dim() == len(declared.dims) + 1


def test_the_samples_reproduce_in_each_runtime(packaged):
    import onnxruntime as ort
    import torch

    onnx_samples = np.load(packaged / "two_onnx" / "samples.npz")
    session = ort.InferenceSession(str(packaged / "two_onnx" / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    got = session.run(None, {i.name: onnx_samples[f"inputs/{i.name}"] for i in session.get_inputs()})
    for o, value in zip(session.get_outputs(), got):
        np.testing.assert_allclose(value, onnx_samples[f"outputs/{o.name}"], rtol=1e-3, atol=1e-4)

    ts_samples = np.load(packaged / "two_torchscript" / "samples.npz")
    module = torch.jit.load(str(packaged / "two_torchscript" / "1" / "model.pt"))
    got = module(torch.from_numpy(ts_samples["inputs/tokens__0"]), torch.from_numpy(ts_samples["inputs/mask__1"]))
    for k, value in enumerate(got):
        np.testing.assert_allclose(value.detach().numpy(), ts_samples[f"outputs/output_{k}__{k}"], rtol=1e-3, atol=1e-4)
    assert onnx_samples["inputs/tokens"].shape[0] >= 1  # with its batch axis, as a request carries it


def test_the_model_card_says_what_was_verified_and_recommended(packaged, job):
    card = (packaged / "README.md").read_text()
    manifest = json.loads((job / "manifest.json").read_text())
    recommended = manifest["benchmark"]["recommendation"]["artifact"]
    assert f"`two_{recommended}`" in next(line for line in card.splitlines() if "**recommended**" in line)
    assert manifest["input"]["sha256"] in card
    assert "| onnx | onnxruntime | passed |" in card and "| torchscript | torch.jit | passed |" in card
    assert "Not validated here: loading the repository in a running Triton server." in card


def test_kserve_serves_the_jobs_own_repository_from_the_store(job, tmp_path):
    import yaml

    proc = _fxport("package", "kserve", str(job), "--name", "two", "--store", "s3://models/fxport",
                   "--tenant", "alice", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    service = yaml.safe_load(proc.stdout)
    manifest = json.loads((job / "manifest.json").read_text())
    model = service["spec"]["predictor"]["model"]
    assert service["apiVersion"] == "serving.kserve.io/v1beta1" and service["kind"] == "InferenceService"
    assert model["storageUri"] == f"s3://models/fxport/alice/jobs/{manifest['job_id']}/triton"
    assert model["modelFormat"] == {"name": "triton"} and "nvidia.com/gpu" not in model["resources"]["limits"]
    assert service["metadata"]["annotations"]["fxport.io/models"] == "two_onnx,two_torchscript"

    refused = _fxport("package", "kserve", str(job), "--name", "Two_Models", "--storage-uri", "s3://b/p",
                      cwd=tmp_path)
    assert refused.returncode == 2 and "--name" in refused.stderr


# -- refusals, named ---------------------------------------------------------------------


def test_the_package_command_refuses_what_it_cannot_package_and_names_why(job, tmp_path):
    not_a_job = _fxport("package", "triton", str(tmp_path), "--out", str(tmp_path / "r1"), cwd=tmp_path)
    assert not_a_job.returncode == 2 and "no manifest.json" in not_a_job.stderr

    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "x").write_text("x")
    busy = _fxport("package", "triton", str(job), "--out", str(taken), cwd=tmp_path)
    assert busy.returncode == 2 and "not an empty folder" in busy.stderr

    tampered = tmp_path / "tampered"
    subprocess.run(["cp", "-r", str(job), str(tampered)], check=True)
    (tampered / "model.onnx").write_bytes((tampered / "model.onnx").read_bytes() + b"\0")
    changed = _fxport("package", "triton", str(tampered), "--out", str(tmp_path / "r2"), cwd=tmp_path)
    assert changed.returncode == 2 and "model.onnx does not match the sha256" in changed.stderr
    assert not (tmp_path / "r2").exists()  # nothing written

    failed = tmp_path / "failed"
    subprocess.run(["cp", "-r", str(job), str(failed)], check=True)
    manifest = json.loads((failed / "manifest.json").read_text())
    manifest["status"] = "failed"
    (failed / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(PackageError, match="the job failed"):
        write_triton_repository(failed, "two", tmp_path / "r3")

    unverified = json.loads((job / "manifest.json").read_text())
    for v in unverified["verification"]:
        v["verdict"], v["passed"] = "failed", False
    (failed / "manifest.json").write_text(json.dumps(unverified))
    with pytest.raises(PackageError, match="nothing to serve.*onnx: its verification is failed"):
        write_triton_repository(failed, "two", tmp_path / "r4")


def test_an_onnx_upload_asked_for_a_package_is_refused_at_load_naming_the_field(job, tmp_path):
    proc = _fxport("convert", str(job / "model.onnx"), "--target", "onnx", "--package", "triton",
                   "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "package triton needs the PyTorch model" in proc.stderr
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["error"]["field"] == "package"


@pytest.mark.parametrize(("edit", "field"), [
    (lambda t: t.replace('name: "output_0__0"', 'name: "output_0"'), "output[0].name"),
    (lambda t: t.replace("max_batch_size: 32", "max_batch_size: 0"), "dynamic_batching"),
    (lambda t: t.replace("preferred_batch_size: [ ", "preferred_batch_size: [ 64, "), "preferred_batch_size[0]"),
    (lambda t: t.replace("dims: [ 8, 16 ]", "dims: [ -1, 16 ]"), "model_warmup[0].inputs[tokens__0].dims"),
    (lambda t: t.replace("dims: [ 4 ]", "dims: [ 0 ]"), "output[0].dims[0]"),
    (lambda t: t.replace("instance_group", "instance_groups"), "instance_groups"),
])
def test_a_config_triton_would_refuse_is_refused_naming_the_field(packaged, edit, field):
    text = edit((packaged / "two_torchscript" / "config.pbtxt").read_text())
    with pytest.raises(PackageError) as refused:
        check_config(parse_config(text, model_config_class(), "two_torchscript"), "two_torchscript")
    assert field in str(refused.value)


def _t(name: str, shape: list | None) -> TensorSignature:
    return TensorSignature(name=name, dtype="float32", shape=shape)


def test_the_batch_axis_is_decided_only_when_every_input_and_output_carries_it():
    dims = {"batch": {"min": 1, "opt": 2, "max": 8}, "seq": {"min": 1, "opt": 4, "max": 16}}
    ok = batch_axis([_t("a", ["batch", 3]), _t("b", ["batch", "seq"])], [_t("y", ["batch", 2])], dims)
    assert (ok.dim, ok.max) == ("batch", 8)
    assert "static dim 0 (1)" in batch_axis([_t("a", [1, 3])], [_t("y", [1, 2])], dims).note
    two = [_t("a", ["batch"]), _t("b", ["seq"])]
    assert "different dims (batch, seq)" in batch_axis(two, [_t("y", [2])], dims).note
    assert "output 'y' starts with 2" in batch_axis([_t("a", ["batch", 3])], [_t("y", [2, "batch"])], dims).note
    assert "output 'y' has no recorded shape" in batch_axis([_t("a", ["batch"])], [_t("y", None)], dims).note
    assert BACKENDS["torchscript"].platform == "pytorch_libtorch"


@pytest.mark.slow
def test_the_client_install_packages_beside_tritonclient_without_a_downgrade(job, tmp_path):
    """A CI pipeline's environment: fxport's base install and tritonclient[grpc] side by side (pip
    resolves both; neither is held back), where `fxport package triton` (no torch) writes the same
    repository, and tritonclient's own generated ModelConfig parses every config."""
    import tomllib

    repo_root = Path(__file__).resolve().parents[2]
    deps = tomllib.loads((repo_root / "pyproject.toml").read_text())["project"]["dependencies"]
    python = str(client_venv(tmp_path))
    proc = subprocess.run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", *deps,
                           "tritonclient[grpc]"], capture_output=True, text=True, timeout=scaled(900))
    assert proc.returncode == 0, proc.stderr[-3000:]
    check = subprocess.run([python, "-m", "pip", "check"], capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stdout
    version = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('tritonclient'))"],
                             capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    assert tuple(int(p) for p in version.split(".")[:2]) >= (2, 73), f"tritonclient held back at {version}"

    repo = tmp_path / "repo"
    made = subprocess.run([python, "-m", "fxport.cli", "package", "triton", str(job), "--name", "two",
                           "--out", str(repo)], capture_output=True, text=True, timeout=scaled(300), cwd=tmp_path)
    assert made.returncode == 0, made.stderr[-3000:]
    assert "torch" not in subprocess.run([python, "-m", "pip", "list"], capture_output=True, text=True,
                                         timeout=120).stdout.split()
    parse = ("import sys; from pathlib import Path; from google.protobuf import text_format; "
             "from tritonclient.grpc import model_config_pb2 as m\n"
             "for p in sorted(Path(sys.argv[1]).glob('*/config.pbtxt')):\n"
             "    c = text_format.Parse(p.read_text(), m.ModelConfig()); print(c.name, c.max_batch_size)")
    parsed = subprocess.run([python, "-c", parse, str(repo)], capture_output=True, text=True, timeout=120)
    assert parsed.returncode == 0, parsed.stderr[-3000:]
    assert parsed.stdout.split() == ["two_onnx", str(BATCH_MAX), "two_torchscript", str(BATCH_MAX)]
    for path in sorted(repo.rglob("*")):
        if path.is_file():
            assert path.read_bytes() == (job / "triton" / path.relative_to(repo)).read_bytes(), path
