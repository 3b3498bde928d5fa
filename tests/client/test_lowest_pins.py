"""The client on the oldest grpcio, grpcio-status and protobuf pyproject.toml allows (issue 22, item 14).

CI pipelines install fxport beside other gRPC clients: tritonclient[grpc] 2.73 needs protobuf < 7,
and a pin of ours that excluded it made pip downgrade tritonclient to 2.41. So the base install's
lower bounds are real: a fresh venv gets exactly those versions (and the other base dependencies
as pip resolves them), and the Python client and the CLI submit, wait, download and map errors
against a server from this environment.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import tomllib

from tests.fixtures.client_venv import client_venv

REPO = Path(__file__).resolve().parents[2]
PINNED = ("grpcio", "grpcio-status", "protobuf")

pytestmark = pytest.mark.slow


def lower_bounds() -> dict[str, str]:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    bounds = {}
    for dep in deps:
        m = re.match(r"^([A-Za-z0-9_.\-]+)\s*>=\s*([0-9][0-9.]*)", dep)
        if m and m.group(1) in PINNED:
            bounds[m.group(1)] = m.group(2)
    assert set(bounds) == set(PINNED), f"pyproject.toml has no >= lower bound for some of {PINNED}: {deps}"
    return bounds


def other_base_dependencies() -> list[str]:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    return [d for d in deps if re.split(r"[<>=~!\[ ;]", d, maxsplit=1)[0] not in PINNED]


@pytest.fixture(scope="module")
def low_python(tmp_path_factory) -> Path:
    """A venv with the lowest pins and the client's source on its path (the package folders mapped
    as pyproject.toml maps them: fxport/, client/ as fxport.client, cli/ as fxport.cli), without the engine
    or server."""
    python = client_venv(tmp_path_factory.mktemp("lowest-pins"))
    pins = [f"{name}=={version}" for name, version in lower_bounds().items()]
    proc = subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                           *pins, *other_base_dependencies()], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return python


def test_the_venv_has_exactly_the_lowest_pins(low_python) -> None:
    out = subprocess.run([str(low_python), "-c", "import importlib.metadata as m, json; print(json.dumps("
                          f"{{n: m.version(n) for n in {list(PINNED)!r}}}))"],
                         capture_output=True, text=True, timeout=60, check=True, cwd=low_python.parent)
    assert json.loads(out.stdout) == lower_bounds()


def test_the_client_converts_downloads_and_maps_errors_on_the_lowest_pins(low_python, embedded_server, tiny_pt2,
                                                                           tmp_path) -> None:
    script = f"""
import json, sys, warnings
warnings.simplefilter("error")  # no deprecation or gencode-version warning either
from fxport.client import Client, JobNotFound
with Client({embedded_server.address!r}) as c:
    job = c.submit({str(tiny_pt2)!r}, {{"targets": ["onnx"], "outputs": ["y"]}})
    job.wait(timeout=240, download_to={str(tmp_path / "out")!r})
    try:
        c.get("01arz3ndektsv4rrffq69g5fav")  # a well-formed id no job has
        missing = None
    except JobNotFound as exc:
        missing = type(exc).__name__
print(json.dumps({{"state": job.state, "downloaded": sorted(p.name for p in job.downloaded or []),
                  "missing": missing}}))
"""
    # run from elsewhere: the repo's own folder on sys.path would shadow the mapped package
    proc = subprocess.run([str(low_python), "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": ""}, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    assert doc["state"] == "SUCCEEDED" and "model.onnx" in doc["downloaded"], doc
    assert doc["missing"] == "JobNotFound"  # a gRPC status mapped to the client's error

    # the CLI too: a spec error refused by name, before any upload
    cli = subprocess.run([str(low_python), "-m", "fxport.cli", "submit", str(tiny_pt2), "--target", "nope",
                          "--server", embedded_server.address, "--json"],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": ""},
                         cwd=tmp_path)
    assert cli.returncode == 2 and "targets" in cli.stdout + cli.stderr, (cli.stdout, cli.stderr)
