"""Packaging: every code folder is in the distribution, the API contract (.proto) ships in
the wheel, and the role split holds."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
MAPPING = {"fxport": "fxport", "service": "fxport.service", "workers": "fxport.workers", "client": "fxport.client",
           "cli": "fxport.cli"}


def test_every_package_folder_is_listed_in_pyproject() -> None:
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = set()
    for top, name in MAPPING.items():
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / top)
            found.add(".".join([name, *rel.parts]) if rel.parts else name)
    assert found - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"


def test_torch_is_pinned_exactly() -> None:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["engine"]
    assert "torch==2.13.0" in deps


def test_the_wheel_ships_the_proto_files_under_an_import_root(tmp_path) -> None:
    """`grpcurl -import-path …/fxport/proto -proto fxport/v1/conversion.proto` and other
    languages' protoc need the .proto files at their import paths (as under proto/ here)."""
    from grpc_tools import protoc

    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for top in ("fxport", "service", "workers", "client", "cli", "proto"):
        shutil.copytree(ROOT / top, src / top, ignore=shutil.ignore_patterns("__pycache__"))
    # setuptools' own build backend in this interpreter: no network, no isolated build env
    build = "import sys; from setuptools import build_meta; print(build_meta.build_wheel(sys.argv[1]))"
    res = subprocess.run([sys.executable, "-c", build, str(tmp_path / "dist")], cwd=src, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-4000:]
    installed = tmp_path / "installed"
    with zipfile.ZipFile(tmp_path / "dist" / res.stdout.strip().splitlines()[-1]) as wheel:
        wheel.extractall(installed)
    protos = sorted(str(p.relative_to(ROOT / "proto")) for p in (ROOT / "proto").rglob("*.proto"))
    shipped = sorted(str(p.relative_to(installed / "fxport" / "proto"))
                     for p in (installed / "fxport" / "proto").rglob("*") if p.is_file())
    assert protos and shipped == protos
    for rel in protos:
        assert (installed / "fxport" / "proto" / rel).read_bytes() == (ROOT / "proto" / rel).read_bytes()
        # protoc resolves it from there, imports included (grpcio-tools bundles google/protobuf/*)
        include = Path(protoc.__file__).parent / "_proto"
        assert protoc.main(["protoc", f"-I{installed / 'fxport' / 'proto'}", f"-I{include}",
                            f"--descriptor_set_out={tmp_path / 'set.pb'}", rel]) == 0, rel
    # the same package data mechanism ships report.html's templates (fxport/report/templates)
    report = ROOT / "fxport" / "report"
    templates = sorted(str(p.relative_to(report)) for p in (report / "templates").rglob("*") if p.is_file())
    assert "templates/page.html.j2" in templates and "templates/sections/graph.html.j2" in templates
    assert all((installed / "fxport" / "report" / t).read_bytes() == (report / t).read_bytes() for t in templates)
