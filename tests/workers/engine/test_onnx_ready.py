"""The ONNX exporter's decomposition, skipped where it has nothing to do (exporters/onnx_ready.py).

Each model here is exported to ONNX through the exporter as fxport installs it and run in ONNX
Runtime against eager PyTorch. The rewrites must change no value: where an in-place op's write
could be seen (through a view, a composite handing its input back, a `to` that is a no-op, a read
by the old name), the program goes to the exporter's own decomposition, as it did before fxport
skipped any.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from fxport.spec import parse_spec
from fxport.workers.engine.exporters import onnx_ready
from fxport.workers.engine.request import EngineRequest
from tests.models import get
from tests.workers.engine.conftest import save_pt2, spec_dict


def _registry() -> Any:
    from torch.onnx._internal.exporter import _registration

    from fxport.workers.engine.warm_caches import cache_onnx_registry

    cache_onnx_registry()
    return _registration.ONNXRegistry.from_torchlib()


def _wrapper() -> onnx_ready.DecomposeWhereNeeded:
    installed = onnx_ready.install()
    assert installed is not None, "torch 2.13's exporter is what onnx_ready was written against"
    return installed


def _onnx_vs_eager(tmp_path: Path, module: nn.Module, x: torch.Tensor) -> tuple[float, onnx_ready.Readiness]:
    """Export through the exporter as installed, run the file; the largest difference from eager."""
    import onnxruntime as ort

    module.eval()
    with torch.no_grad():
        expected = module(x.clone())
    program = torch.export.export(module, (x.clone(),))
    path = tmp_path / f"{uuid.uuid4().hex[:6]}.onnx"
    wrapper = _wrapper()
    torch.onnx.export(program, (x,), str(path), dynamo=True, optimize=True, verbose=False)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    return float(np.abs(got - expected.numpy()).max()), wrapper.last


class _Block(nn.Module):
    """torchvision's BasicBlock: in-place ReLUs and `out += identity`, then global pooling."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(3, 3, 3, padding=1), nn.Conv2d(3, 3, 3, padding=1)
        self.relu = nn.ReLU(inplace=True)
        self.pool, self.fc = nn.AdaptiveAvgPool2d(1), nn.Linear(3, 2)
        self.drop = nn.Dropout(0.5, inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.conv1(x))
        out = self.conv2(out)
        out += x
        out = self.relu(out)
        out = self.drop(torch.flatten(self.pool(out), 1))
        return self.fc(out.to(torch.float32))


def test_a_resnet_block_skips_the_decomposition_and_matches_eager(tmp_path: Path) -> None:
    diff, last = _onnx_vs_eager(tmp_path, _Block(), torch.randn(2, 3, 8, 8))
    assert last.program is not None, last.declined
    # relu_ x2, add_, adaptive_avg_pool2d, dropout_, to
    assert last.nodes_changed == 6
    assert diff < 1e-5


def test_an_input_named_like_a_builtin_keeps_its_name(tmp_path: Path) -> None:
    """fx renames a copied node that shadows a builtin; the program's signature names the original."""
    class Named(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 2)

        def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (the name is the point)
            return self.fc(input).relu()

    diff, last = _onnx_vs_eager(tmp_path, Named(), torch.randn(2, 4))
    assert last.program is not None, last.declined
    assert [n.name for n in last.program.graph.nodes if n.op == "placeholder"][-1] == "input"
    assert diff < 1e-6


def test_the_program_it_is_given_is_left_as_it_was() -> None:
    program = torch.export.export(_Block().eval(), (torch.randn(2, 3, 8, 8),))
    before = str(program.graph)
    ready = onnx_ready.ready_for_onnx(program, _registry())
    assert ready.program is not None and ready.program is not program
    assert str(program.graph) == before  # the .pt2 target writes this same program
    mutable = [n for n in ready.program.graph.nodes
               if isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable]
    assert not mutable
    assert "relu_" in before and "adaptive_avg_pool2d" in before


