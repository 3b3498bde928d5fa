"""`fxport convert` as a user runs it: the real console script, exit codes, --json on stdout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.client.packaged import TRACEABLE, package_model
from tests.models import get
from tests.workers.engine.conftest import save_pt2

FXPORT = [sys.executable, "-m", "fxport.cli"]


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run([*FXPORT, *args], cwd=cwd, capture_output=True, text=True, timeout=300, env=env)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_pt2(get("cnn_bn"), tmp_path_factory.mktemp("cli") / "cnn.pt2")


def test_convert_json_prints_only_the_result_document(model: Path, tmp_path: Path) -> None:
    proc = run_cli("convert", str(model), "--target", "onnx", "--target", "torchscript", "--output", "logits",
                   "--out", str(tmp_path / "out"), "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)  # stdout is exactly one JSON document: the result
    assert {a["format"]: a["verdict"] for a in result["artifacts"] if a["checks"]} == {"onnx": "passed",
                                                                                      "torchscript": "passed"}
    manifest = json.loads(Path(result["manifest"]).read_text())
    assert {a["format"] for a in manifest["artifacts"]} == {"onnx", "torchscript"}
    assert [o["name"] for o in manifest["outputs"]] == ["logits"]  # --output names the ONNX output
    assert all(v["passed"] for v in manifest["verification"])
    assert (tmp_path / "out" / "model.onnx").is_file()


def test_convert_prints_the_result_table(model: Path, tmp_path: Path) -> None:
    proc = run_cli("convert", str(model), "-t", "onnx", "--out", str(tmp_path / "o"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "onnxruntime" in proc.stdout or "onnx" in proc.stdout
    assert "pass" in proc.stdout and "model.onnx" in proc.stdout


@pytest.fixture(scope="module")
def traceable_package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A torch.package of a model every capture method follows (a .pt2 is captured already)."""
    return package_model(TRACEABLE, "traceable_model", tmp_path_factory.mktemp("traceable"))


