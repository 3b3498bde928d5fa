"""Object keys (docs/architecture.md): {tenant}/inputs/{sha256}, {tenant}/jobs/{job_id}/{name}.

Keys are built only by the key builders here, from ids that match strict patterns: no
user-supplied text ever becomes a path component unchecked (InvalidKey otherwise).
"""

from __future__ import annotations

import re

from fxport.storage.errors import InvalidKey

TENANT_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
JOB_ID_RE = re.compile(r"^[0-9a-z]{26}$")  # a lowercase ULID (fxport.jobs.new_job_id)
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_SEGMENT_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+-]{0,127}$")
MAX_NAME_SEGMENTS = 4


def _check(pattern: re.Pattern[str], value: str, what: str) -> str:
    if not isinstance(value, str) or not pattern.match(value):
        raise InvalidKey(f"invalid {what} {value!r}: must match {pattern.pattern}", stage="upload")
    return value


def check_artifact_name(name: str) -> str:
    """A relative artifact path: 1-4 segments of [A-Za-z0-9_.+-], none starting with '.'."""
    if not isinstance(name, str) or len(name) > 512:
        raise InvalidKey(f"invalid artifact name {name!r}", stage="upload")
    parts = name.split("/")
    if len(parts) > MAX_NAME_SEGMENTS or not all(_SEGMENT_RE.match(p) for p in parts):
        raise InvalidKey(
            f"invalid artifact name {name!r}: up to {MAX_NAME_SEGMENTS} '/'-separated segments of "
            "letters, digits, _ . + -, none starting with '.'",
            stage="upload",
        )
    return name


def check_tenant(tenant: str) -> str:
    """A tenant name as keys use it (InvalidKey otherwise)."""
    return _check(TENANT_RE, tenant, "tenant")


def input_key(tenant: str, sha256: str) -> str:
    return f"{_check(TENANT_RE, tenant, 'tenant')}/inputs/{_check(SHA256_RE, sha256, 'sha256')}"


def job_prefix(tenant: str, job_id: str) -> str:
    return f"{_check(TENANT_RE, tenant, 'tenant')}/jobs/{_check(JOB_ID_RE, job_id, 'job id')}/"


def artifact_key(tenant: str, job_id: str, name: str) -> str:
    return job_prefix(tenant, job_id) + check_artifact_name(name)
