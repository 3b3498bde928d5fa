"""Authentication and tenant isolation: tokens (hashed, rotated without restart), mTLS with the
tenant from the certificate's CN, open health/reflection, the refusal to serve a
non-loopback address unauthenticated, the `fxport tokens` command, and cross-tenant calls
that must all look like a missing job."""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fxport.cli.server import create_server
from fxport.client import AuthFailed, Client, Job, JobNotFound, ServerUnreachable
from fxport.config import Settings
from fxport.errors import EXIT_UNREACHABLE, EXIT_USAGE
from fxport.jobs import InputRef, JobRecord, new_job_id, open_job_store
from fxport.service.auth import (
    InsecureListen,
    TokensFileError,
    hash_token,
    is_loopback,
    new_token,
    parse_tokens,
    token_entry,
)
from fxport.v1 import conversion_pb2 as pb
from fxport.v1 import conversion_pb2_grpc as pb_grpc

# -- tokens against the real (subprocess) API --------------------------------------------------


@pytest.mark.parametrize("metadata,text", [
    ((), "missing credentials: send 'authorization: Bearer <token>'"),
    ((("authorization", "Bearer fxp_not-a-real-token"),), "invalid token"),
    ((("authorization", "Basic YWxpY2U6cHc="),), "must be 'Bearer <token>'"),
    ((("authorization", "Bearer "),), "must be 'Bearer <token>'"),
    ((("authorization", "Bearer " + "x" * 600),), "must be 'Bearer <token>'"),
])
def test_every_service_call_needs_a_valid_token(stub, metadata, text):
    calls = [
        lambda: stub.ListJobs(pb.ListJobsRequest(), metadata=metadata, timeout=10),
        lambda: stub.GetJob(pb.GetJobRequest(job_id=new_job_id()), metadata=metadata, timeout=10),
        lambda: stub.CheckUpload(pb.CheckUploadRequest(model_sha256="0" * 64), metadata=metadata, timeout=10),
        lambda: list(stub.WatchJob(pb.WatchJobRequest(job_id=new_job_id()), metadata=metadata, timeout=10)),
        lambda: stub.SubmitJob(iter([pb.SubmitJobRequest(header=pb.SubmitHeader(spec=""))]), metadata=metadata,
                               timeout=10),
    ]
    for call in calls:
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert text in info.value.details()
        assert "fxp_not-a-real-token" not in info.value.details()  # a presented token is never echoed


def test_health_and_reflection_need_no_token(secure_stack):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(secure_stack.address) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        out = next(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                             timeout=10))
        assert "fxport.v1.ConversionService" in {s.name for s in out.list_services_response.service}


def test_the_client_reports_auth_failure_with_its_exit_code(secure_stack, tiny_pt2):
    for token in (None, "fxp_wrong"):
        with Client(secure_stack.address, token=token) as client:
            with pytest.raises(AuthFailed) as info:
                client.submit(tiny_pt2, {"targets": ["onnx"]})
        assert info.value.exit_code == EXIT_UNREACHABLE and "FXPORT_TOKEN" in str(info.value)


def test_cli_without_a_token_exits_4(secure_stack):
    res = subprocess.run([sys.executable, "-m", "fxport.cli", "jobs", "list", "--server", secure_stack.address],
                         capture_output=True, text=True, timeout=60, env={**os.environ, "FXPORT_TOKEN": ""})
    assert res.returncode == EXIT_UNREACHABLE, res.stderr
    assert "missing credentials" in res.stderr


# -- tenant isolation --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def alices_job(secure_stack, tiny_pt2):
    with secure_stack.client("alice") as alice:
        job = alice.submit(tiny_pt2, {"targets": ["onnx"], "labels": {"suite": "isolation"}})
        job.wait(timeout=240)
        assert job.state == "SUCCEEDED", (job.error, secure_stack.logs())
        yield job


