"""The fx_source artifact: readable module.py plus ONE weights.safetensors, loaded without any pickle.

Real corpus models go through `convert` at both IR levels (a torch.package captured with
`capture: fx` gives torch-level call_module graphs, a .pt2 gives aten-level get_attr graphs),
and an int8 job; the exporter's own rules (tied weights, modules it cannot rebuild, constants
without a literal form) are checked on small hand-made graphs.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import struct
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from fxport.digest import sha256_file
from fxport.errors import ConversionFailed
from fxport.spec import parse_spec
from fxport.workers.engine.exporters.fx_source import (
    MODULE_CLASS,
    WEIGHTS_FILE,
    FxSourceFromGraphModule,
    check_imports,
)
from fxport.workers.engine.pipeline import convert
from tests.client.packaged import package_model
from tests.models import get
from tests.workers.engine.conftest import save_package, save_pt2, spec_dict

MODELS = ("cnn_bn", "resnet18_small", "transformer_block")
LEVELS = ("torch", "aten")
FILES = {"module.py", WEIGHTS_FILE, "__init__.py"}  # __init__.py: the folder imports as a package too


def _convert(name: str, level: str, root: Path, **extra: Any) -> tuple[dict[str, Any], Path]:
    case = get(name)
    work = root / f"{name}-{level}-{extra.get('precision', 'fp32')}"
    work.mkdir()
    spec = spec_dict(case, targets=("fx_source",), verify={"atol": case.tolerance, "rtol": 1e-3, "samples": 1},
                     **({"capture": "fx"} if level == "torch" else {}), **extra)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = save_package(case, work / "model.pkg") if level == "torch" else save_pt2(case, work / "model.pt2")
        manifest = convert(model, parse_spec(spec), work / "out", report=False)
    return manifest, work / "out" / "fx_source"


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], tuple[dict[str, Any], Path]]:
    """Every corpus model at both levels, passes off: the file then holds exactly the model's tensors."""
    root = tmp_path_factory.mktemp("fx_source")
    return {(name, level): _convert(name, level, root, passes=[]) for name in MODELS for level in LEVELS}


