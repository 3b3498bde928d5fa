"""Fixtures for the security suite: an authenticated `fxport serve` in front of the session's
real Redis + SeaweedFS S3 + Celery workers (tests/conftest.py), two tenants with tokens, and
the secrets a hostile model must never see."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from fxport.client import Client
from fxport.service.auth import new_token, token_entry
from tests.fixtures.servers import ApiServer, DistributedStack, start_api

TENANTS = ("alice", "bob")


@dataclass
class SecureStack:
    """The authenticated API (a subprocess) sharing the session stack's broker, store and workers."""

    api: ApiServer
    stack: DistributedStack
    tokens: dict[str, str]
    tokens_file: Path

    @property
    def address(self) -> str:
        return self.api.address

    def client(self, tenant: str | None = None, token: str | None = None, **kw: Any) -> Client:
        return Client(self.address, token=token if token is not None else self.tokens.get(tenant or ""), **kw)

    def metadata(self, tenant: str) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.tokens[tenant]}"),)

    def secrets(self) -> list[str]:
        """Values that must never reach a sandbox, a job record or an error message."""
        s3, redis = self.stack.s3, self.stack.redis
        return [s3.secret_key, s3.access_key, redis.url, *self.tokens.values()]

    def logs(self) -> str:
        from tests.fixtures.servers import tail

        return f"== secure-api ==\n{tail(self.api.process.log)}\n{self.stack.logs()}"


@pytest.fixture(scope="session")
def secure_stack(tmp_path_factory, distributed_stack) -> SecureStack:
    base = tmp_path_factory.mktemp("secure-api")
    tokens = {t: new_token() for t in TENANTS}
    tokens_file = base / "tokens"
    tokens_file.write_text("# tenants of the security suite\n" + "".join(token_entry(t, tok) + "\n"
                                                                         for t, tok in tokens.items()))
    env = {**distributed_stack.env, "FXPORT_TOKENS_FILE": str(tokens_file), "FXPORT_HOME": str(base / "home")}
    api = start_api(base, env, name="secure-api")
    yield SecureStack(api, distributed_stack, tokens, tokens_file)
    api.stop()


@pytest.fixture()
def stub(secure_stack):
    from fxport.v1 import conversion_pb2_grpc as pb_grpc

    with grpc.insecure_channel(secure_stack.address) as ch:
        yield pb_grpc.ConversionServiceStub(ch)
