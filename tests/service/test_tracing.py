"""One trace per job, across the API and the worker (issue 42, item 3).

- In one process: the embedded server with the OpenTelemetry SDK's in-memory exporter: SubmitJob,
  the job and each of its stages are one trace, every span naming the job and the tenant.
- Across processes, over OTLP: `fxport serve` and a Celery worker, both with FXPORT_OTLP_ENDPOINT
  set to a collector this test runs (an HTTP server decoding OTLP's protobuf): the worker's spans
  continue the API's trace, and each process names its service.
- Off (the default), a job's record carries no trace and nothing of OpenTelemetry is imported.
"""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from fxport import tracing
from fxport.config import Settings
from tests.fixtures.servers import distributed_env, scaled, start_api, start_worker, wait_until

SPEC = {"targets": ["onnx"], "verify": {"samples": 1}}
REDIS_DB = 6  # a queue and job store of this test's own (tests/workers/tensorrt/test_gpu_queue.py runs with a GPU)


@pytest.fixture()
def in_memory() -> Iterator[object]:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use_provider(provider)
    yield exporter
    tracing.shutdown(provider)


def _one_trace(spans: list, job_id: str) -> None:
    """SubmitJob → the job → its stages, one trace, each span naming the job and its tenant."""
    (submit,) = [s for s in spans if s.name == "fxport.SubmitJob"]
    (job,) = [s for s in spans if s.name == "fxport.job"]
    stages = sorted((s for s in spans if s.name.startswith("fxport.stage ")), key=lambda s: s.start_time)
    assert submit.attributes["job_id"] == job_id and submit.attributes["tenant"] == "default"
    assert {s.context.trace_id for s in [submit, job, *stages]} == {submit.context.trace_id}
    assert job.parent.span_id == submit.context.span_id
    assert all(s.parent.span_id == job.context.span_id for s in stages)
    assert all(s.attributes["job_id"] == job_id and s.attributes["tenant"] == "default" for s in [job, *stages])
    names = [s.attributes["fxport.stage"] for s in stages]
    assert names[0] == "load" and names[-1] == "upload" and {"export", "verify"} <= set(names), names
    assert all(a.end_time <= b.start_time for a, b in zip(stages, stages[1:]))  # one after another


def test_one_trace_spans_submit_the_job_and_its_stages(in_memory, tiny_pt2, tmp_path):
    from fxport.cli.server import create_server
    from fxport.client import Client

    srv, port = create_server(Settings(home=tmp_path / "home", listen="127.0.0.1:0", log_format="text",
                                       cache_enabled=False, retention_sweep_interval_s=0))
    srv.start()
    try:
        with Client(f"127.0.0.1:{port}") as client:
            job = client.submit(tiny_pt2, SPEC)
            job.wait(timeout=scaled(300))
        assert job.succeeded, job.error
        # the job's span ends as its task returns, just after the record says SUCCEEDED
        wait_until(lambda: any(s.name == "fxport.job" for s in in_memory.get_finished_spans()), scaled(30),
                   "the job's span")
    finally:
        srv.stop(grace=0)
    spans = list(in_memory.get_finished_spans())
    _one_trace(spans, job.id)
    # every call of the API is a span too: the submit's encloses fxport.SubmitJob, the watch names its job
    (rpc,) = [s for s in spans if s.name == "fxport.v1.ConversionService/SubmitJob"]
    (submit,) = [s for s in spans if s.name == "fxport.SubmitJob"]
    assert submit.parent.span_id == rpc.context.span_id and rpc.attributes["tenant"] == "default"
    assert any(s.name == "fxport.v1.ConversionService/WatchJob" and s.attributes.get("job_id") == job.id
               for s in spans)


class _Collector(http.server.ThreadingHTTPServer):
    """An OTLP/HTTP traces endpoint on loopback: every span it is sent, with its service's name."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, object]] = []
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), _Receive)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Receive(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
            ExportTraceServiceResponse,
        )

        body = self.rfile.read(int(self.headers["Content-Length"]))
        request = ExportTraceServiceRequest.FromString(body)
        server: _Collector = self.server  # type: ignore[assignment]
        with server.lock:
            for resource_spans in request.resource_spans:
                service = next(a.value.string_value for a in resource_spans.resource.attributes
                               if a.key == "service.name")
                for scope in resource_spans.scope_spans:
                    server.spans.extend((service, span) for span in scope.spans)
        reply = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture()
def collector() -> Iterator[_Collector]:
    server = _Collector()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.mark.slow
def test_the_worker_continues_the_apis_trace_over_otlp(collector, redis_server, s3_server, tiny_pt2, tmp_path):
    from fxport.client import Client

    env = {**distributed_env(redis_server, s3_server, tmp_path, prefix="tracing"),
           "FXPORT_BROKER_URL": f"redis://127.0.0.1:{redis_server.port}/{REDIS_DB}",
           "FXPORT_OTLP_ENDPOINT": collector.endpoint}
    api = start_api(tmp_path, env, name="traced-api")
    worker = None
    try:
        worker = start_worker(tmp_path, env, "cpu", name="traced-worker")
        with Client(api.address) as client:
            job = client.submit(tiny_pt2, SPEC)
            job.wait(timeout=scaled(300))
        assert job.succeeded, job.error

        def exported() -> bool:
            with collector.lock:
                return {"fxport.SubmitJob", "fxport.job"} <= {s.name for _, s in collector.spans}
        wait_until(exported, scaled(60), "both services' spans at the collector")  # batches leave every 5 s
    finally:
        if worker is not None:
            worker.stop()
        api.stop()
    with collector.lock:
        spans = list(collector.spans)
    (submit,) = [(svc, s) for svc, s in spans if s.name == "fxport.SubmitJob"]
    (job_span,) = [(svc, s) for svc, s in spans if s.name == "fxport.job"]
    stages = [(svc, s) for svc, s in spans if s.name.startswith("fxport.stage ")]
    assert submit[0] == "fxport-api" and job_span[0] == "fxport-worker" and {svc for svc, _ in stages} == {
        "fxport-worker"}
    assert job_span[1].trace_id == submit[1].trace_id and job_span[1].parent_span_id == submit[1].span_id
    assert all(s.trace_id == submit[1].trace_id for _, s in stages) and len(stages) >= 4
    assert {a.key: a.value.string_value for a in job_span[1].attributes}["job_id"] == job.id
    # FXPORT_LOG_FORMAT=json: every line the worker wrote is a JSON record (no banner, no raw warning)
    lines = [line for line in (tmp_path / "traced-worker.log").read_text().splitlines() if line.strip()]
    assert lines and all(line.startswith("{") for line in lines), [x for x in lines if not x.startswith("{")][:5]


def test_tracing_is_off_by_default_and_loads_nothing():
    probe = ("import sys; from fxport.config import Settings; from fxport import tracing; "
             "assert Settings().otlp_endpoint is None; assert not tracing.configure(None, 'x'); "
             "assert tracing.carrier() is None; "
             "print(any(m.startswith('opentelemetry') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
