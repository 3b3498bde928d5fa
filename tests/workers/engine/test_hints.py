"""A failed load or forward gets the hint for what actually went wrong (workers/engine/load.py,
`hint_for`), each shown here with a real model file that fails that way: a torch.package that mocks
a module the model uses, one that externs a module nobody installed, a .pt2 another torch wrote, a
model run at the wrong shape, and a model that starts a process, which the sandbox refuses."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap
import warnings
import zipfile
from pathlib import Path

import pytest
import torch

from fxport.errors import InvalidInput
from fxport.spec import parse_spec
from fxport.workers.engine.load import LOAD_HINT, SANDBOX_HINT, SHAPES_HINT, hint_for, load_model
from fxport.workers.engine.pipeline import convert
from tests.client.packaged import UNTRACEABLE, package_model

FXPORT = [sys.executable, "-m", "fxport.cli"]
VERSION_WORDS = "made by"  # the version hint's words: no other hint may say them

HELPERS = 'KEY = "scale"\n\n\ndef factor():\n    return 2.0\n'
# Hashed when it is unpickled (its __setstate__ puts it in a dict), and its __hash__ reads the helpers
# module: with that module mocked, torch.package raises NotImplementedError "... used in __hash__".
HASHED_MODEL = '''
import torch
import {helpers}


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def __hash__(self):
        return hash({helpers}.KEY)

    def __setstate__(self, state):
        super().__setstate__(state)
        {{self: "registered"}}

    def forward(self, x):
        return self.fc(x) * {helpers}.factor()
'''


def _package(folder: Path, name: str, helpers: str, action: str) -> Path:
    """folder/NAME.pkg of HASHED_MODEL, its helpers module `action`ed (mock, extern); afterwards
    neither module can be imported by name (their folder leaves sys.path)."""
    from torch.package import PackageExporter

    folder.mkdir(parents=True)
    (folder / f"{helpers}.py").write_text(HELPERS)
    (folder / f"{name}.py").write_text(HASHED_MODEL.format(helpers=helpers))
    sys.path.insert(0, str(folder))
    try:
        model = importlib.import_module(name).Model()
        with PackageExporter(str(folder / f"{name}.pkg")) as exporter, warnings.catch_warnings():
            warnings.filterwarnings("ignore", "TypedStorage is deprecated")  # torch.package's own call
            exporter.extern("torch.**")
            exporter.intern(name)
            getattr(exporter, action)(helpers)
            exporter.save_pickle("model", "model.pkl", model)
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop(name, None)
        sys.modules.pop(helpers, None)
    return folder / f"{name}.pkg"


def _load_error(path: Path) -> InvalidInput:
    with pytest.raises(InvalidInput) as info:
        load_model(path)
    assert info.value.stage == "load"
    return info.value


def test_a_mocked_module_the_model_uses_when_loaded_says_to_intern_or_extern_it(tmp_path: Path) -> None:
    err = _load_error(_package(tmp_path / "mocked", "hashed_mocked", "hint_helpers_m", "mock"))
    assert "was mocked out during packaging but it is being used in __hash__" in err.message
    assert err.hint is not None and err.hint.startswith(
        "the package mocks module hint_helpers_m, which the model uses when it is loaded (hint_helpers_m.KEY): "
        "save it with exporter.intern('hint_helpers_m')"), err.hint
    assert "exporter.extern('hint_helpers_m')" in err.hint and VERSION_WORDS not in err.hint


def test_an_externed_module_that_is_not_installed_says_to_intern_it(tmp_path: Path) -> None:
    err = _load_error(_package(tmp_path / "externed", "hashed_externed", "hint_helpers_e", "extern"))
    assert "ModuleNotFoundError: No module named 'hint_helpers_e'" in err.message
    assert err.hint is not None and "imports module hint_helpers_e when it is loaded" in err.hint, err.hint
    assert "exporter.intern('hint_helpers_e')" in err.hint and VERSION_WORDS not in err.hint


def test_a_pt2_another_torch_wrote_says_which(tmp_path: Path) -> None:
    """A .pt2 whose program says it is in export schema 99, from torch 9.0.0 (torch.export.load words
    it as a bare RuntimeError; the hint reads the archive's own record)."""
    ours = tmp_path / "ours.pt2"
    torch.export.save(torch.export.export(torch.nn.Linear(4, 4), (torch.randn(2, 4),)), str(ours))
    future = tmp_path / "future.pt2"
    with zipfile.ZipFile(ours) as src, zipfile.ZipFile(future, "w") as dst:
        for info in src.infolist():
            data = src.read(info.filename)
            if info.filename.endswith("models/model.json"):
                program = json.loads(data)
                program["schema_version"]["major"], program["torch_version"] = 99, "9.0.0"
                data = json.dumps(program).encode()
            dst.writestr(info, data)
    err = _load_error(future)
    ours_version = torch.__version__.split("+")[0]
    assert err.hint == (f"the archive was made by torch 9.0.0 (export schema 99.{program['schema_version']['minor']}), "
                        f"which this worker's torch {ours_version} cannot read: save it again with torch "
                        f"{ours_version}, or convert it where the torch it was made with is installed")
    load_model(ours)  # the same archive as this torch wrote it loads


def test_a_wrong_input_shape_says_to_check_spec_inputs(tmp_path: Path) -> None:
    model = package_model(UNTRACEABLE, "hint_linear", tmp_path)  # its forward starts with Linear(4, 4)
    spec = parse_spec({"inputs": [{"name": "x", "shape": [2, 5]}], "targets": ["torchscript"]})
    with pytest.raises(InvalidInput) as info:
        convert(model, spec, tmp_path / "out")
    assert info.value.stage == "capture" and "mat1 and mat2 shapes cannot be multiplied" in info.value.message
    assert info.value.hint == SHAPES_HINT


MOCKED_IN_FORWARD = '''
import torch
import {helpers}


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x) * {helpers}.factor()
'''


def test_a_mocked_module_the_forward_uses_is_named_with_when(tmp_path: Path) -> None:
    folder = tmp_path / "src"
    folder.mkdir()
    (folder / "hint_helpers_f.py").write_text(HELPERS)
    source = MOCKED_IN_FORWARD.format(helpers="hint_helpers_f")
    sys.path.insert(0, str(folder))
    try:
        from torch.package import PackageExporter

        (folder / "hint_forward.py").write_text(source)
        model = importlib.import_module("hint_forward").Model()
        with PackageExporter(str(tmp_path / "forward.pkg")) as exporter, warnings.catch_warnings():
            warnings.filterwarnings("ignore", "TypedStorage is deprecated")
            exporter.extern("torch.**")
            exporter.intern("hint_forward")
            exporter.mock("hint_helpers_f")
            exporter.save_pickle("model", "model.pkl", model)
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop("hint_forward", None)
        sys.modules.pop("hint_helpers_f", None)
    spec = parse_spec({"inputs": [{"name": "x", "shape": [2, 4]}], "targets": ["torchscript"]})
    with pytest.raises(InvalidInput) as info:
        convert(tmp_path / "forward.pkg", spec, tmp_path / "out")
    assert info.value.hint is not None and info.value.hint.startswith(
        "the package mocks module hint_helpers_f, which the model uses when it runs (hint_helpers_f.factor)"), \
        info.value.hint


# -- in the sandbox: a model that starts a process ----------------------------------------------------

SPAWNS = textwrap.dedent('''
    import subprocess
    import torch
    from torch import nn


    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            subprocess.run(["true"], check=True)  # the sandbox refuses the new process
            return self.fc(x)
''')

COMPILES = textwrap.dedent('''
    import torch
    from torch import nn


    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return _compiled(self.fc, x)


    @torch.compile  # inductor compiles C++ for the CPU: it starts a compiler process
    def _compiled(fc, x):
        return torch.relu(fc(x)) * 2
''')


def _convert_in_sandbox(model: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """`fxport convert` as a user runs it: the model in the sandbox."""
    return subprocess.run([*FXPORT, "convert", str(model), "--input", "x:2,4", "-t", "onnx", "--out",
                           str(tmp_path / "o")], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "COLUMNS": "400"})


def _says_the_sandbox_refused(proc: subprocess.CompletedProcess[str]) -> None:
    assert proc.returncode == 2, proc.stderr  # the model cannot run here: the inputs it was given, not a bug
    error = proc.stderr[proc.stderr.index("fxport convert: error during capture:"):]
    assert "[Errno 11] Resource temporarily unavailable" in error or "[Errno 1] Operation not permitted" in error
    assert " ".join(error.split()).endswith(f"— {SANDBOX_HINT}"), error
    assert SHAPES_HINT not in error


def test_a_model_that_starts_a_process_is_told_the_sandbox_forbids_it(tmp_path: Path) -> None:
    _says_the_sandbox_refused(_convert_in_sandbox(package_model(SPAWNS, "hint_spawns", tmp_path / "src"), tmp_path))


@pytest.mark.slow  # inductor's compile of the graph before it fails: ~12 s on 2 cores, in a cold sandbox
def test_a_model_that_calls_torch_compile_is_told_the_sandbox_forbids_it(tmp_path: Path) -> None:
    proc = _convert_in_sandbox(package_model(COMPILES, "hint_compiles", tmp_path / "src"), tmp_path)
    _says_the_sandbox_refused(proc)
    assert "InductorError" in proc.stderr


@pytest.mark.parametrize("words, op", [
    ("Unknown builtin op: torchvision::nms.\nCould not find any similar ops", "torchvision::nms"),  # torch.jit.load
    ("'_OpNamespace' 'torchvision' object has no attribute 'roi_align'", "torchvision::roi_align"),  # a graph's call
    ("We failed to resolve torch.ops.torchvision.roi_align.default to an operator.", "torchvision::roi_align"),
])
def test_a_custom_op_no_library_registers_is_named_with_the_setting(words: str, op: str) -> None:
    """Each way torch says an op is unknown (tests/workers/test_op_libraries.py: with a real library)."""
    hint = hint_for(RuntimeError(words), LOAD_HINT)
    assert hint is not None and f"calls the custom op {op}, which no loaded op library registers" in hint
    assert "FXPORT_OP_LIBRARIES" in hint
    assert hint_for(RuntimeError("Unknown type annotation"), LOAD_HINT) == LOAD_HINT
