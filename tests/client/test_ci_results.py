"""fxport in a CI pipeline (issue 42, items 1 and 2), through the real CLI and real servers.

- The example workflows in docs/ci/ run as written (only the server address is this test's):
  their JSON validates against `fxport schema result`, their JUnit file has one passing testcase
  per artifact check, and $GITHUB_STEP_SUMMARY gets the table.
- A timed-out `--wait` prints the job id and its real last state, and `--cancel-on-timeout`
  cancels the job, against an API whose queue no worker reads (jobs stay QUEUED).
- A mismatch is a JUnit failure naming the measured and the allowed numbers.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import jsonschema
import pytest
import yaml

from fxport.ci_report import junit_xml
from fxport.results import ArtifactResult, Check, JobResult, result_schema
from tests.fixtures.servers import scaled

REPO = Path(__file__).resolve().parents[2]
FXPORT = [sys.executable, "-m", "fxport.cli"]
SPEC = {"targets": ["onnx", "torchscript"], "verify": {"samples": 2}, "labels": {"team": "ci"}}
REDIS_DB = 8  # no other test uses it: no worker reads its queue


def _workflow_commands(path: Path) -> list[str]:
    """The fxport commands of a workflow file, as its shell would run them."""
    doc = yaml.safe_load(path.read_text())
    if "jobs" in doc:  # GitHub Actions
        lines = [step["run"] for job in doc["jobs"].values() for step in job["steps"] if "run" in step]
    else:  # GitLab CI
        lines = [line for job in doc.values() if isinstance(job, dict) for line in job.get("script", [])]
    return [line for line in lines if line.lstrip().startswith("fxport ")]


def _env(tmp_path: Path, server: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FXPORT_", "GITHUB_"))}
    env.update(FXPORT_SERVER=server, GITHUB_STEP_SUMMARY=str(tmp_path / "summary.md"),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}")
    return env


@pytest.mark.parametrize("workflow", ["github-actions.yml", "gitlab-ci.yml"])
def test_the_example_workflows_run_as_written(workflow, embedded_server, tiny_pt2, tmp_path):
    commands = _workflow_commands(REPO / "docs" / "ci" / workflow)
    assert len(commands) == 1 and "--junit junit.xml" in commands[0]
    (tmp_path / "models").mkdir()
    shutil.copyfile(tiny_pt2, tmp_path / "models" / "model.pt2")
    (tmp_path / "fxport.yaml").write_text(yaml.safe_dump(SPEC))
    env = _env(tmp_path, embedded_server.address)
    proc = subprocess.run(["bash", "-c", commands[0]], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=scaled(600))
    assert proc.returncode == 0, proc.stderr[-3000:]

    result = json.loads((tmp_path / "result.json").read_text())
    jsonschema.validate(result, result_schema())
    assert result["state"] == "SUCCEEDED" and result["exit_code"] == 0 and result["job_id"]
    assert result["created_at"].endswith("Z") and result["labels"] == {"team": "ci"}
    checked = [a for a in result["artifacts"] if a["checks"]]
    assert {a["path"] for a in checked} == {"model.onnx", "model.ts"}
    assert all(a["verdict"] == "passed" for a in checked)
    assert all((tmp_path / p).is_file() for p in result["downloaded"])

    suite = ET.parse(tmp_path / "junit.xml").getroot().find("testsuite")
    cases = suite.findall("testcase")
    assert len(cases) == sum(len(a["checks"]) for a in checked) == 2
    assert suite.get("failures") == "0" and suite.get("errors") == "0"
    assert {c.get("name") for c in cases} == {"model.onnx [onnxruntime]", "model.ts [torch.jit]"}
    summary = (tmp_path / "summary.md").read_text()
    assert f"job `{result['job_id']}` SUCCEEDED" in summary and "| `model.onnx` | onnxruntime | passed |" in summary

    # Following the same job later gives the same result, and the same JUnit report.
    watched = subprocess.run([*FXPORT, "jobs", "watch", result["job_id"], "--json", "--junit", "watch.xml"],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=scaled(120))
    assert watched.returncode == 0, watched.stderr[-2000:]
    again = json.loads(watched.stdout)
    jsonschema.validate(again, result_schema())
    assert again["command"] == "jobs watch" and again["artifacts"] == result["artifacts"]
    assert len(ET.parse(tmp_path / "watch.xml").getroot().find("testsuite").findall("testcase")) == 2


@pytest.fixture()
def queue_without_worker(redis_server, tmp_path):
    """An API whose jobs stay QUEUED: no worker reads its queue."""
    from fxport.config import Settings
    from fxport.jobs import RedisJobStore
    from fxport.service.server import create_server

    url = redis_server.url.rsplit("/", 1)[0] + f"/{REDIS_DB}"
    RedisJobStore(url).r.flushdb()
    srv, port = create_server(Settings(home=tmp_path / "home", listen="127.0.0.1:0", broker_url=url,
                                       store=f"file://{tmp_path / 'store'}", retention_sweep_interval_s=0,
                                       log_format="text"))
    srv.start()
    yield f"127.0.0.1:{port}"
    srv.stop(grace=0)


def test_a_timed_out_wait_names_the_job_and_its_state_and_can_cancel_it(queue_without_worker, tiny_pt2, tmp_path):
    from fxport.client import Client

    env = _env(tmp_path, queue_without_worker)
    argv = [*FXPORT, "submit", str(tiny_pt2), "--target", "onnx", "--wait", "--timeout", "1", "--json"]
    left = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=scaled(120))
    assert left.returncode == 3, left.stderr[-2000:]
    doc = json.loads(left.stdout)
    jsonschema.validate(doc, result_schema())
    assert doc["timed_out"] and not doc["cancelled"] and doc["state"] == "QUEUED" and doc["exit_code"] == 3
    assert f"job {doc['job_id']}" in left.stderr and "QUEUED" in left.stderr
    with Client(queue_without_worker) as client:
        assert client.get(doc["job_id"]).state == "QUEUED"  # still there: nobody cancelled it

    cancelled = subprocess.run([*argv, "--cancel-on-timeout", "--junit", "junit.xml"], cwd=tmp_path, env=env,
                               capture_output=True, text=True, timeout=scaled(120))
    assert cancelled.returncode == 3, cancelled.stderr[-2000:]
    doc = json.loads(cancelled.stdout)
    assert doc["timed_out"] and doc["cancelled"] and doc["state"] == "CANCELLED"
    with Client(queue_without_worker) as client:
        assert client.get(doc["job_id"]).state == "CANCELLED"
        client.cancel(json.loads(left.stdout)["job_id"])
    job_case = ET.parse(tmp_path / "junit.xml").getroot().find("testsuite").find("testcase")
    assert job_case.get("name") == "job" and "timed out" in job_case.find("error").get("message")


def test_a_mismatch_is_a_junit_failure_with_the_numbers(tiny_pt2, tmp_path):
    spec = tmp_path / "strict.yaml"
    spec.write_text(yaml.safe_dump({"targets": ["onnx"], "precision": "fp16",
                                    "verify": {"atol": 1e-9, "rtol": 0.0, "scale_atol": 0.0, "samples": 2}}))
    proc = subprocess.run([*FXPORT, "convert", str(tiny_pt2), "--spec", str(spec), "--out", str(tmp_path / "out"),
                           "--json", "--junit", str(tmp_path / "junit.xml")], cwd=tmp_path, capture_output=True,
                          text=True, timeout=scaled(600))
    assert proc.returncode == 1, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    jsonschema.validate(doc, result_schema())
    assert doc["command"] == "convert" and doc["state"] == "FAILED" and doc["error"]["code"] == "verification_failed"
    assert doc["artifacts"] == [] and not (tmp_path / "out" / "model.onnx").exists()  # a failed job keeps none...
    onnx = next(a for a in doc["withdrawn"] if a["path"] == "model.onnx")  # ...and lists what it built
    assert onnx["verdict"] == "failed" and onnx["checks"][0]["allowed"]["atol"] == pytest.approx(1e-9)
    failure = ET.parse(tmp_path / "junit.xml").getroot().find("testsuite").find("testcase").find("failure")
    assert "max |diff|" in failure.get("message") and "atol 1e-09" in failure.get("message")


def test_fxport_schema_result_prints_the_schema_docs_ship():
    proc = subprocess.run([*FXPORT, "schema", "result"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == result_schema()
    assert json.loads((REPO / "docs" / "result.schema.json").read_text()) == result_schema(), (
        "docs/result.schema.json is stale: fxport schema result > docs/result.schema.json")


def test_an_inconclusive_check_is_skipped_with_its_reason():
    check = Check(runtime="onnxruntime", verdict="inconclusive", reason="output_0: constant across inputs")
    result = JobResult(command="convert", job_id="local-1", state="SUCCEEDED", exit_code=0, artifacts=[
        ArtifactResult(path="model.onnx", format="onnx", bytes=1, sha256="0" * 64, verdict="inconclusive",
                       checks=[check])])
    case = ET.fromstring(junit_xml(result)).find("testsuite").find("testcase")
    assert "constant across inputs" in case.find("skipped").get("message")