@pytest.fixture(scope="module")
def int8_job(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    return _convert("cnn_bn", "aten", tmp_path_factory.mktemp("fx_source_int8"), precision="int8",
                    quantization={"calibration": {"samples": 8}})


def _header(path: Path) -> tuple[dict[str, Any], int]:
    """safetensors: u64 header length, the JSON header, then the data. Returns (entries, header length)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    entries = json.loads(raw[8:8 + n])
    entries.pop("__metadata__", None)
    return entries, n


def _model_bytes(model: nn.Module) -> int:
    unique = {(t.untyped_storage().data_ptr(), t.storage_offset(), t.dtype, tuple(t.shape)): t
              for t in model.state_dict(keep_vars=True).values()}
    return sum(t.numel() * t.element_size() for t in unique.values())


def _load_class(folder: Path, mod_name: str) -> type:
    spec = importlib.util.spec_from_file_location(mod_name, folder / "module.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    writes, sys.dont_write_bytecode = sys.dont_write_bytecode, True
    try:
        spec.loader.exec_module(module)
    finally:
        sys.dont_write_bytecode = writes
    return getattr(module, MODULE_CLASS)


# ---------------------------------------------------------------------------------------------
# Through the pipeline
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("name", MODELS)
def test_folder_is_source_plus_one_safetensors_file(converted, name: str, level: str) -> None:
    manifest, folder = converted[(name, level)]
    assert manifest["status"] == "succeeded"
    assert manifest["capture"]["level"] == level
    assert {p.name for p in folder.iterdir()} == FILES
    assert sorted(a["path"] for a in manifest["artifacts"]) == sorted(f"fx_source/{f}" for f in FILES)
    [record] = manifest["verification"]
    assert record["format"] == "fx_source" and record["passed"], record
    source = (folder / "module.py").read_text()
    unpickling = re.findall(r"\btorch\.load\(|\bpickle\.|import pickle|weights_only|\.pt['\"]", source)
    assert not unpickling, unpickling
    assert f"class {MODULE_CLASS}(torch.nn.Module)" in source and "safetensors.torch.load_file(" in source
    if level == "torch":  # call_module leaves come back as constructor calls, not as pickles
        assert "torch.nn.Linear(" in source
        if get(name).has_batchnorm:
            assert "torch.nn.Conv2d(" in source and "torch.nn.BatchNorm2d(" in source
    else:  # aten level: no module is called, every tensor is a get_attr of the top module
        assert "torch.nn.Linear(" not in source and "torch.nn.Parameter(torch.empty(" in source


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("name", MODELS)
def test_each_tensor_is_stored_once(converted, name: str, level: str) -> None:
    _, folder = converted[(name, level)]
    path = folder / WEIGHTS_FILE
    entries, header = _header(path)
    data = sum(e["data_offsets"][1] - e["data_offsets"][0] for e in entries.values())
    assert path.stat().st_size == 8 + header + data  # nothing in the file but the header and these tensors
    expected = _model_bytes(get(name).build())
    # passes off: the graph holds the model's own tensors, less BatchNorm's num_batches_tracked counters
    # (8 bytes each) that the aten graph never reads; state_dict.pt + pickled submodules held them twice
    assert expected - 8 * 32 <= data <= expected, (data, expected)


def test_int8_job_writes_int8_weights_and_verifies(int8_job) -> None:
    manifest, folder = int8_job
    assert manifest["status"] == "succeeded"
    [record] = manifest["verification"]
    assert record["passed"] and record["tolerances"]["precision"] == "int8", record
    assert {p.name for p in folder.iterdir()} == FILES
    entries, _ = _header(folder / WEIGHTS_FILE)
    int8 = [k for k, e in entries.items() if e["dtype"] == "I8"]
    assert int8 and all(k.endswith("weight_int8") for k in int8), entries
    assert "import torch.ao.quantization.fx._decomposed" in (folder / "module.py").read_text()


def test_loading_runs_no_pickle_in_a_fresh_interpreter(converted, int8_job, tmp_path: Path) -> None:
    """A fresh Python with torch.load and every pickle loader refusing (and an audit hook on pickle's
    global lookups) imports each artifact, builds it and runs it; the outputs match the original model."""
    from safetensors.torch import load_file, save_file

    jobs = {f"{name}-{level}": (name, folder) for (name, level), (_, folder) in converted.items()}
    jobs["cnn_bn-int8"] = ("cnn_bn", int8_job[1])
    inputs = {key: get(name).example_inputs(3)[0] for key, (name, _) in jobs.items()}
    save_file(inputs, str(tmp_path / "inputs.safetensors"))
    folders = {key: str(folder) for key, (_, folder) in jobs.items()}
    script = textwrap.dedent(f"""
        import importlib.util, pickle, sys
        sys.dont_write_bytecode = True
        import torch, torch.serialization, safetensors.torch
        def refuse(*args, **kwargs):
            raise AssertionError("unpickling while loading the FX source")
        class Refused(pickle.Unpickler):
            def __init__(self, *args, **kwargs):
                refuse()
        torch.load = torch.serialization.load = pickle.load = pickle.loads = refuse
        pickle.Unpickler = Refused
        sys.addaudithook(lambda event, args: event == "pickle.find_class" and refuse())
        inputs = safetensors.torch.load_file({str(tmp_path / "inputs.safetensors")!r})
        outputs = {{}}
        for key, folder in {folders!r}.items():
            spec = importlib.util.spec_from_file_location("fx_" + key.replace("-", "_"), folder + "/module.py")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            model = module.{MODULE_CLASS}()
            with torch.no_grad():
                outputs[key] = model(inputs[key]).contiguous()
        safetensors.torch.save_file(outputs, {str(tmp_path / "outputs.safetensors")!r})
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    outputs = load_file(str(tmp_path / "outputs.safetensors"))
    for key, (name, _) in jobs.items():
        case = get(name)
        with torch.no_grad():
            expected = case.build()(inputs[key])
        if key.endswith("int8"):  # the int8 numbers were verified by the job; here: it loads and runs
            assert outputs[key].shape == expected.shape and torch.isfinite(outputs[key]).all()
        else:
            torch.testing.assert_close(outputs[key], expected, atol=case.tolerance, rtol=1e-3, msg=key)


# ---------------------------------------------------------------------------------------------
# The exporter's rules, on small graphs
# ---------------------------------------------------------------------------------------------

class TiedLM(nn.Module):
    """Embedding and output head share one weight; the graph also reads that weight directly."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.norm(self.emb(ids)) * self.scale
        return self.head(h), h @ self.emb.weight.t()


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(8, 12, num_layers=2, batch_first=True, bidirectional=True)
        self.attn = nn.MultiheadAttention(24, 4, batch_first=True, bias=False)
        self.odd = nn.Linear(24, 3)
        self.odd.note = "set after construction"  # state its constructor does not make: traced into the graph

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(x)
        a, _ = self.attn(h, h, h)
        return self.odd(a)


def _export_and_load(model: nn.Module, folder: Path) -> nn.Module:
    FxSourceFromGraphModule(torch.fx.symbolic_trace(model))(folder)
    assert {p.name for p in folder.iterdir()} == FILES
    return _load_class(folder, f"fx_source_{folder.name}")()


def test_tied_weights_are_stored_once_and_tied_again(tmp_path: Path) -> None:
    model = TiedLM().eval()
    loaded = _export_and_load(model, tmp_path / "tied")
    entries, _ = _header(tmp_path / "tied" / WEIGHTS_FILE)
    assert len([k for k in entries if k in ("emb.weight", "head.weight")]) == 1
    assert loaded.head.weight.data_ptr() == loaded.emb.weight.data_ptr()
    ids = torch.randint(0, 50, (2, 7))
    with torch.no_grad():
        for got, want in zip(loaded(ids), model(ids)):
            torch.testing.assert_close(got, want)
    assert not loaded.training


def test_rebuilt_and_traced_through_modules(tmp_path: Path) -> None:
    model = Recurrent().eval()
    loaded = _export_and_load(model, tmp_path / "rnn")
    source = (tmp_path / "rnn" / "module.py").read_text()
    assert "torch.nn.LSTM(8, 12, num_layers=2, batch_first=True, bidirectional=True)" in source
    assert "torch.nn.MultiheadAttention(24, 4, batch_first=True, bias=False)" in source
    assert "torch.nn.Linear(" not in source  # `odd`: its weight is a get_attr read, its forward inlined
    x = torch.randn(2, 5, 8)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x))


def test_same_graph_same_bytes(tmp_path: Path) -> None:
    """The result cache hands one job's artifacts to the next: the same graph gives the same files."""
    gm = torch.fx.symbolic_trace(TiedLM().eval())
    FxSourceFromGraphModule(gm)(tmp_path / "a")
    FxSourceFromGraphModule(gm)(tmp_path / "b")
    for name in FILES:
        assert sha256_file(tmp_path / "a" / name) == sha256_file(tmp_path / "b" / name), name


def _returning_attribute(name: str, value: Any) -> torch.fx.GraphModule:
    """A Linear's graph that also returns `self.<name>` (a get_attr of a non-tensor attribute)."""
    gm = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(4, 4)))
    setattr(gm, name, value)
    graph = gm.graph
    with graph.inserting_after(next(iter(graph.nodes))), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "get_attr Node with no underlying reference": a plain attribute, on purpose
        node = graph.get_attr(name)
    output = next(n for n in graph.nodes if n.op == "output")
    output.args = ((output.args[0], node),)
    gm.recompile()
    return gm