@pytest.mark.slow
def test_another_tenants_job_is_not_found(secure_stack, alices_job, tmp_path):
    job_id = alices_job.id
    with secure_stack.client("bob") as bob:
        for call in (lambda: bob.get(job_id), lambda: bob.cancel(job_id),
                     lambda: bob.artifact_url(job_id, "model.onnx"),
                     lambda: list(Job(bob, alices_job.message).events(timeout=10)),
                     lambda: Job(bob, alices_job.message).download(tmp_path / "bob")):
            with pytest.raises(JobNotFound) as info:
                call()
            assert f"no job {job_id}" in str(info.value)
        assert job_id not in [j.id for j in bob.iter_jobs()]
        assert not list(bob.iter_jobs(labels={"suite": "isolation"}))
        # Inputs are per tenant too: bob cannot learn of, or reuse, alice's uploaded model.
        assert not bob._stub.CheckUpload(pb.CheckUploadRequest(model_sha256=alices_job.message.model.sha256),
                                         metadata=secure_stack.metadata("bob"), timeout=10).model_present
        header = pb.SubmitHeader(spec="", model=pb.FileHeader(filename="m.pt2", sha256=alices_job.message.model.sha256,
                                                              stored=True))
        with pytest.raises(grpc.RpcError) as info:
            bob._stub.SubmitJob(iter([pb.SubmitJobRequest(header=header)]), metadata=secure_stack.metadata("bob"),
                                timeout=10)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "send the bytes" in info.value.details()
    with secure_stack.client("alice") as alice:
        again = alice.get(job_id)  # bob's cancel changed nothing
        assert again.state == "SUCCEEDED" and again.message.tenant == "alice"
        assert job_id in [j.id for j in alice.iter_jobs(labels={"suite": "isolation"})]
        assert all(a["key"].startswith(f"alice/jobs/{job_id}/") for a in again.artifacts)
        assert again.message.model.key == f"alice/inputs/{again.message.model.sha256}"
        with pytest.raises(JobNotFound) as info:  # a traversal-shaped artifact name is just not an artifact
            alice._download_one(job_id, {"name": "../../bob/inputs/x", "sha256": "", "bytes": 0}, tmp_path / "x")
        assert "has no artifact '../../bob/inputs/x'" in str(info.value)


# -- tokens file, rotation, refusal to start ---------------------------------------------------


def test_tokens_file_format_and_errors():
    token = new_token()
    assert token.startswith("fxp_") and len(token) > 40
    entries = parse_tokens(f"# comment\n\nalice: {hash_token(token)}  # laptop\nalice: {'a' * 64}\n")
    assert [(e.tenant, e.sha256) for e in entries] == [("alice", hash_token(token)), ("alice", "a" * 64)]
    for text, why in ((f"alice {hash_token(token)}", "line 1: expected 'TENANT: SHA256-HEX'"),
                      (f"Alice: {hash_token(token)}", "line 1: expected"),
                      ("\nbob: fxp_rawtokeninthefile", "line 2: the digest must be 64 hex digits")):
        with pytest.raises(TokensFileError, match=why):
            parse_tokens(text)
    with pytest.raises(ValueError, match="tenant '../x'"):
        token_entry("../x", token)


@pytest.fixture()
def local_server(tmp_path):
    """An in-process server (embedded mode, loopback) with a tokens file of its own."""
    tokens = tmp_path / "tokens"
    alice = new_token()
    tokens.write_text(token_entry("alice", alice) + "\n")
    srv, port = create_server(Settings(home=tmp_path / "home", listen="127.0.0.1:0", tokens_file=tokens,
                                       log_format="text"))
    srv.start()
    yield srv, port, tokens, alice
    srv.stop(grace=0)


def _list(port: int, token: str) -> grpc.StatusCode:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        try:
            pb_grpc.ConversionServiceStub(ch).ListJobs(pb.ListJobsRequest(), timeout=10,
                                                       metadata=(("authorization", f"Bearer {token}"),))
            return grpc.StatusCode.OK
        except grpc.RpcError as err:
            return err.code()


def test_tokens_rotate_without_restart_and_a_broken_file_fails_closed(local_server):
    _, port, tokens, alice = local_server
    carol = new_token()
    assert _list(port, carol) == grpc.StatusCode.UNAUTHENTICATED
    tokens.write_text(tokens.read_text() + token_entry("carol", carol) + "\n")
    assert _list(port, carol) == grpc.StatusCode.OK and _list(port, alice) == grpc.StatusCode.OK
    tokens.write_text(token_entry("carol", carol) + "\n")  # alice's token revoked
    assert _list(port, alice) == grpc.StatusCode.UNAUTHENTICATED
    tokens.write_text("carol " + hash_token(carol) + "\n")  # a typo: every token refused until fixed
    assert _list(port, carol) == grpc.StatusCode.UNAUTHENTICATED
    tokens.write_text(token_entry("carol", carol) + "\n")
    assert _list(port, carol) == grpc.StatusCode.OK


def test_server_refuses_to_start_without_auth_off_loopback(tmp_path):
    assert is_loopback("127.0.0.1:0") and is_loopback("[::1]:5") and is_loopback("localhost:1")
    assert not is_loopback("0.0.0.0:1") and not is_loopback("[::]:1") and not is_loopback("api.example.com:1")
    with pytest.raises(InsecureListen, match="--insecure-no-auth"):
        create_server(Settings(home=tmp_path / "a", listen="0.0.0.0:0"))
    with pytest.raises(TokensFileError, match="cannot use tokens file"):
        create_server(Settings(home=tmp_path / "b", listen="0.0.0.0:0", tokens_file=tmp_path / "missing"))
    srv, _ = create_server(Settings(home=tmp_path / "c", listen="0.0.0.0:0", insecure_no_auth=True))
    srv.stop(grace=0)
    res = subprocess.run([sys.executable, "-m", "fxport.cli", "serve", "--listen", "0.0.0.0:0",
                          "--home", str(tmp_path / "d")], capture_output=True, text=True, timeout=60,
                         env={k: v for k, v in os.environ.items() if not k.startswith("FXPORT_")})
    assert res.returncode == EXIT_USAGE
    assert "refusing to serve 0.0.0.0:0 without authentication" in res.stderr


