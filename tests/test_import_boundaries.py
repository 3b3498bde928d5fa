"""The API server and the client never import the ML stack; the client not even the server stack."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FORBIDDEN_IN_SERVICE_AND_CLIENT = {"torch", "onnx", "onnxruntime", "tensorrt", "onnxscript", "transformers"}


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


def test_service_and_client_sources_do_not_import_the_ml_stack():
    offenders = []
    for folder in ("service", "client"):
        for path in sorted((REPO / folder).rglob("*.py")):
            for mod in imported_modules(path):
                if mod.split(".")[0] in FORBIDDEN_IN_SERVICE_AND_CLIENT:
                    offenders.append(f"{path.relative_to(REPO)}: import {mod}")
    assert not offenders, "\n".join(offenders)


def test_the_static_check_would_catch_an_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    import torch.nn as nn\n    from onnx import helper\n")
    assert {"torch.nn", "onnx"} <= imported_modules(bad)


def test_client_only_environment_imports_no_heavy_package():
    code = (
        "import sys, json\n"
        "import fxport.client, fxport.client.cli\n"
        "from fxport.client import Client\n"
        "Client('127.0.0.1:1').close()\n"
        "heavy = ['torch', 'celery', 'onnx', 'onnxruntime', 'boto3', 'botocore', 'redis', 'kombu', 'tensorrt']\n"
        "print(json.dumps([m for m in heavy if m in sys.modules]))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout.strip().splitlines()[-1]) == []


def test_embedded_api_server_imports_no_ml_stack(tmp_path):
    code = (
        "import sys, json\n"
        "from fxport.config import Settings\n"
        "from fxport.service.server import create_server\n"
        f"srv, port = create_server(Settings(home={str(tmp_path)!r}, listen='127.0.0.1:0'))\n"
        "srv.start(); srv.stop(0)\n"
        "print(json.dumps([m for m in ('torch', 'onnx', 'onnxruntime', 'tensorrt') if m in sys.modules]))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout.strip().splitlines()[-1]) == []