def test_a_constant_without_a_literal_form_fails_naming_it(tmp_path: Path) -> None:
    gm = _returning_attribute("lookup", object())
    with pytest.raises(ConversionFailed) as err:
        FxSourceFromGraphModule(gm)(tmp_path / "out")
    assert "'lookup'" in err.value.message and "builtins.object" in err.value.message
    assert err.value.stage == "export" and "capture: export" in (err.value.hint or "")


def test_a_literal_constant_is_written_as_one(tmp_path: Path) -> None:
    gm = _returning_attribute("sizes", (1, 2.5, float("inf"), torch.float16))
    FxSourceFromGraphModule(gm)(tmp_path / "out")
    loaded = _load_class(tmp_path / "out", "fx_source_literal")()
    assert loaded(torch.randn(1, 4))[1] == (1, 2.5, float("inf"), torch.float16)


def test_a_module_neither_rebuilt_nor_traceable_fails_naming_it(tmp_path: Path) -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = nn.LSTM(8, 8)
            self.rnn.note = "set after construction"  # not rebuilt; and LSTM.forward branches on its input

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.rnn(x)[0]

    with pytest.raises(ConversionFailed) as err:
        FxSourceFromGraphModule(torch.fx.symbolic_trace(Block().eval()))(tmp_path / "out")
    assert "'rnn' (LSTM)" in err.value.message and "tracing into it failed" in err.value.message
    assert err.value.stage == "export" and "capture: export" in (err.value.hint or "")


def test_transformer_layers_are_rebuilt_with_their_layer_arguments(tmp_path: Path) -> None:
    """TransformerEncoder keeps its layer (and the layer its d_model) under other names: still rebuilt."""
    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            layer = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, activation="gelu", batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(16), enable_nested_tensor=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.encoder(x)

    model = Encoder().eval()
    loaded = _export_and_load(model, tmp_path / "encoder")
    source = (tmp_path / "encoder" / "module.py").read_text()
    assert ("torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, "
            "activation=torch.nn.functional.gelu, batch_first=True), 2") in source
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x))


