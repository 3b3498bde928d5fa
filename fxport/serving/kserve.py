"""A KServe InferenceService (serving.kserve.io/v1beta1) that serves a Triton model repository
fxport wrote, from the object store: KServe's storage initializer copies `storageUri` into the
pod and its Triton runtime (`kserve-tritonserver`) serves every model in it.

Resources come from the repository: a GPU when any model runs on KIND_GPU, and memory for the
model files (three times their size, plus 1 GiB for the server: the runtime holds a copy per
instance and its own arenas). They are requests to review, not measurements (docs/serving.md).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from fxport.serving.triton import PackageError, model_config_class, parse_config

DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
S3_URI = re.compile(r"^(s3|gs)://[a-z0-9][a-z0-9.-]{1,62}(/[^\s]*)?$")


def repository_models(repo: Path) -> list[Any]:
    """The parsed config of every model folder in `repo`."""
    cls = model_config_class()
    configs = [parse_config(p.read_text(), cls, p.parent.name) for p in sorted(repo.glob("*/config.pbtxt"))]
    if not configs:
        raise PackageError(f"{repo} holds no model folder with a config.pbtxt: give the folder "
                           "`fxport package triton --out` wrote (or a job's triton/ folder)", field="repository")
    return configs


def storage_uri(store: str, tenant: str, job_id: str) -> str:
    """Where a job's Triton repository is in the object store: `{store}/{tenant}/jobs/{job_id}/triton`."""
    return f"{store.rstrip('/')}/{tenant}/jobs/{job_id}/triton"


def inference_service(repo: Path, name: str, uri: str, *, namespace: str | None = None,
                      job_id: str | None = None, service_account: str | None = None) -> dict[str, Any]:
    if not DNS_1035.match(name):
        raise PackageError(f"--name {name[:80]!r}: an InferenceService name is lowercase letters, digits and '-', "
                           "starting with a letter (at most 63)", field="name")
    if not S3_URI.match(uri):
        raise PackageError(f"--storage-uri {uri[:120]!r}: expected s3://BUCKET/PATH (or gs://)", field="storage_uri")
    configs = repository_models(repo)
    gpu = any(g.kind == type(g).DESCRIPTOR.enum_types_by_name["Kind"].values_by_name["KIND_GPU"].number
              for c in configs for g in c.instance_group)
    model_bytes = sum(p.stat().st_size for p in repo.glob("*/[0-9]*/*") if p.is_file())
    memory_mi = 1024 + -(-3 * model_bytes // (1 << 20))
    limits: dict[str, Any] = {"cpu": "2", "memory": f"{2 * memory_mi}Mi"}
    if gpu:
        limits["nvidia.com/gpu"] = "1"
    predictor: dict[str, Any] = {
        "model": {
            "modelFormat": {"name": "triton"},
            "runtime": "kserve-tritonserver",
            "storageUri": uri,
            "resources": {"requests": {"cpu": "1", "memory": f"{memory_mi}Mi"}, "limits": limits},
        },
    }
    if service_account:
        predictor["serviceAccountName"] = service_account
    metadata: dict[str, Any] = {"name": name, "annotations": {
        "fxport.io/models": ",".join(c.name for c in configs)}}
    if job_id:
        metadata["annotations"]["fxport.io/job-id"] = job_id
    if namespace:
        metadata["namespace"] = namespace
    return {"apiVersion": "serving.kserve.io/v1beta1", "kind": "InferenceService", "metadata": metadata,
            "spec": {"predictor": predictor}}


def inference_service_yaml(service: dict[str, Any]) -> str:
    return yaml.safe_dump(service, sort_keys=False)
