"""The rooms and who may import whom; the API server and the client never import the ML stack,
the client not even the server stack.

Rooms (top-level folders, import names under `fxport.`):

    core     fxport/    records, stores, spec, errors, the API-worker contract (fxport.*)
    client   client/    the gRPC client library (fxport.client)
    service  service/   the API server (fxport.service)
    workers  workers/   Celery tasks, the embedded pool, sandbox and engine (fxport.workers)
    cli      cli/       the `fxport` command line (fxport.cli)

The core imports no other room; the client, the API and the workers import the core only (and
their own room); the CLI may import any room. Every import statement of every .py file counts:
at the top or inside a function, `import x` and `from x import y`, relative ones, and
importlib.import_module("...") / __import__("...") with a literal name.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ML_STACK = {"torch", "onnx", "onnxruntime", "tensorrt", "onnxscript", "transformers"}
FORBIDDEN_IN_SERVICE_AND_CLIENT = ML_STACK
# The client is what CI pipelines install: no server stack either (no Celery, Redis or S3 client).
FORBIDDEN_IN_CLIENT = ML_STACK | {"celery", "kombu", "redis", "boto3", "botocore"}

ROOM_FOLDERS = {"core": "fxport", "client": "client", "service": "service", "workers": "workers", "cli": "cli"}
# The import name each room's folder is installed as (pyproject.toml, [tool.setuptools] package-dir).
ROOM_PACKAGES = {"core": "fxport", "client": "fxport.client", "service": "fxport.service",
                 "workers": "fxport.workers", "cli": "fxport.cli"}
ALL_ROOMS = frozenset(ROOM_FOLDERS)
ALLOWED = {
    "core": frozenset({"core"}),
    "client": frozenset({"core", "client"}),
    "service": frozenset({"core", "service"}),
    "workers": frozenset({"core", "workers"}),
    "cli": ALL_ROOMS,
}
# Known wrong arrows in code this test's author could not change, as "path:imported.module". Each
# entry is a debt: move the code so the arrow goes away, then delete the entry (a stale entry fails
# test_the_allowlist_holds_only_arrows_that_still_exist).
KNOWN_VIOLATIONS: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Import:
    path: Path
    line: int
    module: str  # absolute, as Python resolves it


def module_name(path: Path, root: Path, package: str) -> str:
    """The import name of `path`, a file of the folder `root` installed as `package`."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([package, *parts])


