"""Keeps tests/models honest: every flag a ModelCase declares is checked against the model."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn
from torch.export import Dim

from fxport.spec import DTYPES, TARGETS
from tests.models import ALL_TARGETS, CORPUS, ModelCase, get


def _params(cases=None):
    cases = CORPUS.values() if cases is None else cases
    return [pytest.param(c, id=c.name, marks=[pytest.mark.slow] if "slow" in c.tags else []) for c in cases]


def _outputs(y) -> tuple[torch.Tensor, ...]:
    return tuple(y) if isinstance(y, (tuple, list)) else (y,)


def _assert_close(got, want, atol: float, what: str) -> None:
    got, want = _outputs(got), _outputs(want)
    assert len(got) == len(want), f"{what}: {len(got)} outputs, eager has {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape, f"{what}: output {i} shape {tuple(g.shape)}, eager {tuple(w.shape)}"
        err = (g - w).abs().max().item()
        assert err <= atol, f"{what}: output {i} differs from eager by {err:.3g} (atol {atol})"


def _inputs_for_both_branches(case: ModelCase, batch: int) -> list[tuple]:
    """Example inputs, plus their negation for control_flow models (whose examples take one branch)."""
    x = case.example_inputs(batch)
    return [x, tuple(-t for t in x)] if "control_flow" in case.tags else [x]


# ---------------------------------------------------------------------------------------
# The registry itself
# ---------------------------------------------------------------------------------------


def test_registry_is_consistent():
    assert {"tiny_linear", "cnn_bn", "resnet18", "resnet18_small", "mlp_dropout", "transformer_block",
            "multi_io", "control_flow"} <= set(CORPUS)
    assert sum(c.third_party for c in CORPUS.values()) >= 3
    for name, case in CORPUS.items():
        assert case.name == name
        assert len(case.input_names) == len(case.input_shapes) == len(case.input_dtypes) >= 1, name
        assert set(case.input_dtypes) <= set(DTYPES), name
        assert set(case.targets) <= set(ALL_TARGETS) <= set(TARGETS), name
        assert ("slow" in case.tags) != ("fast" in case.tags), f"{name}: tag it exactly one of fast/slow"
        for shape in case.input_shapes:
            assert shape[0] == "batch" and all(isinstance(d, int) for d in shape[1:]), (name, shape)
    assert get("tiny_linear") is CORPUS["tiny_linear"]


def test_get_unknown_name_lists_valid_names():
    with pytest.raises(KeyError, match="valid names: .*tiny_linear"):
        get("no_such_model")


def test_build_leaves_global_rng_alone():
    state = torch.random.get_rng_state()
    get("tiny_linear").build()
    assert torch.equal(torch.random.get_rng_state(), state)


# ---------------------------------------------------------------------------------------
# Per model
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", _params())
def test_example_inputs_match_declared_inputs(case: ModelCase):
    for batch in (1, 3):
        inputs = case.example_inputs(batch)
        assert len(inputs) == len(case.input_shapes)
        for t, shape, dtype in zip(inputs, case.input_shapes, case.input_dtypes):
            assert tuple(t.shape) == tuple(batch if d == "batch" else d for d in shape)
            assert t.dtype == getattr(torch, dtype)
        again = case.example_inputs(batch)
        assert all(torch.equal(a, b) for a, b in zip(inputs, again)), "example_inputs is not deterministic"


@pytest.mark.parametrize("case", _params())
def test_eager_forward_is_deterministic_across_builds(case: ModelCase):
    first, second = case.build(), case.build()
    assert not any(m.training for m in first.modules()), "build() must return an eval() model"
    params = list(inspect.signature(first.forward).parameters)
    assert tuple(params) == case.input_names
    with torch.no_grad():
        for batch in (1, 3):
            inputs = case.example_inputs(batch)
            a, b = _outputs(first(*inputs)), _outputs(second(*inputs))
            for x, y in zip(a, b):
                assert x.shape[0] == batch
                assert torch.isfinite(x).all()
                assert torch.equal(x, y), f"batch {batch}: two builds disagree"


@pytest.mark.parametrize("case", _params())
def test_module_flags_are_truthful(case: ModelCase):
    model = case.build()
    modules = list(model.modules())
    assert case.has_dropout == any(isinstance(m, nn.Dropout) for m in modules)
    assert case.has_batchnorm == any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in modules)
    assert case.third_party == any(type(m).__module__.startswith("transformers.") for m in modules)


@pytest.mark.parametrize("case", _params())
def test_fx_traceable_flag_is_truthful(case: ModelCase):
    model = case.build()
    if not case.fx_traceable:
        with pytest.raises(Exception):  # noqa: B017 - any failure to trace is the point; the kind varies by model
            torch.fx.symbolic_trace(model)
        return
    gm = torch.fx.symbolic_trace(model)
    gm.graph.lint()
    if case.has_batchnorm:
        # "BatchNorm after a Conv/Linear": every BN in the graph reads a conv or linear module.
        mods = dict(gm.named_modules())
        bns = [n for n in gm.graph.nodes if n.op == "call_module"
               and isinstance(mods[n.target], nn.modules.batchnorm._BatchNorm)]
        assert bns
        for n in bns:
            src = n.args[0]
            assert src.op == "call_module" and isinstance(mods[src.target], (nn.Conv2d, nn.Linear)), n.name
    with torch.no_grad():
        for inputs in _inputs_for_both_branches(case, 3):
            _assert_close(gm(*inputs), model(*inputs), 0.0, "symbolic_trace")


@pytest.mark.parametrize("case", _params())
def test_exports_with_dynamic_batch(case: ModelCase):
    """What the engine relies on: export at batch 2 with Dim("batch"), run at other batch sizes."""
    model = case.build()
    sample = case.example_inputs(2)
    dynamic_shapes = tuple({0: Dim("batch")} for _ in sample) if case.dynamic_batch else None
    ep = torch.export.export(model, sample, dynamic_shapes=dynamic_shapes)
    exported = ep.module()
    # The aten-level side of has_batchnorm: export keeps aten.batch_norm fed by conv2d/linear.
    norms = [n for n in exported.graph.nodes if n.target is torch.ops.aten.batch_norm.default]
    assert bool(norms) == case.has_batchnorm
    for n in norms:
        assert n.args[0].target in (torch.ops.aten.conv2d.default, torch.ops.aten.linear.default), n.name
    batches = (1, 2, 3) if case.dynamic_batch else (2,)
    with torch.no_grad():
        for batch in batches:
            for inputs in _inputs_for_both_branches(case, batch):
                _assert_close(exported(*inputs), model(*inputs), case.tolerance, f"exported, batch {batch}")


def test_control_flow_examples_take_both_branches():
    # positive branch is relu(...) >= 0, negative branch is tanh(...) - 1 < 0
    case = get("control_flow")
    model = case.build()
    (x,) = case.example_inputs(3)
    with torch.no_grad():
        assert (model(x) >= 0).all() and (model(-x) < 0).all()