class _OneConv(nn.Module):
    """A 1x1 convolution whose output the cases below write in place."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)


class _ReadAfterWrite(_OneConv):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x)
        y = h.relu_()
        return h + y  # h was written: eager gives 2 * relu(h)


def test_a_read_of_the_written_tensor_after_the_write_reads_the_in_place_result(tmp_path: Path) -> None:
    """torch.export routes every later read of a written tensor through the in-place op's
    result, so the out-of-place twin gives those reads the written values."""
    diff, last = _onnx_vs_eager(tmp_path, _ReadAfterWrite(), torch.randn(2, 3, 4, 4))
    assert last.program is not None and last.nodes_changed == 1
    assert diff < 1e-5


def test_a_read_of_the_old_name_after_the_write_keeps_the_in_place_op() -> None:
    """Should a graph read the written tensor by its old name after the write (export does not
    write one, so the graph is built by hand), the write is not rewritten."""
    graph = torch.fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    conv = graph.call_function(torch.ops.aten.conv2d.default, (x, w))
    relu_ = graph.call_function(torch.ops.aten.relu_.default, (conv,))
    late = graph.call_function(torch.ops.aten.add.Tensor, (conv, relu_))
    graph.output(late)
    order = {n: i for i, n in enumerate(graph.nodes)}
    origin = {n: n.target for n in graph.nodes}
    assert not onnx_ready._write_is_invisible(relu_, order, origin, set())
    late.args = (relu_, relu_)
    assert onnx_ready._write_is_invisible(relu_, order, origin, set())


class _WriteThroughView(_OneConv):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x)
        h.view(-1).relu_()
        return h * 2  # the write reached h through its view


class _WriteThroughComposite(_OneConv):
    """`dropout` in eval hands back its input: a write to its result is a write to `h`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x)
        d = nn.functional.dropout(h, 0.5, training=False)
        d.relu_()
        return h + d