def test_the_runner_refuses_a_source_that_unpickles(tmp_path: Path) -> None:
    """The job's verification loads the artifact with torch.load and pickle refusing: a source that
    unpickles (even torch.load(weights_only=True)) fails verification instead of shipping."""
    from fxport.workers.engine.verify.runners import FxSourceRunner

    folder = tmp_path / "fx_source"
    folder.mkdir()
    torch.save({"w": torch.ones(2)}, folder / "w.pt")
    (folder / "module.py").write_text(textwrap.dedent(f"""
        import os
        import torch

        class {MODULE_CLASS}(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.w = torch.load(os.path.join(os.path.dirname(__file__), "w.pt"), weights_only=True)["w"]

            def forward(self, x):
                return x * self.w
    """))
    with pytest.raises(RuntimeError, match="unpickles"):
        FxSourceRunner(folder, MODULE_CLASS).activate()
    assert torch.load(folder / "w.pt", weights_only=True)["w"].sum() == 2  # put back afterwards


# ---------------------------------------------------------------------------------------------
# Functions the graph calls as leaves (torch.fx.wrap)
# ---------------------------------------------------------------------------------------------

_PAD_VALUE = 0.0  # a global the wrapped function reads: module.py gets it as a literal


def pad_to_even(x: torch.Tensor) -> torch.Tensor:
    """H and W padded up to even sizes, as torchvision's swin `_patch_merging_pad` does. The test is
    Python on sizes, which symbolic_trace cannot follow: torch.fx.wrap keeps the call a leaf."""
    height, width = x.shape[-2:]
    if height % 2 or width % 2:
        x = nn.functional.pad(x, (0, width % 2, 0, height % 2), value=_PAD_VALUE)
    return x


torch.fx.wrap("pad_to_even")


class PatchMerging(nn.Module):
    """Swin's patch merging: pad to even, then each 2x2 patch's four pixels side by side, reduced."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.reduce = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = pad_to_even(self.conv(x))
        merged = torch.cat([x[..., 0::2, 0::2], x[..., 1::2, 0::2], x[..., 0::2, 1::2], x[..., 1::2, 1::2]], dim=1)
        return self.reduce(merged.permute(0, 2, 3, 1))


def _top_level(source: str) -> tuple[set[str], list[str], list[str]]:
    """module.py's top-level function names, import statements and bare calls."""
    body = ast.parse(source).body
    return ({n.name for n in body if isinstance(n, ast.FunctionDef)},
            [ast.unparse(n) for n in body if isinstance(n, (ast.Import, ast.ImportFrom))],
            [ast.unparse(n) for n in body if isinstance(n, ast.Expr) and isinstance(n.value, ast.Call)])


