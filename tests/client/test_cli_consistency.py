"""One command-line contract (README, "Command line") whichever command runs: the same input
gets the same exit code and the same wording from `fxport convert` (here, no servers) and from
`fxport submit --wait` (on a real embedded server), every error names the command that ran,
`jobs list` never cuts an id, progress lines read alike — and `convert --target tensorrt` on a
machine without TensorRT does the CPU stage's work before it says it cannot build the engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.client.packaged import UNTRACEABLE, package_model

FXPORT = [sys.executable, "-m", "fxport.cli"]


def fxport(*args: str, cwd: Path, columns: int = 200) -> subprocess.CompletedProcess[str]:
    """The real console entry point, stdout and stderr not terminals (as in CI)."""
    env = {**os.environ, "COLUMNS": str(columns)}
    return subprocess.run([*FXPORT, *args], cwd=cwd, capture_output=True, text=True, timeout=300, env=env)


@pytest.fixture(scope="module")
def state_dict(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A .pt file holding only a dict of tensors (what `torch.save(model.state_dict())` writes): no model."""
    import torch

    path = tmp_path_factory.mktemp("state_dict") / "weights.pt"
    torch.save({"fc.weight": torch.randn(3, 3), "fc.bias": torch.zeros(3)}, path)
    return path


def _no_engine_here() -> str | None:
    from fxport.workers.engine.tensorrt.builder import tensorrt_unavailable

    return tensorrt_unavailable()


needs_no_tensorrt = pytest.mark.skipif(_no_engine_here() is None,
                                       reason="this machine can build TensorRT engines: the no-engine path is moot")


# ---------------------------------------------------------------------------------------
# 16a. Errors name the command that ran
# ---------------------------------------------------------------------------------------


