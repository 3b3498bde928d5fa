"""The test model corpus: every model the engine's tests convert, with what applies to each.

    from tests.models import CORPUS, ModelCase, get
    case = get("cnn_bn")
    model = case.build()                  # eval mode, same weights on every call
    out = model(*case.example_inputs(2))  # same inputs on every call for a given batch size

`CORPUS` is written out once below, in one place; nothing registers itself on import.
The flags are checked against the models by tests/test_model_corpus.py, so a test may rely on
them (e.g. "every case with has_batchnorm loses its BatchNorm nodes under fuse_conv_bn").

Tags: "tiny" (a few parameters, for service plumbing tests), "fast" (well under a second to
build, trace and export), "slow" (ResNet-18 at 224x224: benchmarks, not unit tests),
"cnn", "mlp", "attention", "multi_input", "multi_output", "control_flow", "int_inputs",
"hf" (built from a transformers config).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from tests.models import handwritten, third_party

ALL_TARGETS = ("torchscript", "onnx", "exported_program", "fx_source")


@dataclass(frozen=True)
class ModelCase:
    name: str
    build: Callable[[], nn.Module]  # eval() mode, seeded: two builds have identical weights
    example_inputs: Callable[[int], tuple]  # batch size -> positional inputs, seeded
    input_names: tuple[str, ...]  # forward()'s positional parameter names, in order
    input_shapes: tuple[tuple, ...]  # spec-style: "batch" marks the dynamic batch dim
    input_dtypes: tuple[str, ...]  # spec dtype names ("float32", "int64", ...)
    fx_traceable: bool  # torch.fx.symbolic_trace succeeds on the built model
    has_batchnorm: bool  # BatchNorm directly after a Conv/Linear: fuse_conv_bn should fold it
    has_dropout: bool  # contains nn.Dropout modules (identity in eval): remove_dropout applies
    third_party: bool  # built from a third-party library's config (transformers)
    tags: frozenset[str]
    targets: tuple[str, ...] = ALL_TARGETS  # targets this model is expected to convert to
    tolerance: float = 1e-4  # atol between eager fp32 and a converted artifact's output
    dynamic_batch: bool = True  # torch.export accepts Dim("batch") on dim 0 of every input


# ---------------------------------------------------------------------------------------
# Building: seeded weights, and BatchNorm statistics that are not the identity
# ---------------------------------------------------------------------------------------

WEIGHT_SEED = 0
INPUT_SEED = 1234
_BN_SAMPLES = 4  # batch size of the forward that settles BatchNorm statistics


def _settle_batchnorm(model: nn.Module, sample: tuple) -> None:
    """Give every BatchNorm real statistics and a non-trivial affine.

    A fresh BatchNorm (mean 0, var 1, weight 1, bias 0) is nearly the identity in eval mode,
    so a fuse_conv_bn that dropped it would still match eager. Running one forward with only
    the BatchNorms in train mode (momentum=None: plain average) stores the batch statistics,
    which also keeps deep stacks like ResNet-18 from blowing up activations.
    """
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not norms:
        return
    for m in norms:
        m.reset_running_stats()
        m.momentum = None
        m.train()
    with torch.no_grad():
        model(*sample)
        for m in norms:
            m.momentum = 0.1
            m.eval()
            if m.affine:
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)


def _builder(factory: Callable[[], nn.Module], example_inputs: Callable[[int], tuple]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        # fork_rng: building a model must not move the caller's global RNG.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(WEIGHT_SEED)
            model = factory().eval()
            _settle_batchnorm(model, example_inputs(_BN_SAMPLES))
        return model.eval()

    return build


def _random_inputs(
    shapes: tuple[tuple, ...], dtypes: tuple[str, ...], *, int_high: int = 2, shift: float = 0.0
) -> Callable[[int], tuple]:
    """Seeded inputs for spec-style shapes: floats ~ N(shift, 1), ints uniform in [0, int_high)."""

    def example_inputs(batch: int) -> tuple:
        gen = torch.Generator().manual_seed(INPUT_SEED + batch)
        out = []
        for shape, dtype in zip(shapes, dtypes):
            size = tuple(batch if d == "batch" else d for d in shape)
            dt = getattr(torch, dtype)
            if dt.is_floating_point:
                out.append(torch.randn(size, generator=gen, dtype=dt) + shift)
            else:
                out.append(torch.randint(0, int_high, size, generator=gen, dtype=dt))
        return tuple(out)

    return example_inputs


def _bert_inputs(batch: int) -> tuple:
    """Token ids plus an attention mask with right padding on every row but the first, so that
    comparisons exercise the mask, not only the all-ones case. (Measured: an export from an
    all-ones mask still handles padded masks; the graph does not specialize on it.)"""
    gen = torch.Generator().manual_seed(INPUT_SEED + batch)
    ids = torch.randint(0, third_party.VOCAB, (batch, third_party.SEQ), generator=gen)
    lengths = torch.randint(third_party.SEQ // 2, third_party.SEQ, (batch,), generator=gen)
    lengths[0] = third_party.SEQ
    mask = (torch.arange(third_party.SEQ)[None, :] < lengths[:, None]).to(torch.int64)
    return ids, mask


def _case(
    name: str,
    factory: Callable[[], nn.Module],
    inputs: tuple[tuple[str, tuple, str], ...],
    *,
    make_inputs: Callable[[int], tuple] | None = None,
    **flags,
) -> ModelCase:
    """One case from (name, spec shape, dtype) per input; shapes and example inputs agree by construction."""
    names = tuple(n for n, _, _ in inputs)
    shapes = tuple(s for _, s, _ in inputs)
    dtypes = tuple(d for _, _, d in inputs)
    example_inputs = make_inputs or _random_inputs(shapes, dtypes)
    return ModelCase(
        name=name,
        build=_builder(factory, example_inputs),
        example_inputs=example_inputs,
        input_names=names,
        input_shapes=shapes,
        input_dtypes=dtypes,
        **flags,
    )


# ---------------------------------------------------------------------------------------
# The corpus
# ---------------------------------------------------------------------------------------

_IMAGE_32 = (("x", ("batch", 3, 32, 32), "float32"),)
_PIXELS_32 = (("pixel_values", ("batch", 3, 32, 32), "float32"),)

_CASES = [
    _case(
        "tiny_linear", handwritten.TinyLinear, (("x", ("batch", 8), "float32"),),
        fx_traceable=True, has_batchnorm=False, has_dropout=False, third_party=False,
        tags=frozenset({"tiny", "fast", "mlp"}),
    ),
    _case(
        "mlp_dropout", handwritten.MlpDropout, (("x", ("batch", 32), "float32"),),
        fx_traceable=True, has_batchnorm=False, has_dropout=True, third_party=False,
        tags=frozenset({"fast", "mlp"}),
    ),
    _case(
        "cnn_bn", handwritten.CnnBn, _IMAGE_32,
        fx_traceable=True, has_batchnorm=True, has_dropout=False, third_party=False,
        tags=frozenset({"fast", "cnn"}),
    ),
    _case(
        "resnet18_small",
        lambda: handwritten.ResNet(widths=(16, 32, 64, 128), num_classes=10),
        (("x", ("batch", 3, 64, 64), "float32"),),
        fx_traceable=True, has_batchnorm=True, has_dropout=False, third_party=False,
        tags=frozenset({"fast", "cnn"}),
    ),
    _case(
        "resnet18", handwritten.ResNet, (("x", ("batch", 3, 224, 224), "float32"),),
        fx_traceable=True, has_batchnorm=True, has_dropout=False, third_party=False,
        tags=frozenset({"slow", "cnn"}),
    ),
    _case(
        "transformer_block", handwritten.TransformerBlock, (("x", ("batch", 16, 64), "float32"),),
        fx_traceable=True, has_batchnorm=False, has_dropout=False, third_party=False,
        tags=frozenset({"fast", "attention"}),
    ),
    _case(
        "multi_io", handwritten.MultiIO,
        (("image", ("batch", 3, 32, 32), "float32"), ("features", ("batch", 12), "float32")),
        fx_traceable=True, has_batchnorm=False, has_dropout=False, third_party=False,
        tags=frozenset({"fast", "cnn", "multi_input", "multi_output"}),
    ),
    _case(
        "control_flow", handwritten.ControlFlow, (("x", ("batch", 16), "float32"),),
        # shift: example inputs take the positive branch; tests negate them for the other one
        make_inputs=_random_inputs((("batch", 16),), ("float32",), shift=0.5),
        fx_traceable=False, has_batchnorm=False, has_dropout=False, third_party=False,
        tags=frozenset({"fast", "control_flow"}),
        # torch.cond has no TorchScript form: jit.trace refuses it ("using FX to torch.jit.trace a
        # dynamo-optimized function"), jit.script fails on cond's own Python, and jit.trace of
        # ep.module() finds no kernel for the cond HigherOrderOperator. fx_source: symbolic_trace
        # of ep.module() rejects the cond operands and to_folder can't pickle the branch graphs.
        targets=("onnx", "exported_program"),
    ),
    _case(
        "hf_bert", third_party.BertEncoder,
        (("input_ids", ("batch", third_party.SEQ), "int64"), ("attention_mask", ("batch", third_party.SEQ), "int64")),
        make_inputs=_bert_inputs,
        fx_traceable=False, has_batchnorm=False, has_dropout=True, third_party=True,
        tags=frozenset({"fast", "hf", "attention", "int_inputs", "multi_input"}),
    ),
    _case(
        "hf_gpt2", third_party.Gpt2LM, (("input_ids", ("batch", third_party.SEQ), "int64"),),
        make_inputs=_random_inputs((("batch", third_party.SEQ),), ("int64",), int_high=third_party.VOCAB),
        fx_traceable=False, has_batchnorm=False, has_dropout=True, third_party=True,
        tags=frozenset({"fast", "hf", "attention", "int_inputs"}),
    ),
    _case(
        "hf_vit", third_party.VitClassifier, _PIXELS_32,
        fx_traceable=False, has_batchnorm=False, has_dropout=True, third_party=True,
        tags=frozenset({"fast", "hf", "attention"}),
    ),
    _case(
        "hf_resnet", third_party.HfResNetClassifier, _PIXELS_32,
        fx_traceable=False, has_batchnorm=True, has_dropout=False, third_party=True,
        tags=frozenset({"fast", "hf", "cnn"}),
    ),
    _case(
        "hf_mobilenet_v2", third_party.MobileNetV2Classifier, _PIXELS_32,
        fx_traceable=False, has_batchnorm=True, has_dropout=True, third_party=True,
        # ONNX Runtime differs by 1.7e-4 on logits of magnitude ~7 (depthwise convs, ReLU6)
        tags=frozenset({"fast", "hf", "cnn"}), tolerance=1e-3,
    ),
]

CORPUS: dict[str, ModelCase] = {c.name: c for c in _CASES}


def get(name: str) -> ModelCase:
    """The case called `name`; a KeyError lists the valid names."""
    try:
        return CORPUS[name]
    except KeyError:
        raise KeyError(f"no corpus model {name!r}; valid names: {', '.join(CORPUS)}") from None
