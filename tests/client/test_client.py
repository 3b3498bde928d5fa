"""Client behaviour a pipeline relies on: resume after a server restart, sha256 checks."""

from __future__ import annotations

import pytest

from fxport.client import Client, FxportError, IntegrityError
from fxport.client.downloads import safe_relative
from tests.fixtures.servers import free_port, start_api


@pytest.mark.slow
def test_wait_resumes_across_a_server_restart_and_the_job_is_rerun(tmp_path):
    """Embedded server stopped mid-job: the job stays RUNNING in its SQLite store, the next
    start re-runs it, and Job.wait reconnects and resumes from the last event it saw. The model
    is a small ResNet, so that its ONNX export and verification outlast the stop by far (a tiny
    model's job could end in the moment between the client seeing `export` and the stop)."""
    from tests.models import get
    from tests.workers.engine.conftest import save_pt2

    model = save_pt2(get("resnet18_small"), tmp_path / "resnet18_small.pt2")
    env = {"FXPORT_HOME": str(tmp_path / "home"), "FXPORT_LISTEN": f"127.0.0.1:{free_port()}",
           "FXPORT_SANDBOX_THREADS": "1"}
    server = start_api(tmp_path, env, name="restart")
    try:
        with Client(server.address, reconnect_s=60) as client:
            job = client.submit(model, {"targets": ["onnx"]})
            seen = []
            events = job.events(timeout=120)
            for ev in events:
                seen.append(ev)
                if ev.state == "RUNNING" and ev.stage in ("capture", "passes", "export"):
                    break
            server.stop()  # SIGTERM: graceful stop, the job is interrupted
            server = start_api(tmp_path, env, name="restart")
            for ev in events:  # the same generator: it reconnects and resumes
                seen.append(ev)
            assert job.state == "SUCCEEDED", job.error
            seqs = [e.seq for e in seen]
            assert seqs == sorted(set(seqs)), "events repeated or out of order after the reconnect"
            assert job.to_dict()["attempts"] == 2
    finally:
        server.stop()


@pytest.mark.slow
def test_download_refuses_a_tampered_artifact(embedded_server, tiny_pt2, tmp_path):
    with Client(embedded_server.address) as client:
        job = client.submit(tiny_pt2, {"targets": ["fx_source"]}).wait(timeout=120)
        assert job.succeeded, job.error
        art = job.artifacts[0]
        obj = embedded_server.home / "store" / "objects" / art["key"]
        obj.write_bytes(obj.read_bytes()[:-1] + b"!")
        with pytest.raises(FxportError, match="sha256|DATA_LOSS"):
            job.download(tmp_path / "out", names=[art["name"]])
        assert not (tmp_path / "out" / art["name"]).exists()
        assert not list((tmp_path / "out").rglob("*.part"))


@pytest.mark.parametrize("name", ["../x", "/etc/passwd", "a/../../b", "", "a//b", "a\\b"])
def test_unsafe_artifact_names_from_a_server_are_refused(name):
    with pytest.raises(IntegrityError):
        safe_relative(name)


def test_submit_missing_file_is_invalid_input(tmp_path):
    from fxport.errors import InvalidInput

    with Client(f"127.0.0.1:{free_port()}") as client, pytest.raises(InvalidInput, match="not found"):
        client.submit(tmp_path / "nope.pt2")


def test_a_client_with_no_address_reads_the_environment_as_the_cli_does(monkeypatch):
    monkeypatch.setenv("FXPORT_SERVER", "fxport.example:443")
    monkeypatch.setenv("FXPORT_TOKEN", "t0ken")
    with Client() as c:
        assert c.target == "fxport.example:443" and c._metadata == (("authorization", "Bearer t0ken"),)
    with Client("127.0.0.1:1", token="") as c:  # what is passed wins, an empty token included
        assert c.target == "127.0.0.1:1" and c._metadata == ()
    monkeypatch.delenv("FXPORT_SERVER")
    monkeypatch.delenv("FXPORT_TOKEN")
    with Client() as c:
        assert c.target == "127.0.0.1:50051" and c._metadata == ()