def _resolve_relative(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _literal_import(node: ast.Call) -> str | None:
    """The module named by importlib.import_module("x") / import_module("x") / __import__("x")."""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if name not in ("import_module", "__import__") or not node.args:
        return None
    first = node.args[0]
    return first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else None


def imports_of(path: Path, importer: str = "") -> list[Import]:
    """Every import in `path`. `importer` (its import name) resolves relative imports. `from fxport
    import x` counts as importing fxport.x: fxport's submodules live in different rooms."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    out: list[Import] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [Import(path, node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = (node.module or "") if node.level == 0 else _resolve_relative(node, importer, is_package)
            if module == "fxport":
                out += [Import(path, node.lineno, f"fxport.{alias.name}") for alias in node.names]
            else:
                out.append(Import(path, node.lineno, module))
        elif isinstance(node, ast.Call) and (literal := _literal_import(node)) is not None:
            out.append(Import(path, node.lineno, literal))
    return out


def imported_modules(path: Path) -> set[str]:
    return {imp.module for imp in imports_of(path)}


def room_of(module: str) -> str | None:
    """The room an import name belongs to; None outside fxport (the standard library, third parties)
    and for fxport.proto (the .proto files: data, no code)."""
    if module != "fxport" and not module.startswith("fxport."):
        return None
    if module == "fxport.proto" or module.startswith("fxport.proto."):
        return None
    for room, package in ROOM_PACKAGES.items():
        if room != "core" and (module == package or module.startswith(package + ".")):
            return room
    return "core"


def room_files(room: str, repo: Path = REPO) -> list[tuple[Path, str]]:
    """(file, its import name) for every .py file of the room."""
    root = repo / ROOM_FOLDERS[room]
    return [(path, module_name(path, root, ROOM_PACKAGES[room])) for path in sorted(root.rglob("*.py"))]


def wrong_arrows(repo: Path = REPO) -> list[str]:
    """'path:line: room → other room (module)' for every import of a room outside what it may import."""
    out = []
    for room in ROOM_FOLDERS:
        for path, name in room_files(room, repo):
            for imp in imports_of(path, name):
                target = room_of(imp.module)
                if target is not None and target not in ALLOWED[room]:
                    rel = path.relative_to(repo)
                    out.append(f"{rel}:{imp.line}: {room} → {target} ({imp.module})")
    return out


def _known(arrow: str) -> bool:
    path, _, rest = arrow.partition(":")
    module = rest.rsplit("(", 1)[1].rstrip(")")
    return f"{path}:{module}" in KNOWN_VIOLATIONS


# ---------------------------------------------------------------------------------------
# The rooms
# ---------------------------------------------------------------------------------------


def test_every_room_imports_only_the_rooms_it_may():
    offenders = [arrow for arrow in wrong_arrows() if not _known(arrow)]
    allowed = "; ".join(f"{room} → {', '.join(sorted(ALLOWED[room]))}" for room in ROOM_FOLDERS)
    assert not offenders, f"imports across rooms that are not allowed ({allowed}):\n" + "\n".join(offenders)


def test_the_allowlist_holds_only_arrows_that_still_exist():
    present = {f"{arrow.partition(':')[0]}:{arrow.rsplit('(', 1)[1].rstrip(')')}" for arrow in wrong_arrows()}
    assert KNOWN_VIOLATIONS <= present, f"fixed: remove from KNOWN_VIOLATIONS: {sorted(KNOWN_VIOLATIONS - present)}"


def test_the_rooms_check_would_catch_a_wrong_arrow(tmp_path):
    """A planted import of each kind in a copy of the rooms' layout: every one is found, by file
    and line; the CLI importing everything is not."""
    for folder in ROOM_FOLDERS.values():
        (tmp_path / folder).mkdir()
    (tmp_path / "fxport" / "ok.py").write_text("import json\nfrom fxport.spec import JobSpec\n")
    (tmp_path / "fxport" / "bad.py").write_text("def f():\n    from fxport.workers.jobs import execute_job\n")
    (tmp_path / "service" / "server.py").write_text(
        "import fxport.config\n"
        "def pool():\n"
        "    from fxport.workers import embedded\n"
        "    import importlib\n"
        "    return importlib.import_module('fxport.workers.tasks')\n"
    )
    (tmp_path / "client" / "__init__.py").write_text("from fxport import cli\nfrom . import client\n")
    (tmp_path / "client" / "client.py").write_text("from ..service import auth\n")
    (tmp_path / "workers" / "tasks.py").write_text("from fxport.service.dispatch import Dispatcher\n")
    (tmp_path / "cli" / "commands.py").write_text(
        "import fxport.service.server, fxport.workers.tasks, fxport.client\nfrom fxport import service\n"
    )
    found = wrong_arrows(tmp_path)
    assert "fxport/bad.py:2: core → workers (fxport.workers.jobs)" in found
    assert "service/server.py:3: service → workers (fxport.workers)" in found
    assert "service/server.py:5: service → workers (fxport.workers.tasks)" in found
    assert "client/__init__.py:1: client → cli (fxport.cli)" in found
    assert "client/client.py:1: client → service (fxport.service)" in found
    assert "workers/tasks.py:1: workers → service (fxport.service.dispatch)" in found
    assert not [arrow for arrow in found if arrow.startswith(("cli/", "fxport/ok.py"))], found
    assert not [arrow for arrow in found if arrow.endswith("(fxport.client)")], found  # its own room


def test_room_of_names_each_room():
    assert room_of("fxport") == room_of("fxport.jobs") == room_of("fxport.v1.conversion_pb2") == "core"
    assert room_of("fxport.client.errors") == "client" and room_of("fxport.cli") == "cli"
    assert room_of("fxport.clientele") == "core"  # a prefix of a name is not the room
    assert room_of("fxport.service") == "service" and room_of("fxport.workers.engine.pipeline") == "workers"
    assert room_of("grpc") is None and room_of("fxportx") is None and room_of("fxport.proto.fxport.v1") is None


# ---------------------------------------------------------------------------------------
# Heavy packages
# ---------------------------------------------------------------------------------------


def _forbidden_imports(folders: tuple[str, ...], forbidden: set[str]) -> list[str]:
    offenders = []
    for folder in folders:
        for path in sorted((REPO / folder).rglob("*.py")):
            for imp in imports_of(path):
                if imp.module.split(".")[0] in forbidden:
                    offenders.append(f"{path.relative_to(REPO)}:{imp.line}: import {imp.module}")
    return offenders


def test_service_and_client_sources_do_not_import_the_ml_stack():
    offenders = _forbidden_imports(("service", "client"), FORBIDDEN_IN_SERVICE_AND_CLIENT)
    assert not offenders, "\n".join(offenders)


def test_client_sources_import_neither_the_ml_nor_the_server_stack():
    offenders = _forbidden_imports(("client",), FORBIDDEN_IN_CLIENT)
    assert not offenders, "\n".join(offenders)


def test_the_static_check_would_catch_an_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    import torch.nn as nn\n    from onnx import helper\n"
                   "    import importlib\n    importlib.import_module('celery')\n")
    assert {"torch.nn", "onnx", "celery"} <= imported_modules(bad)


def test_client_only_environment_imports_no_heavy_package():
    code = (
        "import sys, json\n"
        "import fxport.client, fxport.cli\n"
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
        "from fxport.cli.server import create_server\n"
        f"srv, port = create_server(Settings(home={str(tmp_path)!r}, listen='127.0.0.1:0'))\n"
        "srv.start(); srv.stop(0)\n"
        "print(json.dumps([m for m in ('torch', 'onnx', 'onnxruntime', 'tensorrt') if m in sys.modules]))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout.strip().splitlines()[-1]) == []
