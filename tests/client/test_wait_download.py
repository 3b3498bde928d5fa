"""`job.wait(download_to=DIR)` and `fxport submit --out DIR` on a job that fails: the job's
manifest.json and report.html (where its error message sends the reader) land in DIR, and
the failure is still reported as such. Through the real distributed stack (tests/conftest.py)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest

from fxport.client import Client

pytestmark = pytest.mark.slow

KEPT = ["manifest.json", "report.html"]


def test_wait_download_to_keeps_the_manifest_and_report_of_a_job_that_fails_verification(
        distributed_stack, tiny_pt2, tmp_path):
    out = tmp_path / "out"
    # fp16 differs from the fp32 original by ~1e-4: an atol of 1e-9 cannot be met.
    spec = {"targets": ["onnx"], "precision": "fp16", "verify": {"atol": 1e-9, "rtol": 0, "scale_atol": 0},
            "labels": {"suite": "wait-download-failed"}}
    with Client(distributed_stack.address) as c:
        job = c.submit(tiny_pt2, spec)
        events = []
        returned = job.wait(timeout=240, on_event=events.append, download_to=out)

    # The failure is what it was without download_to: FAILED at verify, the message unchanged.
    assert returned is job and job.state == "FAILED", (job.state, job.error, distributed_stack.logs())
    assert job.error["stage"] == "verify" and "manifest.json" in job.error["message"], job.error
    assert events[-1].state == "FAILED"
    # The staged model.onnx is not kept; what the failed job lists is, each sha256-checked.
    assert sorted(a["name"] for a in job.artifacts) == KEPT
    assert sorted(p.name for p in out.iterdir()) == KEPT  # no hidden .partial folder left either
    assert sorted(job.downloaded) == [out / name for name in KEPT]
    for a in job.artifacts:
        assert hashlib.sha256((out / a["name"]).read_bytes()).hexdigest() == a["sha256"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["error"]["stage"] == "verify"
    assert [v["passed"] for v in manifest["verification"]] == [False]
    assert "<html" in (out / "report.html").read_text()[:2000].lower()


def test_submit_out_of_a_model_that_fails_to_load_exits_2_with_its_manifest_and_report(
        distributed_stack, tmp_path):
    """The CLI takes the same path (Job.wait's download): exit 2 (invalid input), the error, and both files."""
    junk = tmp_path / "junk.pt2"
    junk.write_bytes(b"not a model at all")
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "fxport.cli", "submit", str(junk), "--target", "onnx",
         "--server", distributed_stack.address, "--out", str(out), "--timeout", "240", "--json"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "120"})
    assert proc.returncode == 2, (proc.stdout, proc.stderr, distributed_stack.logs())
    doc = json.loads(proc.stdout)
    assert doc["state"] == "FAILED" and doc["error"]["stage"] == "load" and doc["error"]["message"]
    assert sorted(doc["downloaded"]) == [str(out / name) for name in KEPT]
    assert sorted(p.name for p in out.iterdir()) == KEPT
    assert json.loads((out / "manifest.json").read_text())["error"]["stage"] == "load"
