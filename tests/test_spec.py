"""Job spec validation: a table of (spec, the error text a person must see)."""

from __future__ import annotations

import pytest

from fxport.errors import SpecError
from fxport.spec import JobSpec, load_spec_text, parse_spec, spec_from_flags

DYN = {"inputs": [{"name": "x", "shape": ["batch", 3, 8, 8]}],
       "dynamic_dims": {"batch": {"min": 1, "opt": 2, "max": 4}}}

BAD = [
    ({"targets": ["onxx"]}, "targets[0]", "'onnx'"),
    ({"targets": []}, "targets", "at least 1"),
    ({"passes": ["fuse"]}, "passes[0]", "valid passes: fuse_conv_bn"),
    ({"passes": [{"name": "fuse_conv_bn", "options": {"linaer": True}}]}, "passes[0]", "valid options: linear"),
    ({"passes": [{"name": "profile_nodes", "options": {"runs": 0}}]}, "passes[0]", "'runs'"),
    ({"passes": [{"name": "substitute_ops", "options": {"swaps": ["relu_to_gelu"]}}]}, "passes[0]", "valid swaps"),
    ({"precision": "int4"}, "precision", "'fp32', 'fp16' or 'int8'"),
    ({"capture": "jit"}, "capture", "'auto', 'fx' or 'export'"),
    ({"verify": {"atoll": 0.1}}, "verify.atoll", "valid keys here: atol"),
    ({"verify": {"samples": 0}}, "verify.samples", "greater than or equal to 1"),
    ({"onnx": {"opset": 9}}, "onnx.opset", "greater than or equal to 11"),
    ({"colour": "red"}, "colour", "unknown key"),
    ({"inputs": [{"name": "x", "shape": [0, 3]}]}, "inputs[0].shape", "between 1 and"),
    ({"inputs": [{"name": "x", "shape": [1 << 20]}]}, "inputs[0].shape", "between 1 and"),
    ({"inputs": [{"name": "x", "shape": [4096, 4096, 4096]}]}, "spec", "the limit is"),
    ({"inputs": [{"name": "x", "shape": [1]}, {"name": "x", "shape": [1]}]}, "spec", "duplicate input names"),
    ({"inputs": [{"name": "1x", "shape": [1]}]}, "inputs[0].name", "identifier"),
    ({"inputs": [{"name": "x", "shape": [1], "dtype": "float8"}]}, "inputs[0].dtype", "'float32'"),
    ({**DYN, "dynamic_dims": {"batch": {"min": 4, "opt": 2, "max": 8}}}, "dynamic_dims.batch", "min <= opt <= max"),
    ({**DYN, "dynamic_dims": {"batch": {"min": 1, "opt": 2, "max": 4}, "seq": {"min": 1, "opt": 2, "max": 4}}},
     "spec", "not used by any input"),
    ({"quantization": {"target_cosine": 0.99}}, "spec", "precision is not int8"),
    ({"labels": {"bad key!": "x"}}, "labels", "label key"),
    ({"inputs": "x"}, "inputs", "valid list"),
]


