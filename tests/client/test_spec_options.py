"""The spec's command-line flags are one definition (cli/spec_options.py): `fxport convert` and
`fxport submit` take the same ones, and a flag's value reaches the spec or is refused naming the flag."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import typer.main
from typer.testing import CliRunner

from fxport.cli import app
from fxport.cli.spec_options import CAPTURE_METHODS, SpecFlags, spec_parameters
from fxport.errors import InvalidInput
from fxport.spec import parse_spec

COMMANDS = typer.main.get_command(app).commands  # type: ignore[attr-defined]


_DESCRIBED = ("opts", "secondary_opts", "help", "multiple", "default", "envvar", "is_flag", "required", "hidden")


def _options(command: str) -> dict[str, dict[str, Any]]:
    """The command's parameters by name, each as what a user meets of it: flags, help, type, default..."""
    return {p.name: {**{k: getattr(p, k, None) for k in _DESCRIBED},
                     "type": repr(getattr(getattr(p, "type_descriptor", None), "annotation", None))}
            for p in COMMANDS[command].params}


def test_convert_and_submit_take_the_same_spec_flags() -> None:
    convert, submit = _options("convert"), _options("submit")
    names = [p.name for p in spec_parameters()]
    assert names and set(names) <= set(convert) and set(names) <= set(submit)
    for name in names:
        assert convert[name] == submit[name], name
    # and no spec flag is declared a second time under another name in either command
    flags = {opt for name in names for opt in convert[name]["opts"]}
    for command, options in (("convert", convert), ("submit", submit)):
        others = {opt for name, info in options.items() if name not in names for opt in info["opts"]}
        assert not flags & others, (command, flags & others)


def test_capture_is_a_flag_whose_help_lists_the_choices() -> None:
    [capture] = [p for p in COMMANDS["convert"].params if p.name == "capture"]
    assert capture.opts == ["--capture"]
    assert CAPTURE_METHODS == ("auto", "fx", "export")
    assert all(choice in (capture.help or "") for choice in CAPTURE_METHODS), capture.help


@pytest.mark.parametrize("command", ["convert", "submit"])
def test_a_bad_capture_value_exits_2_naming_the_flag_and_the_choices(command: str, tmp_path: Path) -> None:
    model = tmp_path / "model.pt2"
    model.write_bytes(b"never read: the flag is refused first")
    extra = ["--server", "127.0.0.1:1"] if command == "submit" else ["--out", str(tmp_path / "o")]
    result = CliRunner().invoke(app, [command, str(model), "--capture", "dynamo", *extra, "--json"])
    assert result.exit_code == 2, result.output
    assert f"fxport {command}: error: --capture 'dynamo': choose one of auto, fx, export" in result.stderr
    error = json.loads(result.stdout)["error"]
    assert error["field"] == "capture" and error["command"] == command


def test_flags_override_the_spec_file(tmp_path: Path) -> None:
    spec = tmp_path / "deploy.yaml"
    spec.write_text("targets: [onnx]\ncapture: fx\nlabels: {team: vision}\n")
    data = SpecFlags(spec=spec, capture="export", label=["git_sha=abc123"]).to_spec()
    job = parse_spec(data)
    assert job.capture == "export" and job.targets == ["onnx"]
    assert job.labels == {"team": "vision", "git_sha": "abc123"}
    assert parse_spec(SpecFlags(spec=spec).to_spec()).capture == "fx"  # no flag: the file's value stays


def test_a_label_without_a_value_is_refused_naming_it() -> None:
    with pytest.raises(InvalidInput, match="--label 'team': expected KEY=VALUE"):
        SpecFlags(label=["team"]).to_spec()


def test_dynamic_dim_flags_give_any_dim_its_range_without_a_spec_file() -> None:
    from fxport.errors import SpecError

    job = parse_spec(SpecFlags(input_=["tokens:batch,seq:int64"], dynamic_batch="1:4:16",
                               dynamic_dim=["seq=8:128:512"]).to_spec())
    assert job.dynamic_dims["seq"].model_dump() == {"min": 8, "opt": 128, "max": 512}
    assert job.dynamic_dims["batch"].max == 16
    with pytest.raises(SpecError, match="--dynamic-dim.*expected NAME=MIN:OPT:MAX"):
        SpecFlags(dynamic_dim=["seq:8:128:512"]).to_spec()
