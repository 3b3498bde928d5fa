"""A job's spec is checked at its two trust boundaries only: the API, and the sandbox child.

In between it travels typed: CheckUpload and the SubmitJob after it share one check of the same
text, the job store decodes the record's spec without checking it again (fxport.spec.TRUSTED), and
the worker hands the typed spec to the sandbox. `fxport.spec.RuleChecks` counts the checks a process
makes; here the API and the embedded worker share this process, and the child is a fork of its own.
"""

from __future__ import annotations

import pytest

from fxport.cli.server import create_server
from fxport.client import Client
from fxport.config import Settings
from fxport.jobs import JobRecord, new_job_id
from fxport.spec import RuleChecks, parse_spec

pytestmark = pytest.mark.slow


def test_one_check_in_the_api_and_worker_process_for_a_whole_job(tmp_path, tiny_pt2):
    srv, port = create_server(Settings(home=tmp_path / "home", listen="127.0.0.1:0", log_format="text"))
    srv.start()
    try:
        with Client(f"127.0.0.1:{port}") as client:
            before = RuleChecks.count
            job = client.submit(tiny_pt2, {"targets": ["onnx"], "labels": {"suite": "spec-checks"}})
            done = job.wait(timeout=300)
            checks = RuleChecks.count - before
    finally:
        srv.stop(grace=0)
    assert done.state == "SUCCEEDED", done.error
    # CheckUpload and SubmitJob: one check of the text they both carry. The worker: none.
    assert checks == 1


def test_the_sandbox_child_checks_its_request_once(tmp_path):
    from fxport.workers.engine.request import EngineRequest
    from fxport.workers.sandbox.request import SandboxRequest

    spec = parse_spec({"targets": ["onnx"]})
    fields = SandboxRequest.model_fields
    assert "engine" in fields or any("EngineRequest" in str(f.annotation) for f in fields.values())
    engine = EngineRequest(model_path=tmp_path / "m.pt2", spec=spec, out_dir=tmp_path / "out")
    before = RuleChecks.count
    EngineRequest.model_validate_json(engine.model_dump_json())  # what the child does with the worker's request
    assert RuleChecks.count - before == 1


def test_a_record_read_back_from_the_store_is_not_checked_again():
    spec = parse_spec({"targets": ["onnx"], "precision": "fp16"})
    rec = JobRecord(id=new_job_id(), tenant="default", spec=spec, spec_digest=spec.digest(),
                    model={"sha256": "0" * 64, "bytes": 1, "key": "default/inputs/" + "0" * 64})
    raw = rec.model_dump_json()
    before = RuleChecks.count
    back = JobRecord.from_json(raw)
    assert RuleChecks.count == before
    assert back.spec == spec and back.spec.digest() == spec.digest()
    # Stored as the normalized spec, the form every digest is computed from.
    import json
    assert json.loads(raw)["spec"] == spec.normalized()
