"""Issue 44, items 2 and 3.

- A data-dependent loop (greedy NMS as a `while` loop) gets an ONNX model made from the scripted
  model, which keeps the loop as an ONNX Loop node and verifies at inputs that keep different
  numbers of boxes (a trace would keep the example's number of iterations).
- FX source for programs whose inputs and outputs go through pytrees: torch.export's module, with
  its guard call, flat inputs and structured outputs written as plain code, and nested inputs,
  dicts and caches flattened and rebuilt by the program's specs, written out as Python.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from fxport.errors import ConversionFailed
from fxport.spec import parse_spec
from fxport.workers.engine.exporters.eager import OnnxFromEagerModule
from fxport.workers.engine.exporters.fx_source import MODULE_CLASS, FxSourceFromGraphModule
from fxport.workers.engine.pipeline import convert
from fxport.workers.engine.verify.runners import FxSourceRunner, OnnxRuntimeRunner, flatten_outputs
from tests.models import coverage3_nms_llama as models

ROOT = Path(__file__).resolve().parents[3]

# -- item 3: ONNX of a data-dependent loop, from the scripted model ------------------------------


def _loop_ops(path: Path) -> set[str]:
    return {n.op_type for n in onnx.load(str(path)).graph.node} & {"Loop", "If"}


def test_greedy_nms_loop_gets_an_onnx_loop_that_verifies_at_other_kept_counts(tmp_path: Path) -> None:
    spec = {"inputs": [{"name": "boxes", "shape": ["n", 4]}, {"name": "scores", "shape": ["n"]}],
            "dynamic_dims": {"n": {"min": 8, "opt": 16, "max": 32}}, "targets": ["torchscript", "onnx"],
            "verify": {"samples": 4}}
    manifest = convert(models.save_nms_package(tmp_path), parse_spec(spec), tmp_path / "out", report=False)
    assert manifest["capture"]["method"] == "eager"  # the loop stops every capture rung
    onnx_path = tmp_path / "out" / "model.onnx"
    assert "Loop" in _loop_ops(onnx_path)
    assert any(w.startswith("onnx: exported from the eager model scripted") and "1 Loop node" in w
               for w in manifest["warnings"]), manifest["warnings"]
    [record] = [r for r in manifest["verification"] if r["format"] == "onnx"]
    assert record["passed"] and record["verdict"] == "passed", record
    boxes = record["outputs"][0]
    assert boxes["compared_as"] == "detections" and boxes["unmatched"] == 0 and boxes["paired"] > 0

    # the same ONNX model against the eager one at inputs it was never checked at: every kept count
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = models.GreedyNmsHead().eval()
    kept = set()
    with OnnxRuntimeRunner(onnx_path, ["boxes", "scores"]) as runner, torch.no_grad():
        for count, seed in [(12, 101), (20, 102), (28, 103), (9, 104)]:
            args = models.nms_inputs(count, seed)
            want, got = flatten_outputs(model(*args)), runner.infer(args)
            assert [w.shape for w in want] == [g.shape for g in got]
            for w, g in zip(want, got):
                np.testing.assert_allclose(g, w, atol=1e-5)
            kept.add(want[0].shape[0])
    assert len(kept) >= 2, kept  # the loop ran a different number of times


class _SqueezedNms(nn.Module):
    """A loop whose body squeezes a dim of unknown size: the scripted model's ONNX export cannot
    type it, so the exporter falls back to a trace, and says so."""

    def forward(self, scores: torch.Tensor) -> torch.Tensor:
        order = torch.argsort(scores, descending=True)
        keep = torch.zeros(0, dtype=torch.long)
        while order.numel() > 0:
            keep = torch.cat([keep, order[:1]])
            rest = order[1:]
            near = (scores[rest][None, :] - scores[order[:1]][:, None]).abs().squeeze(0)
            order = rest[near > 0.5]
        return scores[keep]


def test_a_scripted_model_onnx_cannot_write_falls_back_to_a_trace_and_says_why(tmp_path: Path) -> None:
    scores = torch.randn(12, generator=torch.Generator().manual_seed(3))
    exporter = OnnxFromEagerModule(_SqueezedNms(), (scores,), input_names=["scores"], dynamic_axes={"scores": {0: "n"}},
                                   opset=17, check_inputs=[(torch.randn(20),)])
    exporter(tmp_path / "model.onnx")
    assert exporter.note.startswith("traced from the eager model by the TorchScript-based exporter"), exporter.note
    assert "exporting the scripted model failed" in exporter.note and "loop counts" in exporter.note
    assert "Loop" not in _loop_ops(tmp_path / "model.onnx")  # the trace unrolled the example's iterations


# -- item 2: FX source of torch.export's module, pytree inputs and outputs ------------------------


class _Structured(nn.Module):
    """Takes a tensor and a dict holding a tuple; returns a dict holding a tuple holding a list."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, extra: dict[str, Any]) -> dict[str, Any]:
        h = self.fc(x) + extra["bias"]
        return {"out": h, "pair": (h.relu(), [extra["scale"][0] * h])}