def test_a_wrapped_function_is_written_at_module_level_and_imports_anywhere(tmp_path: Path) -> None:
    """pad_to_even lives in this test module, which no installed package holds: module.py carries a copy
    of its source (a `from tests... import` would fail wherever this checkout is not on sys.path) and
    its torch.fx.wrap call, both at module level. A fresh interpreter that cannot import this checkout
    imports the source, runs it (both branches) and traces it again with the function still a leaf."""
    model = PatchMerging().eval()
    gm = torch.fx.symbolic_trace(model)
    assert [n.meta.get("is_wrapped") for n in gm.graph.nodes if n.target is pad_to_even] == [True]
    folder = tmp_path / "fx_source"
    FxSourceFromGraphModule(gm)(folder)
    source = (folder / "module.py").read_text()
    functions, imports, calls = _top_level(source)
    assert "pad_to_even" in functions and "_PAD_VALUE = 0.0" in source
    assert not any("tests" in line for line in imports), imports
    [wrap] = [c for c in calls if c.startswith("torch.fx.wrap(")]
    assert "pad_to_even" in wrap

    inputs = {"odd": torch.randn(2, 3, 7, 9), "even": torch.randn(2, 3, 6, 8)}
    from safetensors.torch import load_file, save_file

    save_file(inputs, str(tmp_path / "inputs.safetensors"))
    script = textwrap.dedent(f"""
        import importlib.util, sys
        sys.dont_write_bytecode = True
        import torch, safetensors.torch
        assert importlib.util.find_spec("tests") is None, "this checkout is on sys.path"
        spec = importlib.util.spec_from_file_location("fx_wrapped", {str(folder / "module.py")!r})
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        model = module.{MODULE_CLASS}()
        inputs = safetensors.torch.load_file({str(tmp_path / "inputs.safetensors")!r})
        with torch.no_grad():
            outputs = {{key: model(x).contiguous() for key, x in inputs.items()}}
        leaves = [n for n in torch.fx.symbolic_trace(model).graph.nodes
                  if n.op == "call_function" and getattr(n.target, "__name__", "") == "pad_to_even"]
        assert len(leaves) == 1, "traced again, the wrapped function is no leaf"
        safetensors.torch.save_file(outputs, {str(tmp_path / "outputs.safetensors")!r})
    """)
    proc = subprocess.run([sys.executable, "-I", "-c", script], cwd=tmp_path, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    outputs = load_file(str(tmp_path / "outputs.safetensors"))
    with torch.no_grad():
        for key, x in inputs.items():
            torch.testing.assert_close(outputs[key], model(x), msg=key)


_PACKAGED_MODEL = '''
"""A model file on no sys.path, interned into a torch.package archive: its module is <torch_package_N>.NAME."""
import torch
from torch import nn

SCALE = 0.5


def halve_odd_batches(x):
    if x.shape[0] % 2:
        return x * SCALE
    return x


torch.fx.wrap("halve_odd_batches")


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(16, 8)
        self.second = nn.Linear(8, 4)

    def forward(self, x):
        return self.second(torch.relu(halve_odd_batches(self.first(x))))
'''


def test_a_wrapped_function_of_a_packaged_file_is_copied_and_verifies(tmp_path: Path) -> None:
    """The model and its wrapped function come from a file that no process can import by name (as with
    a script's `__main__`, or a torch.package archive's own code): `capture: fx` through the pipeline,
    and fx_source verifies (batch 1 takes the odd branch) with the function's source in module.py."""
    name = "fxport_wrapped_model"
    model = package_model(_PACKAGED_MODEL, name, tmp_path / "src")
    job = {"inputs": [{"name": "x", "shape": ["batch", 16], "dtype": "float32"}],
           "dynamic_dims": {"batch": {"min": 1, "opt": 2, "max": 4}}, "targets": ["fx_source"], "capture": "fx",
           "verify": {"samples": 1}}
    manifest = convert(model, parse_spec(job), tmp_path / "out", report=False)
    assert manifest["status"] == "succeeded" and manifest["capture"]["method"] == "fx"
    [record] = manifest["verification"]
    assert record["format"] == "fx_source" and record["passed"], record
    source = (tmp_path / "out" / "fx_source" / "module.py").read_text()
    functions, imports, calls = _top_level(source)
    assert "halve_odd_batches" in functions and "SCALE = 0.5" in source
    assert not any("torch_package" in line or name in line for line in imports), imports
    assert any(c.startswith("torch.fx.wrap(") and "halve_odd_batches" in c for c in calls), calls


def test_a_wrapped_function_without_source_fails_naming_it(tmp_path: Path) -> None:
    """A function made by exec has no source to copy, and its module imports nowhere: a clear refusal."""
    namespace: dict[str, Any] = {"__name__": "made_by_exec"}
    exec(compile(textwrap.dedent("""
        import torch

        def double_if_wide(x):
            return x * 2 if x.shape[-1] > 4 else x

        torch.fx.wrap("double_if_wide")

        class Model(torch.nn.Module):
            def forward(self, x):
                return double_if_wide(x) + 1
    """), "<made at runtime>", "exec"), namespace)
    gm = torch.fx.symbolic_trace(namespace["Model"]())
    with pytest.raises(ConversionFailed) as err:
        FxSourceFromGraphModule(gm)(tmp_path / "out")
    message = err.value.message
    assert "made_by_exec.double_if_wide" in message and "source is not available" in message, message
    assert err.value.stage == "export" and "capture: export" in (err.value.hint or "")


def test_a_source_that_does_not_import_fails_naming_its_line(tmp_path: Path) -> None:
    """The exporter imports what it wrote before anything verifies it: a failing line is named."""
    (tmp_path / "module.py").write_text("import torch\n\nfrom fxport_no_such_package import helper\n")
    with pytest.raises(ConversionFailed) as err:
        check_imports(tmp_path / "module.py")
    message = err.value.message
    assert "line 3 `from fxport_no_such_package import helper`" in message, message
    assert "ModuleNotFoundError" in message and err.value.stage == "export"
    assert not (tmp_path / "__pycache__").exists()  # nothing stray beside the artifact
