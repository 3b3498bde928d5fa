"""Session fixtures: real servers on free loopback ports, started once, stopped by PID.

- `redis_server`: redis-server (no persistence) on its own port.
- `s3_server`: SeaweedFS `weed mini` with credentials (auth on) and a bucket; its AWS_*
  variables are put in this process's environment so boto3 clients here find it.
- `distributed_stack`: `fxport serve --broker redis --store s3` + Celery workers for the
  cpu (prefork) and gpu (solo) queues, all subprocesses.
- `embedded_server`: `fxport serve` with no mode flags in a temp FXPORT_HOME.
- `tiny_pt2` / `resnet18_pt2`: corpus models saved as torch.export archives.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.fixtures.servers import (
    start_api, start_distributed, start_redis, start_seaweed,
)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    server = start_redis(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    server = start_seaweed(tmp_path_factory.mktemp("seaweed"))
    saved = {k: os.environ.get(k) for k in server.env()}
    os.environ.update(server.env())
    yield server
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    server.stop()


@pytest.fixture(scope="session")
def distributed_stack(tmp_path_factory, redis_server, s3_server):
    stack = start_distributed(tmp_path_factory.mktemp("stack"), redis_server, s3_server)
    yield stack
    stack.stop()


@pytest.fixture(scope="session")
def embedded_server(tmp_path_factory):
    base = tmp_path_factory.mktemp("embedded")
    # Result-cache lookups off: tests must not answer each other's jobs (tests/service/test_cache.py tests them).
    server = start_api(base, {"FXPORT_HOME": str(base / "home"), "FXPORT_SANDBOX_THREADS": "1",
                              "FXPORT_CACHE_ENABLED": "false"}, name="embedded")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny_pt2(tmp_path_factory) -> Path:
    from tests.fixtures.models import save_pt2

    return save_pt2("tiny_linear", tmp_path_factory.mktemp("models") / "tiny_linear.pt2")


@pytest.fixture(scope="session")
def resnet18_pt2(tmp_path_factory) -> Path:
    from tests.fixtures.models import save_pt2

    return save_pt2("resnet18", tmp_path_factory.mktemp("models") / "resnet18.pt2")