class _FlatInDictOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
        h = self.fc(x * y)
        return {"logits": h, "both": (h.sigmoid(), None)}


def _exported_module(model: nn.Module, args: tuple[Any, ...], dynamic: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.export.export(model.eval(), args, dynamic_shapes=dynamic).module()


def _load_and_run(folder: Path, args: tuple[Any, ...]) -> Any:
    runner = FxSourceRunner(folder, MODULE_CLASS)  # refuses any unpickling while it loads
    with runner, torch.no_grad():
        return runner.module(*args)


def test_flat_inputs_and_structured_outputs_are_written_as_plain_code(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _FlatInDictOut().eval()
    batch = torch.export.Dim("batch")
    gm = _exported_module(model, (torch.randn(2, 4), torch.randn(2, 4)), ({0: batch}, {0: batch}))
    assert "_guards_fn" in dict(gm.named_children())  # torch.export's input checks, a call in its code
    folder = FxSourceFromGraphModule(gm)(tmp_path / "fx_source")
    source = (folder / "module.py").read_text()
    assert "def forward(self, x, y):" in source
    assert "tree_flatten_spec" not in source and "IN_SPEC" not in source and "_guards_fn" not in source
    assert "return {'logits': linear, 'both': (sigmoid, None)}" in source
    args = (torch.randn(5, 4), torch.randn(5, 4))  # a batch size the export never saw
    got, want = _load_and_run(folder, args), model(*args)
    assert got.keys() == want.keys() and got["both"][1] is None
    torch.testing.assert_close(got["logits"], want["logits"])
    torch.testing.assert_close(got["both"][0], want["both"][0])


def test_nested_inputs_are_flattened_by_the_programs_specs_written_as_python(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _Structured().eval()
    args = (torch.randn(2, 4), {"bias": torch.randn(4), "scale": (torch.randn(1),)})
    dynamic = ({0: torch.export.Dim("batch")}, {"bias": None, "scale": (None,)})
    folder = FxSourceFromGraphModule(_exported_module(model, args, dynamic))(tmp_path / "fx_source")
    source = (folder / "module.py").read_text()
    assert "import pickle" not in source and "treespec_loads" not in source and "torch.load(" not in source
    assert "TreeSpec(dict, ['bias', 'scale'], [LEAF, TreeSpec(tuple, None, [LEAF])])" in source
    assert "OUT_SPEC = TreeSpec(dict, ['out', 'pair'], [" in source
    assert "fx_pytree.tree_flatten_spec(([x, extra], {}), self._in_spec)" in source

    other = (torch.randn(7, 4), {"bias": torch.randn(4), "scale": (torch.randn(1),)})
    got, want = _load_and_run(folder, other), model(*other)
    torch.testing.assert_close(got, want)  # the same nesting: dict, tuple, list
    assert type(got["pair"][1]) is list


def test_a_cache_in_and_out_round_trips_through_its_registered_pytree_node(tmp_path: Path) -> None:
    from transformers import DynamicCache
    from transformers.integrations.executorch import register_dynamic_cache_export_support

    register_dynamic_cache_export_support()  # what a with-past export registers, as Optimum does
    llama = models.build_llama_with_past().llama

    class CacheInCacheOut(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.llama = llama

        def forward(self, input_ids: torch.Tensor, cache: Any) -> dict[str, Any]:
            out = self.llama(input_ids=input_ids, cache=cache, use_cache=True)
            return {"logits": out.logits, "cache": out.cache}

    def inputs(batch: int, seq: int, past: int, seed: int) -> tuple[Any, ...]:
        ids, *kv = models.llama_inputs(batch, seq, past, seed)
        pairs = [(kv[2 * i], kv[2 * i + 1]) for i in range(models.LLAMA_LAYERS)]
        return ids, DynamicCache(pairs, config=llama.config)

    model = CacheInCacheOut().eval()
    folder = FxSourceFromGraphModule(_exported_module(model, inputs(2, 3, 4, 0), None))(tmp_path / "fx_source")
    source = (folder / "module.py").read_text()
    assert "from transformers.cache_utils import DynamicCache" in source
    assert "TreeSpec(DynamicCache, [['key_cache', 'value_cache'], [None, None]], [" in source
    got, want = _load_and_run(folder, inputs(2, 3, 4, 1)), model(*inputs(2, 3, 4, 1))
    assert isinstance(got["cache"], DynamicCache)
    torch.testing.assert_close(got["logits"], want["logits"])
    torch.testing.assert_close([layer.keys for layer in got["cache"].layers],
                               [layer.keys for layer in want["cache"].layers])

    # where nothing registered the cache, module.py says so at import, naming the class
    probe = f"import sys; sys.path.insert(0, {str(folder)!r}); import module"
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "transformers.cache_utils.DynamicCache is not a registered pytree node" in proc.stderr, proc.stderr


class _Box:
    """A container registered with pytree in this test only: where module.py loads, nothing knows it."""

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value


torch.utils._pytree.register_pytree_node(_Box, lambda b: ([b.value], None), lambda values, _: _Box(values[0]))


class _ReturnsBox(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, _Box]:
        return x + 1, _Box(x * 2)


def test_a_structure_module_py_cannot_rebuild_names_the_class_and_the_spec(tmp_path: Path) -> None:
    gm = _exported_module(_ReturnsBox(), (torch.randn(2, 3),), None)
    with pytest.raises(ConversionFailed) as info:
        FxSourceFromGraphModule(gm)(tmp_path / "fx_source")
    text = str(info.value)
    assert "outputs' structure (out_spec) (at [1])" in text and "_Box" in text, text
    assert "cannot be imported by name where the source runs" in text, text


def test_torch_cond_is_named_as_the_cause(tmp_path: Path) -> None:
    from tests.models import get

    case = get("control_flow")
    gm = _exported_module(case.build(), case.example_inputs(2), None)
    with pytest.raises(ConversionFailed) as info:
        FxSourceFromGraphModule(gm)(tmp_path / "fx_source")
    text = str(info.value)
    assert "torch.ops.higher_order.cond" in text and "takes graphs as operands" in text, text


# -- item 2, end to end: the with-past Llama to every target --------------------------------------

DECODE_CHECK = """
import json, sys
import torch
from fxport.workers.engine.exporters.fx_source import MODULE_CLASS
from fxport.workers.engine.verify import runners as r
from tests.models import coverage3_nms_llama as models

out, batch, past = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
args = models.llama_inputs(batch, 1, past, seed=77)  # one new token per sequence: a decode step
with torch.no_grad():
    want = r.flatten_outputs(models.build_llama_with_past()(*args))
artifacts = {"torchscript": r.TorchScriptRunner(f"{out}/model.ts"),
             "onnx": r.OnnxRuntimeRunner(f"{out}/model.onnx", models.llama_input_names()),
             "exported_program": r.ExportedProgramRunner(f"{out}/model.pt2"),
             "fx_source": r.FxSourceRunner(__import__("pathlib").Path(f"{out}/fx_source"), MODULE_CLASS)}
result = {}
for name, runner in artifacts.items():
    with runner:
        got = runner.infer(args)
    result[name] = {"shapes": [list(g.shape) for g in got],
                    "max_abs_diff": max(float(abs(g - w).max()) for g, w in zip(got, want))}
result["eager_shapes"] = [list(w.shape) for w in want]
print(json.dumps(result))
"""


@pytest.mark.slow
def test_with_past_llama_converts_to_every_target_and_matches_eager_at_a_decode_step(tmp_path: Path) -> None:
    model = tmp_path / "llama_with_past.pt2"
    models.export_llama_with_past(str(model))
    targets = ["torchscript", "onnx", "exported_program", "fx_source"]
    (tmp_path / "spec.json").write_text(json.dumps(models.llama_spec(targets)))
    env = {**os.environ, "COLUMNS": "200"}
    proc = subprocess.run([sys.executable, "-m", "fxport.cli", "convert", str(model), "--spec",
                           str(tmp_path / "spec.json"), "--out", str(tmp_path / "out")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert {a["format"] for a in manifest["artifacts"]} == set(targets)
    assert {r["format"]: r["verdict"] for r in manifest["verification"]} == dict.fromkeys(targets, "passed")
    module_py = (tmp_path / "out" / "fx_source" / "module.py").read_text()
    assert "def forward(self, input_ids, past_key_0, past_value_0, past_key_1, past_value_1):" in module_py

    # a fresh process: batch 3 and past 11, sizes no sample and not the export's example had
    check = subprocess.run([sys.executable, "-c", DECODE_CHECK, str(tmp_path / "out"), "3", "11"], cwd=ROOT,
                           capture_output=True, text=True, timeout=300, env=env)
    assert check.returncode == 0, check.stderr[-3000:]
    result = json.loads(check.stdout.strip().splitlines()[-1])
    present = [3, models.LLAMA_KV_HEADS, 12, models.LLAMA_HEAD_DIM]
    assert result.pop("eager_shapes") == [[3, 1, models.LLAMA_VOCAB]] + [present] * 4
    for name, found in result.items():
        assert found["shapes"] == [[3, 1, models.LLAMA_VOCAB]] + [present] * 4, (name, found)
        assert found["max_abs_diff"] < 1e-4, (name, found)