def test_tokens_command(tmp_path):
    from typer.testing import CliRunner

    from fxport.cli import app

    runner = CliRunner()
    path = tmp_path / "tokens"
    res = runner.invoke(app, ["tokens", "new", "team-a", "--tokens-file", str(path)])
    assert res.exit_code == 0, res.output
    token = res.stdout.strip()
    assert token.startswith("fxp_")
    assert path.read_text() == f"team-a: {hashlib.sha256(token.encode()).hexdigest()}\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert token not in path.read_text()
    res = runner.invoke(app, ["tokens", "hash", "team-a"], input=token + "\n")
    assert res.exit_code == 0 and res.stdout.strip() == path.read_text().strip()
    res = runner.invoke(app, ["tokens", "new", "Team A"])
    assert res.exit_code == EXIT_USAGE and "tenant 'Team A'" in res.output


# -- mTLS ----------------------------------------------------------------------------------------


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _issue(cwd: Path, ca: str, name: str, cn: str, ext: str) -> None:
    (cwd / f"{name}.ext").write_text(ext)
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", f"{name}.key",
             "-out", f"{name}.csr", "-subj", f"/CN={cn}", cwd=cwd)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
             "-out", f"{name}.pem", "-days", "1", "-extfile", f"{name}.ext", cwd=cwd)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, a server certificate for 127.0.0.1, client certificates for alice and for a CN that
    is no tenant name, and one from another CA — made with the openssl CLI."""
    d = tmp_path_factory.mktemp("pki")
    for ca in ("ca", "rogue-ca"):
        _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout",
                 f"{ca}.key", "-out", f"{ca}.pem", "-days", "1", "-subj", f"/CN=fxport test {ca}",
                 "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign", cwd=d)
    _issue(d, "ca", "server", "fxport-api", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
    for name, cn, ca in (("alice", "alice", "ca"), ("badname", "Alice Smith", "ca"), ("rogue", "alice", "rogue-ca")):
        _issue(d, ca, name, cn, "extendedKeyUsage=clientAuth\n")
    return d


def _creds(pki: Path, client: str | None) -> grpc.ChannelCredentials:
    ca = (pki / "ca.pem").read_bytes()
    if client is None:
        return grpc.ssl_channel_credentials(root_certificates=ca)
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=(pki / f"{client}.key").read_bytes(),
                                        certificate_chain=(pki / f"{client}.pem").read_bytes())


def test_mtls_tenant_is_the_certificate_cn(pki, tmp_path):
    home = tmp_path / "home"
    srv, port = create_server(Settings(home=home, listen="127.0.0.1:0", log_format="text",
                                       tls_cert_file=pki / "server.pem", tls_key_file=pki / "server.key",
                                       tls_client_ca_file=pki / "ca.pem"))
    srv.start()
    try:
        jobs = open_job_store(None, home)
        ids = {}
        for tenant in ("alice", "bob"):
            ids[tenant] = new_job_id()
            jobs.create(JobRecord(id=ids[tenant], tenant=tenant, spec={}, spec_digest="0" * 64,
                                  model=InputRef(sha256="0" * 64, bytes=1, filename="m.pt2", key="k")))
        target = f"127.0.0.1:{port}"
        with Client(target, tls=_creds(pki, "alice")) as alice:
            assert [j.id for j in alice.list()] == [ids["alice"]]
            with pytest.raises(JobNotFound):
                alice.get(ids["bob"])
        with Client(target, tls=_creds(pki, "badname")) as bad:
            with pytest.raises(AuthFailed, match="client certificate CN 'Alice Smith' is not a tenant name"):
                bad.list()
        # No certificate, another CA's, or plaintext: the TLS handshake itself fails.
        for tls in (_creds(pki, None), _creds(pki, "rogue"), None):
            with Client(target, tls=tls, timeout=10) as anon:
                with pytest.raises(ServerUnreachable):
                    anon.list()
        jobs.close()
    finally:
        srv.stop(grace=0)


def test_tls_settings_must_be_complete(pki, tmp_path):
    with pytest.raises(ValueError, match="needs FXPORT_TLS_CERT_FILE and FXPORT_TLS_KEY_FILE"):
        create_server(Settings(home=tmp_path, listen="127.0.0.1:0", tls_client_ca_file=pki / "ca.pem"))
    with pytest.raises(ValueError, match="TLS needs both"):
        create_server(Settings(home=tmp_path, listen="127.0.0.1:0", tls_cert_file=pki / "server.pem"))