@pytest.mark.parametrize("capture, level", [("fx", "torch"), ("export", "aten")])
def test_capture_flag_chooses_the_capture_method(traceable_package: Path, capture: str, level: str,
                                                  tmp_path: Path) -> None:
    proc = run_cli("convert", str(traceable_package), "--input", "x:2,3,8,8", "-t", "torchscript",
                   "--capture", capture, "--out", str(tmp_path / "o"), "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((tmp_path / "o" / "manifest.json").read_text())
    assert json.loads(proc.stdout)["state"] == "SUCCEEDED"
    assert manifest["spec"]["capture"] == capture
    assert (manifest["capture"]["method"], manifest["capture"]["level"]) == (capture, level)
    assert [a["method"] for a in manifest["capture"]["attempts"]] == [capture]  # that rung only
    assert all(v["passed"] for v in manifest["verification"])


def test_truncated_archive_exits_2(model: Path, tmp_path: Path) -> None:
    cut = tmp_path / "cut.pt2"
    data = model.read_bytes()
    cut.write_bytes(data[: len(data) // 3])
    proc = run_cli("convert", str(cut), "--out", str(tmp_path / "o"), cwd=tmp_path)
    assert proc.returncode == 2
    assert "truncated or corrupt" in proc.stderr


def test_random_bytes_exit_2_listing_formats(tmp_path: Path) -> None:
    junk = tmp_path / "junk.bin"
    junk.write_bytes(os.urandom(4096))
    proc = run_cli("convert", str(junk), "--out", str(tmp_path / "o"), cwd=tmp_path)
    assert proc.returncode == 2
    assert "torch.export" in proc.stderr and "ONNX" in proc.stderr


def test_unknown_pass_exits_2_naming_the_valid_ones(model: Path, tmp_path: Path) -> None:
    proc = run_cli("convert", str(model), "--pass", "fuse_everything", "--out", str(tmp_path / "o"), cwd=tmp_path)
    assert proc.returncode == 2
    assert "passes[0]" in proc.stderr and "fuse_everything" in proc.stderr and "fuse_conv_bn" in proc.stderr
    assert not (tmp_path / "o").exists()  # rejected before any work


def test_shape_that_contradicts_the_model_exits_2(model: Path, tmp_path: Path) -> None:
    proc = run_cli("convert", str(model), "--input", "x:batch,5,32,32", "--dynamic-batch", "1:2:4",
                   "--out", str(tmp_path / "o"), cwd=tmp_path)
    assert proc.returncode == 2
    assert "inputs[0].shape[1]" in proc.stderr and "expects 3" in proc.stderr


def test_spec_file_typo_exits_2_with_field_path(model: Path, tmp_path: Path) -> None:
    spec = tmp_path / "deploy.yaml"
    spec.write_text("targets: [onnx]\nverify:\n  atoll: 0.1\n")
    proc = run_cli("convert", str(model), "--spec", str(spec), "--out", str(tmp_path / "o"), cwd=tmp_path)
    assert proc.returncode == 2
    assert "verify.atoll" in proc.stderr and "atol" in proc.stderr


def test_verification_mismatch_exits_1(model: Path, tmp_path: Path) -> None:
    # a tolerance no float computation meets: ONNX Runtime differs from eager in the last bits
    spec = tmp_path / "strict.yaml"
    spec.write_text("targets: [onnx]\nverify: {atol: 0.0, rtol: 0.0, min_cosine: 1.0}\n")
    proc = run_cli("convert", str(model), "--spec", str(spec), "--out", str(tmp_path / "o"), cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr
    assert "do not match" in proc.stderr
    manifest = json.loads((tmp_path / "o" / "manifest.json").read_text())
    assert manifest["status"] == "failed" and manifest["error"]["stage"] == "verify"


PROBE_MODEL = """
import builtins, os, torch
if __name__ != "probe_model":  # loaded from the archive (torch.package renames it), not packed by the test
    seen = [f"sandbox={{os.environ.get('FXPORT_SANDBOX')}}", f"secret={{os.environ.get('FXPORT_PROBE_SECRET')}}"]
    try:
        with open({marker!r}) as f:
            seen.append("read " + f.read())
    except OSError as exc:
        seen.append(f"refused: {{exc.strerror}}")
    try:
        name = "socket"  # by name: torch.package would bundle an `import socket`
        builtins.__import__(name).socket()
        seen.append("socket made")
    except OSError as exc:
        seen.append(f"no socket: {{exc.strerror}}")
    raise RuntimeError("PROBE " + " | ".join(seen))
class Model(torch.nn.Module):
    def forward(self, x):
        return x
"""


def probe_package(tmp_path: Path, marker: Path) -> Path:
    """A torch.package that, when loaded, reports where it runs and what it can reach, then fails."""
    import importlib

    from torch.package import PackageExporter

    src = tmp_path / "src"
    src.mkdir()
    (src / "probe_model.py").write_text(PROBE_MODEL.format(marker=str(marker)))
    sys.path.insert(0, str(src))
    try:
        module = importlib.import_module("probe_model")
        path = tmp_path / "probe.pkg"
        with PackageExporter(str(path)) as exporter:
            exporter.extern("torch.**")
            exporter.intern("probe_model")
            exporter.save_pickle("model", "model.pkl", module.Model())
        return path
    finally:
        sys.path.remove(str(src))
        sys.modules.pop("probe_model", None)


def test_convert_runs_a_downloaded_model_in_the_sandbox(tmp_path: Path) -> None:
    """A .pt2 or torch.package runs its code when loaded: `fxport convert` loads it in the
    same sandbox as a worker, not in the user's process with the user's rights."""
    marker = tmp_path / "private-notes.txt"
    marker.write_text("the user's own file")
    model = probe_package(tmp_path, marker)
    env_proc = subprocess.run([*FXPORT, "convert", str(model), "--input", "x:2,4", "-t", "onnx",
                               "--out", str(tmp_path / "o")], cwd=tmp_path, capture_output=True, text=True,
                              timeout=300, env={**os.environ, "FXPORT_PROBE_SECRET": "s3cr3t", "COLUMNS": "200"})
    assert env_proc.returncode != 0
    text = env_proc.stderr
    assert "PROBE sandbox=1" in text, text
    assert "secret=None" in text and "refused: Permission denied" in text and "no socket:" in text, text
    assert "the user's own file" not in text and "s3cr3t" not in text


def test_convert_no_sandbox_says_so_and_runs_in_process(tmp_path: Path) -> None:
    marker = tmp_path / "private-notes.txt"
    marker.write_text("the user's own file")
    model = probe_package(tmp_path, marker)
    proc = run_cli("convert", str(model), "--input", "x:2,4", "-t", "onnx", "--out", str(tmp_path / "o"),
                   "--no-sandbox", cwd=tmp_path)
    assert proc.returncode != 0
    assert "--no-sandbox: the model is loaded and run in this process" in proc.stderr
    assert "PROBE sandbox=None" in proc.stderr and "read the user's own file" in proc.stderr, proc.stderr


def test_convert_no_sandbox_ends_when_done_though_the_model_left_a_thread(tmp_path: Path) -> None:
    """A trusted model whose code leaves a non-daemon thread running: the command still ends once
    its result is printed, with its exit code (Python's own exit would wait for the thread)."""
    lingering = TRACEABLE + textwrap.dedent('''
        import os, threading, time
        if os.environ.get("LINGER_FOR_TEST"):  # not while the test packages it
            threading.Thread(target=time.sleep, args=(3600,), daemon=False).start()
    ''')
    model = package_model(lingering, "lingering_model", tmp_path / "src")
    proc = subprocess.run([*FXPORT, "convert", str(model), "--input", "x:2,3,8,8", "-t", "onnx", "--out",
                           str(tmp_path / "o"), "--no-sandbox", "--json"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "LINGER_FOR_TEST": "1"})
    assert proc.returncode == 0, proc.stderr
    assert all(a["verdict"] == "passed" for a in json.loads(proc.stdout)["artifacts"] if a["checks"])


def test_convert_benchmark_recommends_the_fastest_verified_artifact(tmp_path: Path) -> None:
    """`convert --benchmark` on the ResNet-18-style corpus model with three targets: every
    artifact and the eager original timed at each batch, the table after the parity table, and
    a recommendation that is the fastest verified artifact at its batch."""
    model = save_pt2(get("resnet18"), tmp_path / "resnet18.pt2")
    spec = tmp_path / "bench.yaml"
    spec.write_text("benchmark: {runs: 5, warmup: 1}\nverify: {samples: 1}\n")  # options; --benchmark turns it on
    proc = run_cli("convert", str(model), "--spec", str(spec), "--benchmark", "--input", "x:batch,3,224,224",
                   "--dynamic-batch", "1:2:4", "-t", "torchscript", "-t", "onnx", "-t", "exported_program",
                   "--out", str(tmp_path / "o"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((tmp_path / "o" / "manifest.json").read_text())
    bench = manifest["benchmark"]
    assert bench["settings"]["batches"] == [1, 2, 4] and bench["settings"]["runs"] == 5
    measured = {(r["artifact"], r["batch"]) for r in bench["results"]}
    assert measured == {(a, b) for a in ("eager", "torchscript", "onnx", "exported_program") for b in (1, 2, 4)}
    verified = {v["format"] for v in manifest["verification"] if v["passed"]}
    pick = bench["recommendation"]
    at_its_batch = [r for r in bench["results"] if r["batch"] == pick["batch"] and r["artifact"] in verified]
    assert pick["artifact"] == min(at_its_batch, key=lambda r: r["p50_ms"])["artifact"]
    assert "benchmark" in manifest["timings_s"]
    out = proc.stdout
    assert out.index("parity") < out.index("benchmark (") < out.index(f"recommended: {pick['artifact']}")
    report = (tmp_path / "o" / "report.html").read_text()
    assert 'id="recommendation"' in report and f"Recommended: {pick['artifact']}" in report