class _WriteThroughNoOpCast(_OneConv):
    """`to` the dtype a tensor has hands it back: the write reaches `h`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x)
        y = h.to(torch.float32)
        y.relu_()
        return h + y


class _WritesItsInput(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.relu_()
        return x + 1


@pytest.mark.parametrize("module", [_WriteThroughView, _WriteThroughComposite, _WriteThroughNoOpCast, _WritesItsInput],
                         ids=["view", "composite", "no-op-cast", "input"])
def test_a_write_another_tensor_could_see_goes_to_the_exporters_decomposition(
        tmp_path: Path, module: type[nn.Module]) -> None:
    diff, last = _onnx_vs_eager(tmp_path, module(), torch.randn(2, 3, 4, 4))
    assert last.program is None
    assert last.declined == "relu_ (aten.relu_.default) writes a tensor other nodes may read"
    if module is not _WriteThroughComposite:  # the exporter's own decomposition misses that write
        assert diff < 1e-5  # (in torch 2.13 it is off by 2.0 here)


def test_an_op_onnx_lacks_or_control_flow_goes_to_the_exporters_decomposition(tmp_path: Path) -> None:
    class Branch(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.cond(x.sum() > 0, lambda t: t.relu(), lambda t: -t, (x,))

    class Unfused(nn.Module):  # BatchNorm with no conv before it: ONNX lacks aten.batch_norm
        def __init__(self) -> None:
            super().__init__()
            self.bn = nn.BatchNorm2d(3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.bn(x)

    diff, last = _onnx_vs_eager(tmp_path, Branch(), torch.randn(2, 3))
    assert last.program is None and "cond" in last.declined and diff < 1e-6
    diff, last = _onnx_vs_eager(tmp_path, Unfused(), torch.randn(2, 3, 4, 4))
    assert last.program is None and "batch_norm" in last.declined and diff < 1e-5


@pytest.mark.parametrize("name", ["resnet18_small", "transformer_block", "hf_mobilenet_v2", "hf_bert"])
def test_a_conversion_writes_the_same_onnx_either_way_and_verifies_it(tmp_path: Path, name: str) -> None:
    """Through the engine: the fast path's model gives exactly the decomposed one's outputs, every
    artifact passes verification, and the .pt2 sharing the program keeps its in-place ops."""
    import onnxruntime as ort

    from fxport.workers.engine.pipeline import convert_request

    case = get(name)
    doc = spec_dict(case, targets=("onnx", "exported_program"))
    spec = parse_spec(doc)
    model = save_pt2(case, tmp_path / "model.pt2")
    wrapper = _wrapper()
    outs: dict[str, Any] = {}
    try:
        for mode in ("ready", "decomposed"):
            wrapper.enabled = mode == "ready"
            out = tmp_path / mode
            convert_request(EngineRequest(model_path=model, spec=spec, out_dir=out, job_id=f"t-{mode}"))
            manifest = json.loads((out / "manifest.json").read_text())
            assert manifest["status"] == "succeeded", manifest.get("error")
            assert (wrapper.last.program is not None) == (mode == "ready"), wrapper.last.declined
            outs[mode] = out
    finally:
        wrapper.enabled = True
    inputs = [t.numpy() for t in case.example_inputs(3)]
    results = []
    for mode in ("ready", "decomposed"):
        session = ort.InferenceSession(str(outs[mode] / "model.onnx"), providers=["CPUExecutionProvider"])
        results.append(session.run(None, {i.name: x for i, x in zip(session.get_inputs(), inputs)}))
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)
    # the .pt2, written after the ONNX model from the same program (the spec's order), as it was
    in_place = [_mutable_ops(torch.export.load(str(outs[mode] / "model.pt2"))) for mode in ("ready", "decomposed")]
    assert in_place[0] == in_place[1]
    if name == "resnet18_small":
        assert in_place[0] > 0


def _mutable_ops(program: torch.export.ExportedProgram) -> int:
    return sum(isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable for n in program.graph.nodes)


def test_a_readied_program_the_exporter_cannot_translate_is_exported_its_own_way(
        tmp_path: Path, tiny_pt2: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Should a readied program fail to translate (a placeholder renamed, as fx once did to
    `input`), the export falls back to the exporter's decomposition and the job goes on."""
    from fxport.workers.engine.pipeline import convert

    readied = onnx_ready.ready_for_onnx

    def broken(program: torch.export.ExportedProgram, registry: Any) -> onnx_ready.Readiness:
        ready = readied(program, registry)
        assert ready.program is not None
        next(n for n in ready.program.graph.nodes if n.op == "placeholder").name = "renamed"
        return ready

    wrapper = _wrapper()
    monkeypatch.setattr(onnx_ready, "ready_for_onnx", broken)
    spec = parse_spec({"inputs": [{"name": "x", "shape": ["batch", 8]}], "targets": ["onnx"],
                       "dynamic_dims": {"batch": {"min": 1, "opt": 2, "max": 8}}})
    manifest = convert(tiny_pt2, spec, tmp_path / "out", report=False)
    assert manifest["status"] == "succeeded", manifest.get("error")
    assert [r["passed"] for r in manifest["verification"]] == [True]
    assert wrapper.last.declined == "turned off"  # the second export went the exporter's way
    assert wrapper.enabled


def test_an_in_place_op_mixing_dtypes_keeps_its_dtype(tmp_path: Path) -> None:
    """`h16.mul_(s32)` stays float16 where `mul` would promote to float32: left to the exporter."""
    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.register_buffer("scale", torch.full((4,), 3.0))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.fc(x).half() * 2  # a fresh float16 tensor
            h.mul_(self.scale)
            return h.float() + 1

    program = torch.export.export(Mixed().eval(), (torch.randn(2, 4),))
    ready = onnx_ready.ready_for_onnx(program, _registry())
    assert ready.program is None and "mixes dtypes" in ready.declined
