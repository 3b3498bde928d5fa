"""A runner lets go of its artifact when its verification ends: the next artifact loads its own
weights with none of the previous one's still held (peak memory: docs/benchmarks.md, "Model bytes")."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import torch

from fxport.spec import parse_spec
from fxport.workers.engine.exporters.registry import REGISTRY
from fxport.workers.engine.inputs import resolve_signature
from fxport.workers.engine.load import load_model
from fxport.workers.engine.pipeline import convert

TARGETS = ("torchscript", "exported_program", "fx_source")


def test_each_runner_frees_its_artifact_when_it_is_done(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
    program = tmp_path / "m.pt2"
    torch.export.save(torch.export.export(model, (torch.randn(2, 8),)), str(program))
    spec = parse_spec({"targets": list(TARGETS)})
    manifest = convert(program, spec, tmp_path / "out")
    assert [v["verdict"] for v in manifest["verification"]] == ["passed"] * len(TARGETS)
    sig = resolve_signature(spec, load_model(program))
    for target in TARGETS:
        runner = REGISTRY[target].runner(tmp_path / "out" / REGISTRY[target].path, sig)
        with runner:
            runner.infer((torch.randn(2, 8),))
            held = weakref.ref(runner.module)
        gc.collect()
        assert held() is None, f"the {target} runner still holds its module"