def test_a_spec_error_names_the_command_that_ran(embedded_server, tmp_path: Path) -> None:
    """A spec error is raised with stage "submit" (the request's validation); `convert` said
    "error during submit" for it. Each command now names itself, with the same JSON error document:
    `convert` checks the spec itself, `submit` hears it from the server (CheckUpload checks the spec
    before a byte of the model moves), with the same field violations."""
    model = tmp_path / "model.pt2"
    model.write_bytes(b"never read: the spec is refused first")
    proc = fxport("convert", str(model), "--pass", "fuse_everything", "--out", str(tmp_path / "o"), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("fxport convert: error: invalid job spec"), proc.stderr
    assert "during submit" not in proc.stderr and "passes[0]" in proc.stderr

    docs = {}
    for command in ("convert", "submit"):
        extra = ("--server", embedded_server.address) if command == "submit" else ("--out", str(tmp_path / "o"))
        proc = fxport(command, str(model), "--pass", "fuse_everything", *extra, "--json", cwd=tmp_path)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.startswith(f"fxport {command}: error: invalid job spec"), proc.stderr
        docs[command] = json.loads(proc.stdout)["error"]
    assert docs["convert"]["command"] == "convert" and docs["submit"]["command"] == "submit"
    for doc in docs.values():
        assert doc["code"] == "invalid_spec" and doc["violations"][0]["field"] == "passes[0]"


# ---------------------------------------------------------------------------------------
# 16b. Invalid input exits 2 from convert and from submit --wait
# ---------------------------------------------------------------------------------------


def test_a_state_dict_exits_2_from_convert_and_from_submit_wait(embedded_server, state_dict: Path,
                                                                tmp_path: Path) -> None:
    local = fxport("convert", str(state_dict), "-t", "onnx", "--input", "x:2,3", "--out", str(tmp_path / "o"),
                   cwd=tmp_path)
    assert local.returncode == 2, local.stderr
    assert "fxport convert: error during load:" in local.stderr and "torch.save checkpoint" in local.stderr

    remote = fxport("submit", str(state_dict), "-t", "onnx", "--input", "x:2,3", "--server", embedded_server.address,
                    "--wait", "--timeout", "120", "--json", cwd=tmp_path)
    assert remote.returncode == 2, (remote.stdout, remote.stderr)
    job = json.loads(remote.stdout)
    assert job["state"] == "FAILED" and (job["error"]["stage"], job["error"]["code"]) == ("load", "unsupported_format")
    assert "torch.save checkpoint" in job["error"]["message"]
    # following the finished job again gives the same code
    watched = fxport("jobs", "watch", job["job_id"], "--server", embedded_server.address, cwd=tmp_path)
    assert watched.returncode == 2, watched.stderr


# ---------------------------------------------------------------------------------------
# 23.5 A model no capture method follows is a failed conversion: exit 1 from both
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def untraceable(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A torch.package whose forward branches in Python on a tensor's value, and where it does."""
    model = package_model(UNTRACEABLE, "untraceable_model", tmp_path_factory.mktemp("untraceable"))
    line = next(n for n, text in enumerate(UNTRACEABLE.splitlines(), 1) if "if y.sum() > 0" in text)
    return model, f"untraceable_model.py:{line}"


def _names_every_rung_and_the_line(message: str, where: str) -> None:
    assert message.count("no capture method could turn the model into a graph") == 1, message
    for rung in ("fx: TraceError", "; export: ", "; export (strict): "):
        assert rung in message, (rung, message)
    assert f"{where}: if y.sum() > 0" in message, message


def test_an_untraceable_model_exits_1_from_convert_and_from_submit_wait(embedded_server, untraceable,
                                                                        tmp_path: Path) -> None:
    """It loads and runs on its inputs (invalid input would exit 2): the conversion fails, exit 1, and
    the message lists each capture method's reason with the user's line, from either command. (The
    target needs a graph: for TorchScript and ONNX alone, `capture: auto` builds from the eager model.)"""
    model, where = untraceable
    local = fxport("convert", str(model), "-t", "exported_program", "--input", "x:2,4", "--out", str(tmp_path / "o"),
                   cwd=tmp_path)
    assert local.returncode == 1, local.stderr
    _names_every_rung_and_the_line(local.stderr[local.stderr.index("fxport convert: error during capture:"):],
                                   where)
    manifest = json.loads((tmp_path / "o" / "manifest.json").read_text())
    assert (manifest["error"]["stage"], manifest["error"]["code"]) == ("capture", "capture_failed")

    remote = fxport("submit", str(model), "-t", "exported_program", "--input", "x:2,4", "--server",
                    embedded_server.address,
                    "--wait", "--timeout", "240", "--json", cwd=tmp_path)
    assert remote.returncode == 1, (remote.stdout, remote.stderr)
    job = json.loads(remote.stdout)
    assert job["state"] == "FAILED" and (job["error"]["stage"], job["error"]["code"]) == ("capture", "capture_failed")
    _names_every_rung_and_the_line(job["error"]["message"], where)
    watched = fxport("jobs", "watch", job["job_id"], "--server", embedded_server.address, cwd=tmp_path)
    assert watched.returncode == 1, watched.stderr


# ---------------------------------------------------------------------------------------
# 16c. jobs list never cuts an id
# ---------------------------------------------------------------------------------------


def test_jobs_list_prints_whole_ids_at_80_columns(embedded_server, state_dict: Path, tmp_path: Path) -> None:
    label = "purpose=checking-that-job-ids-are-never-cut-at-eighty-columns"
    ids = []
    for _ in range(2):
        proc = fxport("submit", str(state_dict), "-t", "onnx", "-t", "torchscript", "-t", "exported_program",
                      "--input", "x:2,3", "--label", label, "--label", "team=a-rather-long-team-name",
                      "--server", embedded_server.address, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        ids.append(proc.stdout.strip())
    listed = fxport("jobs", "list", "--label", label, "--server", embedded_server.address, cwd=tmp_path, columns=80)
    assert listed.returncode == 0, listed.stderr
    assert all(job_id in listed.stdout for job_id in ids), listed.stdout  # a rich table cut them: "01m8xfsen7…"
    lines = listed.stdout.splitlines()
    assert lines[0].split()[0] == "id"
    assert sorted(line.split()[0] for line in lines[1:]) == sorted(ids), listed.stdout  # one line per job, id whole
    assert all(label in line for line in lines[1:]), listed.stdout  # nothing else cut either


# ---------------------------------------------------------------------------------------
# 16d. Progress lines
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def submitted(embedded_server, tiny_pt2: Path, tmp_path_factory: pytest.TempPathFactory
              ) -> subprocess.CompletedProcess[str]:
    tmp = tmp_path_factory.mktemp("submitted")
    proc = fxport("submit", str(tiny_pt2), "-t", "torchscript", "-t", "onnx", "--server", embedded_server.address,
                  "--wait", "--timeout", "240", cwd=tmp)
    assert proc.returncode == 0, proc.stderr
    return proc


def test_submit_wait_words_stage_starts_as_convert_does(submitted: subprocess.CompletedProcess[str]) -> None:
    """`convert` prints `[export] started`; `submit --wait` printed `[export] running` for the same event."""
    lines = submitted.stderr.splitlines()
    for stage in ("capture", "passes", "export", "verify"):
        assert f"[{stage}] started" in lines, submitted.stderr
    assert not any(line.endswith("] running") for line in lines), submitted.stderr


def test_submit_wait_shows_each_export_target(submitted: subprocess.CompletedProcess[str]) -> None:
    lines = submitted.stderr.splitlines()
    assert "[export] torchscript" in lines and "[export] onnx" in lines, submitted.stderr


# ---------------------------------------------------------------------------------------
# 15. convert --target tensorrt on a machine without TensorRT
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tensorrt_json(tiny_pt2: Path, tmp_path_factory: pytest.TempPathFactory
                  ) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp_path_factory.mktemp("trt") / "out"
    proc = fxport("convert", str(tiny_pt2), "-t", "torchscript", "-t", "tensorrt", "--out", str(out), "--json",
                  cwd=out.parent)
    return proc, out


def test_convert_json_prints_progress_on_stderr_as_submit_does(tensorrt_json) -> None:
    proc, _ = tensorrt_json
    json.loads(proc.stdout)  # stdout is still exactly one JSON document
    lines = proc.stderr.splitlines()
    for line in ("[export] started", "[export] torchscript", "[export] onnx", "[export] TensorRT preflight"):
        assert line in lines, proc.stderr


@needs_no_tensorrt
def test_convert_tensorrt_without_tensorrt_runs_the_cpu_stage_then_says_it_cannot_build(tensorrt_json) -> None:
    proc, out = tensorrt_json
    assert proc.returncode == 2, proc.stderr  # bad usage here: the model itself is fine
    result = json.loads(proc.stdout)  # the result document, drawn from manifest.json
    manifest = json.loads((out / "manifest.json").read_text())
    assert result["state"] == "FAILED" and result["exit_code"] == 2 and result["manifest"] == str(out / "manifest.json")
    assert (result["error"]["stage"], result["error"]["code"]) == ("tensorrt", "unavailable_here")
    assert {a["path"]: a["verdict"] for a in result["artifacts"]} == {"model.ts": "passed", "model.onnx": "passed"}
    # the CPU stage's work: the ONNX model the engine would be built from, preflighted; the rest verified
    assert {a["path"] for a in manifest["artifacts"]} == {"model.ts", "model.onnx"}
    assert {v["format"]: v["passed"] for v in manifest["verification"]} == {"torchscript": True, "onnx": True}
    preflight = manifest["tensorrt"]["preflight"]
    assert preflight["ok"] and preflight["errors"] == [] and preflight["op_counts"]
    # ...and then the failure: why, and where it can be built
    assert manifest["status"] == "failed"
    assert (manifest["error"]["stage"], manifest["error"]["code"]) == ("tensorrt", "unavailable_here")
    error = proc.stderr[proc.stderr.index("fxport convert: error during tensorrt:"):]
    assert "cannot be built on this machine" in error and _no_engine_here() in error
    assert "passed the TensorRT preflight" in error and "GPU worker" in error and "fxport submit" in error
    assert "cannot be built on this machine" in (out / "report.html").read_text()  # redrawn with the failure


def _onnx_with_ops_tensorrt_rejects(path: Path) -> tuple[Path, list[tuple[str, str]]]:
    """A valid ONNX model of 7 nodes TensorRT's parser does not support (bitwise ops on int32)."""
    import onnx
    from onnx import TensorProto, helper

    nodes, named, prev = [], [], "x"
    for i in range(7):
        op, name = ("BitwiseNot", f"flip_{i}") if i % 2 == 0 else ("BitwiseAnd", f"mask_{i}")
        inputs = [prev] if op == "BitwiseNot" else [prev, "m"]
        nodes.append(helper.make_node(op, inputs, [f"t{i}"], name=name))
        named.append((name, op))
        prev = f"t{i}"
    graph = helper.make_graph(nodes, "bits", [helper.make_tensor_value_info("x", TensorProto.INT32, [2, 8])],
                              [helper.make_tensor_value_info(prev, TensorProto.INT32, [2, 8])],
                              initializer=[helper.make_tensor("m", TensorProto.INT32, [], [6])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(path))
    return path, named


@needs_no_tensorrt
def test_convert_tensorrt_lists_every_op_the_preflight_rejects_before_saying_it_cannot_build(tmp_path: Path) -> None:
    model, named = _onnx_with_ops_tensorrt_rejects(tmp_path / "bits.onnx")
    proc = fxport("convert", str(model), "-t", "tensorrt", "--out", str(tmp_path / "o"), cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr  # a conversion failure, as `submit --wait` of this model would be
    error = proc.stderr[proc.stderr.index("fxport convert: error during tensorrt:"):]
    cannot = error.index("cannot be built on this machine")
    for name, op in named:  # every one, not the first five
        assert -1 < error.find(f"node {name!r} (op {op})") < cannot, error
    assert _no_engine_here() in error[cannot:]
    manifest = json.loads((tmp_path / "o" / "manifest.json").read_text())
    assert sorted((e["node"], e["op_type"]) for e in manifest["tensorrt"]["preflight"]["errors"]) == sorted(named)
    assert manifest["status"] == "failed" and manifest["error"]["stage"] == "tensorrt"
    assert all(f"node {name!r}" in manifest["error"]["message"] for name, _ in named)