@pytest.mark.parametrize("data,path,text", BAD)
def test_invalid_spec_names_field_and_choices(data: dict, path: str, text: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_spec(data)
    paths = [p for p, _ in info.value.violations]
    assert path in paths, info.value.violations
    assert text in str(info.value)


def test_defaults_and_key_order_do_not_change_the_digest() -> None:
    a = parse_spec({"targets": ["onnx", "torchscript"], "verify": {"rtol": 1e-3, "atol": 1e-4}})
    b = parse_spec({"verify": {"atol": 1e-4}, "targets": ["onnx", "torchscript"]})
    assert a.digest() == b.digest()
    assert a.digest() != parse_spec({"targets": ["onnx"]}).digest()


def test_pass_names_and_typed_options_are_normalized() -> None:
    spec = parse_spec({"passes": ["fuse_conv_bn", {"name": "profile_nodes", "options": {"top": 3}}]})
    assert spec.passes[0].options == {"linear": True}
    assert spec.passes[1].options == {"runs": 5, "top": 3}


def test_yaml_syntax_error_names_the_line() -> None:
    with pytest.raises(SpecError, match="line 2"):
        load_spec_text("targets: [onnx\nverify: {atol: 1}\n", source="deploy.yaml")


def test_json_is_accepted_as_well_as_yaml() -> None:
    assert load_spec_text('{"targets": ["onnx"]}') == {"targets": ["onnx"]}


def test_cli_flags_map_onto_the_same_model() -> None:
    data = spec_from_flags({"targets": ["onnx"]}, targets=["torchscript"], inputs=["x:batch,3,8,8:float32"],
                           dynamic_batch="1:4:16", passes=["remove_dropout"], precision="fp32")
    spec = parse_spec(data)
    assert spec.targets == ["torchscript"]
    assert spec.inputs[0].shape == ["batch", 3, 8, 8]
    assert spec.dynamic_dims["batch"].max == 16
    assert [p.name for p in spec.passes] == ["remove_dropout"]


@pytest.mark.parametrize("flag", ["x", "x:", ":1,2", "x:1,2:float32:extra"])
def test_bad_input_flag_shows_the_expected_form(flag: str) -> None:
    with pytest.raises(SpecError, match="NAME:DIMS"):
        spec_from_flags(inputs=[flag])


def test_spec_model_has_every_documented_section() -> None:
    for key in ("inputs", "dynamic_dims", "targets", "capture", "passes", "precision", "quantization", "onnx",
                "tensorrt", "verify", "labels"):
        assert key in JobSpec.model_fields


# -- specs that cost more than their size (issue 40) ---------------------------------------------


def test_yaml_anchors_and_aliases_are_refused_naming_the_line() -> None:
    from tests.security.test_bad_input import alias_bomb

    with pytest.raises(SpecError) as info:
        load_spec_text(alias_bomb())
    assert "line 2, column 5" in str(info.value) and "anchors or aliases" in str(info.value)
    with pytest.raises(SpecError) as info:  # a merge key needs an alias: refused too
        load_spec_text("verify: {atol: 1e-3}\nbenchmark:\n  <<: *v\n")
    assert "line 3" in str(info.value)


def test_nesting_is_bounded_and_a_real_spec_fits() -> None:
    from fxport.spec import MAX_SPEC_DEPTH

    deep = "passes:\n  - name: substitute_ops\n    options: {swaps: [[[[[[[[[[x]]]]]]]]]]}\n"
    with pytest.raises(SpecError) as info:
        load_spec_text(deep)
    assert f"nested more than {MAX_SPEC_DEPTH} levels deep" in str(info.value)
    fine = load_spec_text("passes:\n  - name: substitute_ops\n    options: {swaps: [gelu_to_tanh_gelu]}\n")
    assert fine["passes"][0]["options"]["swaps"] == ["gelu_to_tanh_gelu"]


def test_a_long_value_is_quoted_short() -> None:
    with pytest.raises(SpecError) as info:
        parse_spec({"targets": ["t" * 100_000]})
    assert len(str(info.value)) < 1000 and "…" in str(info.value)


# Golden digests: the spec digest names a job's request and the artifact digest is part of every
# result-cache key. A change here (a new optional field that shows up in `normalized()`, a default
# that moves) would silently miss every cached result and break idempotent resubmits of earlier
# jobs: keep these values, or change them on purpose and say so in the release notes.
GOLDEN_DIGESTS = [
    ({}, "58f43d4e76ccd3537d3ca69e487b30379fa007f5b8ac06a9fb61832627b17826",
     "e0ad45de9d8c43042cf4d26e80469b460d383888df9dcf4227f39c587d2441ba"),
    ({"targets": ["onnx"], "inputs": [{"name": "x", "shape": ["batch", 3, 32, 32]}],
      "dynamic_dims": {"batch": {"min": 1, "opt": 2, "max": 8}}, "precision": "fp16", "labels": {"a": "b"}},
     "f0337c4408a0f656c34ec3fcd84127136836726c0eba63f4a62c3bee7aae7300",
     "251694f2bd0c6a65fc51ccea0c96aeb501d006917e9796f534210f6084b9fab5"),
    ({"targets": ["onnx", "tensorrt"], "precision": "int8", "inputs": [{"name": "x", "shape": [1, 3, 8, 8]}]},
     "a4eb2b3a1217a01110ebc47e015e4c7353dfba3f869fcc172810f2a04d59900a",
     "8fa166d672d5de30ecf59359e67ce8002ffc10014fc92c5db9c5e823b9698304"),
    ({"targets": ["torchscript"], "passes": ["fuse_conv_bn", {"name": "substitute_ops", "options": {}}],
      "verify": {"samples": 3}, "benchmark": True},
     "9b950b736423fc02bc575b0a55d165b248a6af9a514e16765d6ab4719309de36",
     "78cdd68f4dcc09f1086ef2b3c2601b29e6c014371c5bb65861f630e963ad1ea6"),
]


@pytest.mark.parametrize(("data", "digest", "artifact_digest"), GOLDEN_DIGESTS, ids=range(len(GOLDEN_DIGESTS)))
def test_spec_digests_are_stable(data, digest, artifact_digest):
    spec = parse_spec(data)
    assert spec.digest() == digest
    assert spec.artifact_digest() == artifact_digest
