"""Embedded mode end to end: `fxport serve` with no mode flags, driven by the `fxport` CLI."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest

from fxport.storage import artifact_key

pytestmark = pytest.mark.slow


def fxport(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fxport.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_cli_submit_wait_out_json_on_embedded_server(embedded_server, tiny_pt2, tmp_path):
    out = tmp_path / "artifacts"
    res = fxport("submit", str(tiny_pt2), "--target", "onnx", "--target", "fx_source", "--label", "suite=embedded",
                 "--server", embedded_server.address, "--wait", "--out", str(out), "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)  # exactly one JSON document on stdout: the result (fxport schema result)
    assert doc["state"] == "SUCCEEDED" and doc["labels"] == {"suite": "embedded"}
    by_name = {a["path"]: a for a in doc["artifacts"]}
    assert "model.onnx" in by_name and "manifest.json" in by_name and "report.html" in by_name
    assert any(n.startswith("fx_source/") for n in by_name)
    for name, art in by_name.items():
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == art["sha256"]
    assert sorted(doc["downloaded"]) == sorted(str(out / n) for n in by_name)
    # Artifacts fetched while the job ran (relayed: a file store has no presigned URLs) left no trace.
    assert sorted(p.name for p in out.iterdir()) == sorted({n.split("/")[0] for n in by_name})

    # Embedded state lives under FXPORT_HOME: SQLite job store + filesystem artifact store.
    home = embedded_server.home
    assert (home / "jobs.db").is_file()
    onnx_key = artifact_key("default", doc["job_id"], "model.onnx")
    assert (home / "store" / "objects" / onnx_key).read_bytes() == (out / "model.onnx").read_bytes()

    listed = json.loads(fxport("jobs", "list", "--label", "suite=embedded", "--server", embedded_server.address,
                               "--json").stdout)
    assert [j["job_id"] for j in listed["jobs"]] == [doc["job_id"]]  # the result document, job by job
    assert listed["jobs"][0]["created_at"].endswith("Z")
    again = tmp_path / "again"
    res = fxport("jobs", "download", doc["job_id"], "--out", str(again), "--name", "model.onnx",
                 "--server", embedded_server.address)
    assert res.returncode == 0, res.stderr
    assert (again / "model.onnx").read_bytes() == (out / "model.onnx").read_bytes()
    # Without --json a person gets the result table and the report's path.
    human = fxport("submit", str(tiny_pt2), "--target", "onnx", "--server", embedded_server.address,
                   "--wait", "--out", str(tmp_path / "human"))
    assert human.returncode == 0, human.stderr
    assert f"report: {tmp_path / 'human' / 'report.html'}" in human.stdout.replace("\n", "")
    assert "parity" in human.stdout and "pass" in human.stdout
    # The filesystem store cannot presign: FAILED_PRECONDITION, exit 2 through the client.
    from fxport.client import Client, RequestRefused

    with Client(embedded_server.address) as c, pytest.raises(RequestRefused, match="presigned"):
        c.artifact_url(doc["job_id"], "model.onnx")


def test_a_failed_job_is_one_error_line_on_stderr_and_its_table_on_stdout(embedded_server, tiny_pt2, tmp_path):
    """`submit --wait` printed a job's failure on stdout without the command's prefix; it is now the
    error line every command prints, on stderr, and stdout keeps the job line for the person."""
    junk = tmp_path / "junk.pt2"
    junk.write_bytes(b"not a model at all")
    res = fxport("submit", str(junk), "--target", "onnx", "--server", embedded_server.address, "--wait")
    assert res.returncode == 2, res.stderr
    (line,) = [x for x in res.stderr.splitlines() if "error" in x]
    assert line.startswith("fxport submit: error during load: job ") and " FAILED: " in line
    assert "error" not in res.stdout and "FAILED" in res.stdout


def test_cli_exit_codes(embedded_server, tiny_pt2, tmp_path):
    from fxport.jobs import new_job_id
    from tests.fixtures.servers import free_port

    # 2: invalid spec, refused locally before any upload, field path named.
    res = fxport("submit", str(tiny_pt2), "--target", "tflite", "--server", embedded_server.address, "--json")
    assert res.returncode == 2
    err = json.loads(res.stdout)["error"]
    assert err["violations"][0]["field"].startswith("targets")
    # 2: a job that does not exist.
    assert fxport("jobs", "get", new_job_id(), "--server", embedded_server.address).returncode == 2
    # 4: nothing listens there.
    res = fxport("jobs", "list", "--server", f"127.0.0.1:{free_port()}", "--json")
    assert res.returncode == 4 and "unreachable" in json.loads(res.stdout)["error"]["message"]
    # 3: gave up waiting (the job keeps running on the server). A model that sleeps in its sandbox:
    # a tiny job finishes within a short wait now (its ONNX export no longer builds the op registry).
    from tests.workers.test_sandbox import hostile_package

    slow = hostile_package(tmp_path, "sleeps_in_sandbox", "import time; time.sleep(120)")
    res = fxport("submit", str(slow), "--target", "onnx", "--server", embedded_server.address,
                 "--wait", "--timeout", "1", "--json")
    assert res.returncode == 3, res.stderr
    still_running = json.loads(res.stdout)  # the result document names the job and its real state
    assert still_running["timed_out"] and still_running["state"] == "RUNNING" and still_running["exit_code"] == 3
    assert f"job {still_running['job_id']} did not finish in time; it is still RUNNING" in res.stderr
    assert fxport("jobs", "cancel", still_running["job_id"], "--server", embedded_server.address).returncode == 0
    # 2: the job failed on invalid input (a model file that is not a model), as convert exits.
    junk = tmp_path / "junk.pt2"
    junk.write_bytes(b"not a model at all")
    res = fxport("submit", str(junk), "--target", "onnx", "--server", embedded_server.address, "--wait", "--json")
    assert res.returncode == 2, res.stderr
    doc = json.loads(res.stdout)
    assert doc["state"] == "FAILED" and doc["error"]["stage"] == "load" and doc["error"]["message"]


def test_cancel_running_job_stops_its_sandbox(embedded_server, resnet18_pt2):
    from fxport.client import Client
    from tests.fixtures.servers import sandbox_pids, scaled, wait_until

    with Client(embedded_server.address) as client:
        job = client.submit(resnet18_pt2, {"targets": ["torchscript", "onnx", "exported_program", "fx_source"]})
        for ev in job.events(timeout=120):
            if ev.state == "RUNNING" and ev.stage in ("capture", "passes", "export"):
                break
        assert sandbox_pids(embedded_server.process.pid, job.id), "no sandbox running the job"
        log = embedded_server.process.log
        log_offset = log.stat().st_size
        assert job.cancel().state == "CANCELLED"
        wait_until(lambda: not sandbox_pids(embedded_server.process.pid, job.id), scaled(10),
                   "the cancelled job's sandbox to be stopped", every=0.2)

        # The interrupted run's last word, once it has removed what it uploaded: no late upload
        # or SUCCEEDED can follow it.
        def run_ended() -> bool:
            with log.open("rb") as f:
                f.seek(log_offset)
                return any(job.id in line and "job cancelled" in line
                           for line in f.read().decode("utf-8", "replace").splitlines())

        wait_until(run_ended, scaled(30), "the interrupted run to log its end")
        assert client.get(job.id).state == "CANCELLED"
        assert not (embedded_server.home / "store" / "objects" / "default" / "jobs" / job.id).exists()
