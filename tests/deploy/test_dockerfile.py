"""Dockerfile + .dockerignore: hadolint clean, the three targets, non-root, venv-only final stages."""

from __future__ import annotations

import re
import subprocess

import pytest

from .conftest import REPO, find_tool

DOCKERFILE = REPO / "Dockerfile"
TARGETS = ("api", "worker-cpu", "worker-gpu")


def hadolint(path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [find_tool("hadolint"), "--no-color", "--config", str(REPO / ".hadolint.yaml"), str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )


def stages() -> dict[str, list[str]]:
    """Stage name → its instructions (continuation lines joined), in file order."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = re.match(r"FROM\s+(\S+)(?:\s+AS\s+(\S+))?", line, re.IGNORECASE)
        if match:
            current = match.group(2) or match.group(1)
            out[current] = [line]
        elif current is not None:
            out[current].append(line)
    return out


def test_hadolint_passes():
    result = hadolint(DOCKERFILE)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_is_not_toothless(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install flask\n")
    result = hadolint(bad)
    assert result.returncode != 0
    assert "DL3007" in result.stdout and "DL3013" in result.stdout


@pytest.mark.parametrize("target", TARGETS)
def test_final_stage_is_non_root_and_copies_only_the_venv(target):
    instructions = stages()[target]
    users = [i.split()[1] for i in instructions if i.startswith("USER ")]
    assert users, f"{target} has no USER"
    # numeric uid (ARG FXPORT_UID) so runAsNonRoot can verify it
    assert users[-1] == "${FXPORT_UID}:${FXPORT_UID}"
    copies = [i for i in instructions if i.startswith("COPY")]
    assert copies and all(re.fullmatch(r"COPY --from=\S+ /opt/venv /opt/venv", c) for c in copies), copies
    assert not any(i.startswith("RUN") and re.search(r"\b(pip|apt-get|gcc|make)\b", i) for i in instructions)


def test_base_images_pinned_and_torch_from_the_right_index():
    text = DOCKERFILE.read_text()
    defaults = dict(re.findall(r"^ARG (\w+)=(\S+)", text, re.MULTILINE))
    uid = int(defaults["FXPORT_UID"])
    assert uid >= 1000
    for arg in ("PYTHON_IMAGE", "TENSORRT_IMAGE"):
        image = defaults[arg]
        assert ":" in image and not image.endswith(":latest"), image
    assert defaults["TENSORRT_IMAGE"].startswith("nvcr.io/nvidia/tensorrt:")
    assert defaults["TORCH_VERSION"] == "2.13.0"
    assert defaults["TORCH_CPU_INDEX"] == "https://download.pytorch.org/whl/cpu"
    all_stages = stages()
    assert all_stages["worker-gpu"][0] == "FROM runtime-worker-gpu AS worker-gpu"
    assert all_stages["runtime-worker-gpu"][0].startswith("FROM ${TENSORRT_IMAGE}")
    assert "TORCH_CPU_INDEX" in " ".join(all_stages["build-worker-cpu"])
    assert "TORCH_CUDA_INDEX" in " ".join(all_stages["build-worker-gpu"])
    assert not any("torch" in i for i in all_stages["build-api"]), "the API image has no torch"


def test_dockerignore_is_an_allowlist_of_what_the_build_copies():
    patterns = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert patterns[0] == "*", "exclude everything, then re-include the sources"
    allowed = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    for never in (".git", ".venv", ".fxport", "tests", "bench", "deploy"):
        assert never not in allowed
    copied = set()
    for instructions in stages().values():
        for i in instructions:
            if i.startswith("COPY ") and "--from=" not in i:
                copied |= {src.rstrip("/").removeprefix("./") for src in i.split()[1:-1]}
    assert copied <= allowed, copied - allowed


def test_build_context_has_every_package_folder():
    """A new top-level package folder in pyproject.toml must reach the image too."""
    import tomllib

    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {path.split("/")[0] for path in setuptools["package-dir"].values()}
    copied = set()
    for instructions in stages().values():
        for i in instructions:
            if i.startswith("COPY ") and "--from=" not in i:
                copied |= {src.rstrip("/").removeprefix("./") for src in i.split()[1:-1]}
    assert folders <= copied, folders - copied


@pytest.mark.parametrize("target", ("worker-cpu", "worker-gpu"))
def test_worker_images_have_graphviz_for_the_report(target):
    """Workers draw report.html, whose FX graph diagrams need Graphviz's `dot`: a worker image
    without it would publish every report with 'dot is not installed' in place of the graphs."""
    all_stages = stages()
    chain, name = [], target
    while name in all_stages:
        chain.append(name)
        name = all_stages[name][0].split()[1]  # FROM <parent> AS <name>
    runs = " ".join(i for stage in chain for i in all_stages[stage] if i.startswith("RUN"))
    assert re.search(r"apt-get install -y --no-install-recommends \"graphviz=\$\{GRAPHVIZ_VERSION\}\"", runs), chain
