"""Bad input against the authenticated service: every case asserts its status code AND message.

Malformed SubmitJob streams and FileHeaders, specs with wrong types or out-of-range values
(with their google.rpc.BadRequest field paths), hostile ids and names on the other RPCs; then
files that pass the API but are not models a worker should expand or trust (zip bomb,
NaN weights, garbage, a bare checkpoint, inputs named unlike the model's). The service stays
up throughout (tests/security/test_service_survives.py checks it afterwards).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from fxport.v1 import conversion_pb2 as pb
from tests.security.hostile import nan_pt2, state_dict_checkpoint, zip_bomb

DATA = b"not a model, but bytes"
SHA = hashlib.sha256(DATA).hexdigest()


def file_header(data: bytes = DATA, **kw) -> pb.FileHeader:
    fields = {"filename": "m.pt2", "size": len(data), "sha256": hashlib.sha256(data).hexdigest(), **kw}
    return pb.FileHeader(**fields)


def header(spec: str = "", **kw) -> pb.SubmitJobRequest:
    kw.setdefault("model", file_header())
    return pb.SubmitJobRequest(header=pb.SubmitHeader(spec=spec, **kw))


def chunk(data: bytes = DATA) -> pb.SubmitJobRequest:
    return pb.SubmitJobRequest(model_chunk=data)


def spec_case(spec: str) -> list[pb.SubmitJobRequest]:
    return [header(spec), chunk()]


# (id, requests, code, text in details, field of the first BadRequest violation or None)
SUBMIT_CASES: list[tuple[str, Callable[[], list], grpc.StatusCode, str, str | None]] = [
    # -- the stream and the FileHeader -------------------------------------------------------
    ("empty-stream", lambda: [], grpc.StatusCode.INVALID_ARGUMENT, "must carry the header", None),
    ("chunk-before-header", lambda: [chunk(), header()], grpc.StatusCode.INVALID_ARGUMENT,
     "must carry the header", None),
    ("two-headers", lambda: [header(), header()], grpc.StatusCode.INVALID_ARGUMENT,
     "only the first message may be a header", None),
    ("no-model-header", lambda: [pb.SubmitJobRequest(header=pb.SubmitHeader(spec=""))],
     grpc.StatusCode.INVALID_ARGUMENT, "header.model is required", None),
    ("negative-size", lambda: [header(model=file_header(size=-5)), chunk()], grpc.StatusCode.INVALID_ARGUMENT,
     "model.size: must not be negative", None),
    ("sha256-not-hex", lambda: [header(model=file_header(sha256="z" * 64)), chunk()], grpc.StatusCode.INVALID_ARGUMENT,
     "model.sha256: expected 64 lowercase hex digits", None),
    ("sha256-uppercase", lambda: [header(model=file_header(sha256=SHA.upper())), chunk()],
     grpc.StatusCode.INVALID_ARGUMENT, "model.sha256: expected 64 lowercase hex digits", None),
    ("sha256-short", lambda: [header(model=file_header(sha256=SHA[:40])), chunk()], grpc.StatusCode.INVALID_ARGUMENT,
     "model.sha256: expected 64 lowercase hex digits", None),
    ("sha256-mismatch", lambda: [header(model=file_header(sha256="0" * 64)), chunk()],
     grpc.StatusCode.INVALID_ARGUMENT, "corrupted in transit", None),
    ("filename-too-long", lambda: [header(model=file_header(filename="m" * 300 + ".pt2")), chunk()],
     grpc.StatusCode.INVALID_ARGUMENT, "model.filename: a file name", None),
    ("filename-traversal", lambda: [header(model=file_header(filename="../../../etc/cron.d/x")), chunk()],
     grpc.StatusCode.INVALID_ARGUMENT, "model.filename: a file name (no path", None),
    ("filename-control-chars", lambda: [header(model=file_header(filename="m\x00.pt2")), chunk()],
     grpc.StatusCode.INVALID_ARGUMENT, "no control characters", None),
    ("zero-byte-model", lambda: [header(model=file_header(b"", sha256=""))], grpc.StatusCode.INVALID_ARGUMENT,
     "model upload is empty", None),
    ("fewer-bytes-than-declared", lambda: [header(model=file_header(size=len(DATA) + 10, sha256="")), chunk()],
     grpc.StatusCode.INVALID_ARGUMENT, f"ended after {len(DATA)} of {len(DATA) + 10} declared bytes", None),
    ("more-bytes-than-declared", lambda: [header(model=file_header(size=4, sha256="")), chunk()],
     grpc.StatusCode.INVALID_ARGUMENT, "longer than the 4 bytes its header declared", None),
    ("declared-over-the-limit", lambda: [header(model=file_header(size=1 << 40, sha256=""))],
     grpc.StatusCode.RESOURCE_EXHAUSTED, "this server accepts at most", None),
    ("stored-without-sha256", lambda: [header(model=file_header(sha256="", stored=True))],
     grpc.StatusCode.INVALID_ARGUMENT, "model.stored needs model.sha256", None),
    ("stored-but-unknown", lambda: [header(model=file_header(sha256="ab" * 32, stored=True))],
     grpc.StatusCode.FAILED_PRECONDITION, "send the bytes", None),
    ("calibration-chunk-without-header", lambda: [header(), chunk(), pb.SubmitJobRequest(calibration_chunk=b"c")],
     grpc.StatusCode.INVALID_ARGUMENT, "calibration_chunk without a calibration header", None),
    ("model-chunk-after-calibration",
     lambda: [header(calibration=file_header(b"c", filename="c.npz")), pb.SubmitJobRequest(calibration_chunk=b"c"),
              chunk()], grpc.StatusCode.INVALID_ARGUMENT, "model_chunk after calibration data", None),
    ("calibration-bad-sha256", lambda: [header(calibration=file_header(b"c", sha256="x")), chunk()],
     grpc.StatusCode.INVALID_ARGUMENT, "calibration.sha256: expected 64 lowercase hex digits", None),
    ("idempotency-key-too-long", lambda: [header(idempotency_key="k" * 257), chunk()],
     grpc.StatusCode.INVALID_ARGUMENT, "idempotency_key is longer than 256 characters", None),
    # -- the spec ------------------------------------------------------------------------------
    ("spec-too-big", lambda: spec_case("labels: {a: b}\n" + "#" * (70 << 10)), grpc.StatusCode.RESOURCE_EXHAUSTED,
     "the limit is 65536", None),
    ("spec-yaml-syntax", lambda: spec_case("targets: [onnx\nprecision: fp32\n"), grpc.StatusCode.INVALID_ARGUMENT,
     "not valid YAML/JSON at line", "spec"),
    ("spec-not-a-mapping", lambda: spec_case("- onnx\n- torchscript\n"), grpc.StatusCode.INVALID_ARGUMENT,
     "must be a mapping of keys to values, got list", "spec"),
    ("spec-targets-not-a-list", lambda: spec_case(json.dumps({"targets": 5})), grpc.StatusCode.INVALID_ARGUMENT,
     "valid list", "targets"),
    ("spec-unknown-target", lambda: spec_case("targets: [tflite]"), grpc.StatusCode.INVALID_ARGUMENT,
     "'torchscript'", "targets[0]"),
    ("spec-precision-wrong-type", lambda: spec_case("precision: 16"), grpc.StatusCode.INVALID_ARGUMENT,
     "'fp32', 'fp16' or 'int8'", "precision"),
    ("spec-atol-not-a-number", lambda: spec_case("verify: {atol: tiny}"), grpc.StatusCode.INVALID_ARGUMENT,
     "valid number", "verify.atol"),
    ("spec-timeout-not-an-int", lambda: spec_case("limits: {timeout_s: forever}"), grpc.StatusCode.INVALID_ARGUMENT,
     "valid integer", "limits.timeout_s"),
    ("spec-memory-too-small", lambda: spec_case("limits: {memory_mb: 0}"), grpc.StatusCode.INVALID_ARGUMENT,
     "greater than or equal to 256", "limits.memory_mb"),
    ("spec-unknown-key", lambda: spec_case("shell: 'rm -rf /'"), grpc.StatusCode.INVALID_ARGUMENT,
     "unknown key 'shell'; valid keys here", "shell"),
    ("spec-huge-dim", lambda: spec_case(json.dumps({"inputs": [{"name": "x", "shape": [100_000, 4]}]})),
     grpc.StatusCode.INVALID_ARGUMENT, "dim 0 is 100000; a static dim must be between 1 and 65536", "inputs[0].shape"),
    ("spec-negative-dim", lambda: spec_case(json.dumps({"inputs": [{"name": "x", "shape": [-1, 4]}]})),
     grpc.StatusCode.INVALID_ARGUMENT, "dim 0 is -1", "inputs[0].shape"),
    ("spec-too-many-elements", lambda: spec_case(json.dumps({"inputs": [{"name": "x", "shape": [65536, 65536]}]})),
     grpc.StatusCode.INVALID_ARGUMENT, "has up to 4294967296 elements; the limit is", "spec"),
    ("spec-rank-too-high", lambda: spec_case(json.dumps({"inputs": [{"name": "x", "shape": [1] * 9}]})),
     grpc.StatusCode.INVALID_ARGUMENT, "at most 8 items", "inputs[0].shape"),
    ("spec-too-many-inputs",
     lambda: spec_case(json.dumps({"inputs": [{"name": f"x{i}", "shape": [1]} for i in range(33)]})),
     grpc.StatusCode.INVALID_ARGUMENT, "at most 32 items", "inputs"),
    ("spec-input-name-traversal", lambda: spec_case(json.dumps({"inputs": [{"name": "../x", "shape": [1]}]})),
     grpc.StatusCode.INVALID_ARGUMENT, "must be an identifier", "inputs[0].name"),
    ("spec-label-key-charset", lambda: spec_case(json.dumps({"labels": {"team; DROP": "x"}})),
     grpc.StatusCode.INVALID_ARGUMENT, "label key 'team; DROP'", "labels"),
    ("spec-label-value-too-long", lambda: spec_case(json.dumps({"labels": {"team": "v" * 300}})),
     grpc.StatusCode.INVALID_ARGUMENT, "value longer than 256 characters", "labels"),
    ("spec-dynamic-range-inverted",
     lambda: spec_case(json.dumps({"inputs": [{"name": "x", "shape": ["batch", 4]}],
                                   "dynamic_dims": {"batch": {"min": 64, "opt": 8, "max": 1}}})),
     grpc.StatusCode.INVALID_ARGUMENT, "need min <= opt <= max", "dynamic_dims.batch"),
    ("spec-dynamic-dim-huge",
     lambda: spec_case(json.dumps({"inputs": [{"name": "x", "shape": ["batch", 4]}],
                                   "dynamic_dims": {"batch": {"min": 1, "opt": 8, "max": 1 << 30}}})),
     grpc.StatusCode.INVALID_ARGUMENT, "less than or equal to 65536", "dynamic_dims.batch.max"),
    # -- specs that cost the API more than their size (issue 40) -----------------------------------
    ("spec-yaml-alias-bomb", lambda: spec_case(alias_bomb()), grpc.StatusCode.INVALID_ARGUMENT,
     "may not use YAML anchors or aliases", "spec"),
    ("spec-nested-too-deep", lambda: spec_case("labels: " + "[" * 40 + "]" * 40), grpc.StatusCode.INVALID_ARGUMENT,
     "nested more than 10 levels deep", "spec"),
    ("spec-thousand-unknown-keys", lambda: spec_case(json.dumps({f"key{i}": i for i in range(1000)})),
     grpc.StatusCode.INVALID_ARGUMENT, "more violation(s): fix these first", "key0"),
]


def alias_bomb(levels: int = 8) -> str:
    """A YAML spec of ~400 bytes whose aliases stand for 9**(levels + 1) strings under `targets`,
    which validation walks and quotes: what took an API to gigabytes of memory and a minute of CPU."""
    text = 'targets:\n  - &a [' + ",".join(['"xxxxxxxx"'] * 9) + "]\n"
    for name, prev in zip("bcdefghi"[:levels], "abcdefgh"):
        text += f"  - &{name} [*{prev},*{prev},*{prev},*{prev},*{prev},*{prev},*{prev},*{prev},*{prev}]\n"
    return text


def _rss_mib(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def test_an_alias_bomb_costs_the_api_nothing(stub, secure_stack):
    """The spec is refused when read, before anything expands it: the API's memory stays as it
    was (its other tenants' calls never stall behind it)."""
    pid = secure_stack.api.process.pid
    before = _rss_mib(pid)
    for _ in range(3):
        err = call_submit(stub, secure_stack.metadata("alice"), spec_case(alias_bomb()))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "anchors or aliases" in err.details()
        assert len(err.details()) < 2000, len(err.details())
    assert _rss_mib(pid) - before < 100, f"the API's RSS went from {before:.0f} to {_rss_mib(pid):.0f} MiB"


def call_submit(stub, metadata, requests: list) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        stub.SubmitJob(iter(requests), metadata=metadata, timeout=20)
    return info.value


def violations(err: grpc.RpcError) -> list[tuple[str, str]]:
    status = rpc_status.from_call(err)
    out = []
    for detail in status.details if status else ():
        bad = error_details_pb2.BadRequest()
        if detail.Unpack(bad):
            out += [(v.field, v.description) for v in bad.field_violations]
    return out


@pytest.mark.parametrize("requests,code,text,field", [c[1:] for c in SUBMIT_CASES], ids=[c[0] for c in SUBMIT_CASES])
def test_submit_refuses(stub, secure_stack, requests, code, text, field):
    err = call_submit(stub, secure_stack.metadata("alice"), requests())
    assert err.code() == code, err.details()
    assert text in err.details()
    assert len(err.details()) < 2000  # the trailing metadata a client accepts is 8 KiB in all
    if field is not None:
        fields = violations(err)
        assert fields and fields[0][0] == field, fields
        assert text in fields[0][1] or text in err.details()


def test_at_least_thirty_bad_inputs():
    assert len(SUBMIT_CASES) + len(OTHER_CASES) + len(JOB_CASES) >= 30


# -- the other RPCs: ids, names, enums, pages ------------------------------------------------

OTHER_CASES = [
    ("get-job-id-traversal", "GetJob", pb.GetJobRequest(job_id="../../etc/passwd"),
     grpc.StatusCode.INVALID_ARGUMENT, "'../../etc/passwd' is not a job id"),
    ("get-job-id-empty", "GetJob", pb.GetJobRequest(job_id=""), grpc.StatusCode.INVALID_ARGUMENT, "is not a job id"),
    ("cancel-job-id-uppercase", "CancelJob", pb.CancelJobRequest(job_id="0" * 25 + "Z"),
     grpc.StatusCode.INVALID_ARGUMENT, "is not a job id"),
    ("url-job-id-slash", "GetArtifactUrl", pb.GetArtifactUrlRequest(job_id="a/b", name="model.onnx"),
     grpc.StatusCode.INVALID_ARGUMENT, "is not a job id"),
    ("list-unknown-enum", "ListJobs", pb.ListJobsRequest(states=[42]), grpc.StatusCode.INVALID_ARGUMENT,
     "states: 42 is not a job state to filter on"),
    ("list-unspecified-state", "ListJobs", pb.ListJobsRequest(states=[pb.JOB_STATE_UNSPECIFIED]),
     grpc.StatusCode.INVALID_ARGUMENT, "states: 0 is not a job state"),
    ("list-negative-page-size", "ListJobs", pb.ListJobsRequest(page_size=-1), grpc.StatusCode.INVALID_ARGUMENT,
     "page_size: must not be negative"),
    ("list-garbage-page-token", "ListJobs", pb.ListJobsRequest(page_token="../../garbage"),
     grpc.StatusCode.INVALID_ARGUMENT, "invalid page_token"),
    ("check-upload-bad-sha", "CheckUpload", pb.CheckUploadRequest(model_sha256="../" * 10),
     grpc.StatusCode.INVALID_ARGUMENT, "model_sha256: expected 64 lowercase hex digits"),
]


@pytest.mark.parametrize("method,request_,code,text", [c[1:] for c in OTHER_CASES], ids=[c[0] for c in OTHER_CASES])
def test_rpc_refuses(stub, secure_stack, method, request_, code, text):
    with pytest.raises(grpc.RpcError) as info:
        getattr(stub, method)(request_, metadata=secure_stack.metadata("alice"), timeout=10)
    assert info.value.code() == code
    assert text in info.value.details()


def test_watch_and_download_refuse_a_traversal_id(stub, secure_stack):
    for stream in (stub.WatchJob(pb.WatchJobRequest(job_id="../x"), metadata=secure_stack.metadata("alice"),
                                 timeout=10),
                   stub.DownloadArtifact(pb.DownloadArtifactRequest(job_id="..", name="../../etc/passwd"),
                                         metadata=secure_stack.metadata("alice"), timeout=10)):
        with pytest.raises(grpc.RpcError) as info:
            list(stream)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "is not a job id" in info.value.details()


# -- files that pass the API but must not be trusted by a worker -------------------------------

def _garbage(tmp):
    path = tmp / "garbage.pt2"
    path.write_bytes(b"\x7fELF" + bytes(range(256)) * 8)
    return path


def _truncated(tmp, tiny_pt2):
    path = tmp / "truncated.pt2"
    path.write_bytes(tiny_pt2.read_bytes()[:-300])
    return path


# (id, build(tmp, tiny_pt2) -> path, spec, stage, code, text)
JOB_CASES = [
    ("zip-bomb", lambda tmp, _: zip_bomb(tmp / "bomb.pt2"),
     {"targets": ["onnx"]}, "load", "unsupported_format", "looks like a decompression bomb"),
    ("nan-weights", lambda tmp, _: nan_pt2(tmp / "nan.pt2"),
     {"targets": ["onnx"], "passes": []}, "verify", "verification_failed", "entirely NaN/Inf"),
    ("garbage-bytes", lambda tmp, _: _garbage(tmp), {"targets": ["onnx"]}, "load", "unsupported_format",
     "is not a format fxport reads"),
    ("truncated-archive", lambda tmp, pt2: _truncated(tmp, pt2), {"targets": ["onnx"]}, "load", "unsupported_format",
     "truncated or corrupt"),
    ("bare-checkpoint", lambda tmp, _: state_dict_checkpoint(tmp / "sd.pt"), {"targets": ["onnx"]}, "load",
     "unsupported_format", "torch.save checkpoint"),
    ("mismatched-input-names", lambda tmp, pt2: pt2,
     {"targets": ["onnx"], "inputs": [{"name": "image", "shape": ["batch", 8]}],
      "dynamic_dims": {"batch": {"min": 1, "opt": 2, "max": 64}}},
     "load", "invalid_input", "inputs[0] is named 'image' but the exported model's input 0 is 'x'"),
]


@pytest.fixture(scope="module")
def bad_file_jobs(secure_stack, tiny_pt2, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad-files")
    with secure_stack.client("alice") as client:
        jobs = {name: client.submit(build(tmp, tiny_pt2), spec) for name, build, spec, *_ in JOB_CASES}
        yield jobs


@pytest.mark.slow
@pytest.mark.parametrize("name,stage,code,text", [(c[0], *c[3:]) for c in JOB_CASES], ids=[c[0] for c in JOB_CASES])
def test_job_fails_clearly(bad_file_jobs, secure_stack, name, stage, code, text):
    job = bad_file_jobs[name]
    job.wait(timeout=240)
    assert job.state == "FAILED", (job.error, secure_stack.logs())
    assert (job.error["stage"], job.error["code"]) == (stage, code), job.error
    assert text in job.error["message"]
