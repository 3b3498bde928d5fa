"""End to end through the distributed stack: gRPC API → Redis/Celery workers → S3 → client."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest

from fxport.client import Client, IntegrityError, JobNotFound, RequestRefused
from fxport.storage import job_prefix
from tests.fixtures.servers import scaled, wait_until

pytestmark = pytest.mark.slow


@pytest.fixture()
def client(distributed_stack):
    with Client(distributed_stack.address) as c:
        yield c


def test_submit_watch_download_verify_onnx(distributed_stack, client, tiny_pt2, tmp_path):
    import onnxruntime as ort
    import torch

    from tests.models import CORPUS

    job = client.submit(tiny_pt2, {"targets": ["onnx", "torchscript"], "labels": {"suite": "e2e"}})
    assert job.state == "QUEUED"
    events = []
    job.wait(timeout=180, on_event=events.append)
    assert job.state == "SUCCEEDED", (job.error, distributed_stack.logs())

    # Events: strictly increasing seqs, RUNNING through the engine's stages, one terminal at the end.
    seqs = [e.seq for e in events]
    assert seqs == sorted(set(seqs)) and seqs[0] == 1
    assert {"load", "capture", "export", "verify", "upload"} <= {e.stage for e in events if e.state == "RUNNING"}
    assert events[-1].state == "SUCCEEDED" and not any(e.terminal for e in events[:-1])

    # Artifacts: deterministic keys, downloaded with every sha256 checked.
    names = {a["name"] for a in job.artifacts}
    assert {"model.onnx", "model.ts", "manifest.json"} <= names
    for a in job.artifacts:
        assert a["key"] == job_prefix("default", job.id) + a["name"]
    paths = job.download(tmp_path / "out")
    for a, p in zip(job.artifacts, paths):
        assert hashlib.sha256(p.read_bytes()).hexdigest() == a["sha256"]
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert all(v["passed"] for v in manifest["verification"])

    # The ONNX computes what the eager model computes.
    case = CORPUS["tiny_linear"]
    x = case.example_inputs(3)
    with torch.no_grad():
        expected = case.build()(*x).numpy()
    sess = ort.InferenceSession(str(tmp_path / "out" / "model.onnx"), providers=["CPUExecutionProvider"])
    feeds = {i.name: t.numpy() for i, t in zip(sess.get_inputs(), x)}
    got = sess.run(None, feeds)[0]
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=1e-3)

    # The record in Redis says the same, and a presigned S3 URL serves the same bytes.
    rec = distributed_stack.job_store().get(job.id)
    assert rec.state.value == "SUCCEEDED" and rec.worker and rec.attempts == 1
    assert {"load", "capture", "export", "verify", "upload"} <= set(rec.stage_timings)
    onnx = next(a for a in job.artifacts if a["name"] == "model.onnx")
    with urllib.request.urlopen(client.artifact_url(job.id, "model.onnx"), timeout=10) as resp:
        assert hashlib.sha256(resp.read()).hexdigest() == onnx["sha256"]

    # Resuming WatchJob past the end gives just the terminal event; listing finds the job.
    again = list(client.get(job.id).events(after_seq=seqs[-1], timeout=10))
    assert [e.state for e in again] == ["SUCCEEDED"]
    assert job.id in [j.id for j in client.list(labels={"suite": "e2e"})]


def test_same_model_twice_skips_upload_and_idempotency_key_returns_same_job(distributed_stack, client, tiny_pt2):
    first = client.submit(tiny_pt2, {"targets": ["fx_source"]}, idempotency_key="idem-e2e-1")
    again = client.submit(tiny_pt2, {"targets": ["fx_source"]}, idempotency_key="idem-e2e-1")
    assert again.id == first.id
    with pytest.raises(RequestRefused, match="different model or spec"):
        client.submit(tiny_pt2, {"targets": ["onnx"]}, idempotency_key="idem-e2e-1")
    first.wait(timeout=120)
    assert first.state == "SUCCEEDED", first.error


def test_cancel_running_job_removes_partial_artifacts(distributed_stack, client, resnet18_pt2, tiny_pt2):
    job = client.submit(resnet18_pt2, {"targets": ["torchscript", "onnx", "exported_program", "fx_source"]})
    for ev in job.events(timeout=120):
        if ev.state == "RUNNING" and ev.stage in ("capture", "passes", "export"):
            break
    cancelled = job.cancel()
    assert cancelled.state == "CANCELLED"
    assert cancelled.error["code"] == "cancelled"

    # The worker notices, stops the sandbox and cleans up; the job never becomes SUCCEEDED.
    store = distributed_stack.artifact_store()
    wait_until(lambda: store.list_prefix(job_prefix("default", job.id)) == [], scaled(30),
               "the cancelled job's partial artifacts to be deleted", every=0.5)
    assert client.get(job.id).state == "CANCELLED"

    # The worker is free again: a next job runs to the end.
    nxt = client.submit(tiny_pt2, {"targets": ["fx_source"]}).wait(timeout=120)
    assert nxt.state == "SUCCEEDED", (nxt.error, distributed_stack.logs())
    assert client.get(job.id).state == "CANCELLED"


def test_list_jobs_pages_through_label_filtered_records(distributed_stack, client):
    from fxport.jobs import InputRef, JobRecord, JobState, new_job_id

    jobs = distributed_stack.job_store()
    label = f"paging-{time.time_ns()}"
    made = []
    for i in range(7):
        rec = JobRecord(id=new_job_id(), tenant="default", labels={"suite": label},
                        model=InputRef(sha256="0" * 64, bytes=1, key="default/inputs/" + "0" * 64))
        jobs.create(rec)
        if i % 2:
            jobs.transition(rec.id, state=JobState.FAILED)
        made.append(rec.id)
        time.sleep(0.002)  # distinct milliseconds: ids sort by creation time

    seen, token, pages = [], "", 0
    while True:
        page = client.list(labels={"suite": label}, page_size=3, page_token=token)
        pages += 1
        seen += [j.id for j in page.jobs]
        token = page.next_page_token
        if not token:
            break
    assert pages == 3
    assert seen == list(reversed(made))  # newest first, no gaps, no repeats
    failed = client.list(labels={"suite": label}, states=["FAILED"], page_size=50)
    assert [j.id for j in failed.jobs] == [made[i] for i in (5, 3, 1)]


def test_missing_job_is_not_found(client):
    from fxport.jobs import new_job_id

    with pytest.raises(JobNotFound, match="no job"):
        client.get(new_job_id())
    with pytest.raises(JobNotFound):
        client.cancel(new_job_id())


def test_artifacts_download_from_the_store_directly_or_through_the_server(distributed_stack, tiny_pt2, tmp_path,
                                                                           monkeypatch):
    """Presigned URLs take the bytes past the API; where the store can't be reached from the
    client, the server relays them. Either way every byte is checked against the job record."""
    with Client(distributed_stack.address) as c:
        job = c.submit(tiny_pt2, {"targets": ["onnx"], "labels": {"suite": "direct"}})
        job.wait(timeout=180)
        assert job.state == "SUCCEEDED", job.error
    records = {a["name"]: a for a in job.artifacts}

    def check(folder):
        for name, a in records.items():
            assert hashlib.sha256((folder / name).read_bytes()).hexdigest() == a["sha256"]

    for direct in (True, False):
        with Client(distributed_stack.address, direct_download=direct) as c:
            c.get(job.id).download(tmp_path / f"direct-{direct}")
        check(tmp_path / f"direct-{direct}")

    # The store is not reachable from the client (a cluster-internal endpoint): relayed instead.
    with Client(distributed_stack.address) as c:
        monkeypatch.setattr(c, "artifact_url", lambda *a, **kw: "http://127.0.0.1:1/unreachable")
        c.get(job.id).download(tmp_path / "relayed")
        assert c._direct_works is False
    check(tmp_path / "relayed")

    # Bytes changed in the store behind the service's back: refused, nothing left in place.
    onnx = records["model.onnx"]
    s3, store = distributed_stack.s3, distributed_stack.artifact_store()
    original = b"".join(store.iter_chunks(onnx["key"]))
    s3.client().put_object(Bucket=s3.bucket, Key=store.prefix + onnx["key"], Body=original[:-1] + b"\0",
                           Metadata={"sha256": onnx["sha256"]})
    try:
        with Client(distributed_stack.address, direct_download=True) as c:
            with pytest.raises(IntegrityError, match="model.onnx"):
                c.get(job.id).download(tmp_path / "tampered", names=["model.onnx"])
        assert not list((tmp_path / "tampered").iterdir())
    finally:
        s3.client().put_object(Bucket=s3.bucket, Key=store.prefix + onnx["key"], Body=original,
                               Metadata={"sha256": onnx["sha256"]})


def test_wait_with_download_to_fetches_artifacts_while_the_job_still_runs(distributed_stack, tiny_pt2, tmp_path,
                                                                          monkeypatch):
    """`wait(download_to=...)`, what `fxport submit -o` does: what the worker stores during
    export and verify comes down before the job ends, and is kept rather than fetched again."""
    out = tmp_path / "out"
    with Client(distributed_stack.address) as c:
        fetches: list[tuple[str, bool]] = []
        real = c._download_one

        def counted(job_id, art, target, *, early=False):
            real(job_id, art, target, early=early)
            fetches.append((art["name"], early))

        monkeypatch.setattr(c, "_download_one", counted)
        job = c.submit(tiny_pt2, {"targets": ["onnx", "torchscript"], "labels": {"suite": "early"}})
        events = []
        job.wait(timeout=180, on_event=events.append, download_to=out)
    assert job.state == "SUCCEEDED", (job.error, distributed_stack.logs())

    staged = [e for e in events if e.staged is not None]
    assert {"model.onnx", "model.ts"} <= {e.staged["name"] for e in staged}
    assert all(e.state == "RUNNING" for e in staged) and job.staged_artifacts == []
    early = {name for name, was_early in fetches if was_early}
    late = [name for name, was_early in fetches if not was_early]
    assert {"model.onnx", "model.ts"} <= early
    assert sorted(late) == sorted({a["name"] for a in job.artifacts} - early)  # nothing fetched twice

    # Exactly the job's artifacts, each the record's bytes; the hidden folder is gone.
    assert sorted(p.name for p in out.iterdir()) == sorted(a["name"] for a in job.artifacts)
    assert sorted(job.downloaded) == sorted(out / a["name"] for a in job.artifacts)
    for a in job.artifacts:
        assert hashlib.sha256((out / a["name"]).read_bytes()).hexdigest() == a["sha256"]


def test_wait_with_download_to_leaves_nothing_when_the_job_does_not_succeed(distributed_stack, resnet18_pt2,
                                                                            tmp_path):
    out = tmp_path / "out"
    with Client(distributed_stack.address) as c:
        job = c.submit(resnet18_pt2, {"targets": ["torchscript", "onnx"], "labels": {"suite": "early-cancel"}})
        staged = []

        def cancel_once_staged(ev):  # model.ts is stored while the ONNX export still runs
            if ev.staged is not None and not staged:
                staged.append(ev.staged["name"])
                c.cancel(job.id)

        job.wait(timeout=300, on_event=cancel_once_staged, download_to=out)
    assert staged and job.state == "CANCELLED", (job.state, job.error)
    assert job.downloaded is None
    assert not out.exists() or list(out.iterdir()) == []


def test_a_job_benchmarked_on_a_worker_brings_its_benchmark_back(distributed_stack, tiny_pt2, tmp_path):
    """`fxport submit --wait --benchmark`: the worker times every artifact in its sandbox, the
    job's manifest carries the benchmark, the stage has its own events and timing, and the CLI
    prints the table and the recommendation without --out (it fetches the manifest alone)."""
    spec = tmp_path / "spec.yaml"
    spec.write_text("targets: [onnx, torchscript]\nbenchmark: {runs: 5, warmup: 1}\n")
    proc = subprocess.run([sys.executable, "-m", "fxport.cli", "submit", str(tiny_pt2), "--spec", str(spec),
                           "--benchmark", "--wait", "--timeout", "240", "--server", distributed_stack.address],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "120"})
    assert proc.returncode == 0, (proc.stdout, proc.stderr, distributed_stack.logs())
    job_id = proc.stdout.split("job ", 1)[1].split(":", 1)[0].strip()
    assert "benchmark (" in proc.stdout and "recommended: " in proc.stdout, proc.stdout
    with Client(distributed_stack.address) as client:
        job = client.get(job_id)
        job.download(tmp_path / "out", names=["manifest.json"])
    bench = json.loads((tmp_path / "out" / "manifest.json").read_text())["benchmark"]
    assert {r["artifact"] for r in bench["results"]} == {"eager", "onnx", "torchscript"}
    assert bench["recommendation"]["artifact"] in ("onnx", "torchscript")
    assert bench["recommendation"]["artifact"] in proc.stdout.split("recommended: ", 1)[1]
    rec = distributed_stack.job_store().get(job_id)
    assert "benchmark" in rec.stage_timings
