"""Hostile models through the real service (authenticated API → Redis → Celery worker →
sandbox → S3): each ends FAILED naming the stage, and a marker shows nothing escaped —
no file outside the sandbox's folder, no Redis key, no credential in what comes back."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from tests.security.hostile import (
    PACKAGE_SPEC,
    env_payload,
    fork_payload,
    hostile_package,
    payload,
    redis_payload,
    tampered_pt2,
    write_payload,
)

pytestmark = pytest.mark.slow

WAIT_S = 240


@pytest.fixture(scope="module")
def hostile_jobs(secure_stack, tiny_pt2, tmp_path_factory):
    """Build every hostile model, submit them all as tenant alice (the worker runs them one by
    one meanwhile), and hand each test its job plus the markers it must not find."""
    tmp = tmp_path_factory.mktemp("hostile")
    outside = tmp_path_factory.mktemp("outside-the-sandbox")
    redis_port = secure_stack.stack.redis.port
    cases: dict[str, dict] = {}

    def case(name: str, model: Path, spec: dict, **markers) -> None:
        cases[name] = {"model": model, "spec": spec, **markers}

    key = f"fxport-escaped-{uuid.uuid4().hex}"
    markers = [outside / "pt2-marker", Path(f"/tmp/fxport-escape-{uuid.uuid4().hex}")]
    case("pt2_pickle", tampered_pt2(tiny_pt2, tmp / "evil.pt2",
                                    payload(env_payload(), write_payload(markers), redis_payload(redis_port, key))),
         {"targets": ["onnx"]}, files=markers, redis_key=key)
    case("read_env", hostile_package(tmp, "read_env", payload(env_payload())), PACKAGE_SPEC)
    key = f"fxport-escaped-{uuid.uuid4().hex}"
    case("dial_redis", hostile_package(tmp, "dial_redis", payload(redis_payload(redis_port, key))), PACKAGE_SPEC,
         redis_key=key)
    markers = [outside / "package-marker", Path(f"/tmp/fxport-escape-{uuid.uuid4().hex}")]
    case("write_outside", hostile_package(tmp, "write_outside", payload(write_payload(markers))), PACKAGE_SPEC,
         files=markers)
    marker = outside / "shell-marker"
    case("fork_bomb", hostile_package(tmp, "fork_bomb", payload(fork_payload(marker))), PACKAGE_SPEC, files=[marker])
    case("allocate", hostile_package(tmp, "allocate", "hog = [bytearray(256 << 20) for _ in range(10_000)]"),
         {**PACKAGE_SPEC, "limits": {"memory_mb": 3072}})
    case("sleep_forever", hostile_package(tmp, "sleep_forever", "import time\ntime.sleep(3600)"),
         {**PACKAGE_SPEC, "limits": {"timeout_s": 10}})

    client = secure_stack.client("alice")
    for name, c in cases.items():
        c["job"] = client.submit(c["model"], c["spec"], idempotency_key=f"hostile-{name}-{uuid.uuid4().hex[:8]}")
    yield cases
    client.close()


def finished(secure_stack, c: dict):
    job = c["job"]
    job.wait(timeout=WAIT_S)
    assert job.state == "FAILED", (job.state, job.error, secure_stack.logs())
    return job


def assert_nothing_escaped(secure_stack, c: dict, text: str) -> None:
    for secret in secure_stack.secrets():
        assert secret not in text
    for name in ("AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID", "FXPORT_BROKER_URL", "FXPORT_STORE"):
        assert name not in text
    for path in c.get("files", ()):
        assert not Path(path).exists(), f"{path} was written from inside the sandbox"
    if "redis_key" in c:
        import redis

        r = redis.Redis.from_url(secure_stack.stack.redis.url)
        assert r.exists(c["redis_key"]) == 0, "the sandbox reached Redis"
        r.close()


def error_text(job) -> str:
    return f"{job.error['message']}\n{job.error['detail']}"


def test_pt2_whose_pickle_runs_code(secure_stack, hostile_jobs):
    c = hostile_jobs["pt2_pickle"]
    job = finished(secure_stack, c)
    text = error_text(job)
    assert job.error["stage"] == "load" and "PAYLOAD RAN" in text  # the payload did run...
    assert "ENV=" in text and "environ: Permission denied" in text  # ...saw a scrubbed env, no ancestor's
    assert "WROTE" not in text and "write " in text and "cwd write ok" in text
    assert "redis blocked" in text and "REDIS REACHED" not in text
    assert_nothing_escaped(secure_stack, c, text)


def test_package_reading_the_worker_environment(secure_stack, hostile_jobs):
    c = hostile_jobs["read_env"]
    job = finished(secure_stack, c)
    text = error_text(job)
    assert job.error["stage"] == "load" and "PAYLOAD RAN" in text and "ENV=" in text
    env = text.split("ENV=", 1)[1].split(" | ", 1)[0]
    assert "FXPORT_SANDBOX=1" in env and "AWS_" not in env and "REDIS" not in env
    assert "ANCESTOR" not in text, "an ancestor's /proc/<pid>/environ was readable"
    assert_nothing_escaped(secure_stack, c, text)


def test_package_dialing_the_redis_port(secure_stack, hostile_jobs):
    c = hostile_jobs["dial_redis"]
    job = finished(secure_stack, c)
    text = error_text(job)
    assert job.error["stage"] == "load" and "redis blocked" in text and "REDIS REACHED" not in text
    assert_nothing_escaped(secure_stack, c, text)


def test_package_writing_outside_its_folder(secure_stack, hostile_jobs):
    c = hostile_jobs["write_outside"]
    job = finished(secure_stack, c)
    text = error_text(job)
    assert job.error["stage"] == "load" and "cwd write ok" in text
    assert "WROTE" not in text and text.count("Permission denied") >= 4  # 2 markers, the job dir, the input
    assert_nothing_escaped(secure_stack, c, text)


def test_package_fork_bomb(secure_stack, hostile_jobs):
    c = hostile_jobs["fork_bomb"]
    job = finished(secure_stack, c)
    text = error_text(job)
    assert job.error["stage"] == "load" and "FORK forked=0 error=" in text, text
    assert "SHELL RAN" not in text and "shell refused" in text
    assert_nothing_escaped(secure_stack, c, text)


def test_package_allocating_without_bound(secure_stack, hostile_jobs):
    job = finished(secure_stack, hostile_jobs["allocate"])
    assert job.error["stage"] == "load" and job.error["code"] == "resource_limit"
    assert "memory" in job.error["message"]


def test_package_sleeping_forever(secure_stack, hostile_jobs):
    job = finished(secure_stack, hostile_jobs["sleep_forever"])
    assert job.error["code"] == "resource_limit"
    assert "10 s wall-clock limit during load" in job.error["message"]
