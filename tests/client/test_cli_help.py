"""Every command's --help renders: a bracket in a help text is rich markup to typer, and
`fxport serve --help` once crashed on `s3://BUCKET[/prefix]`."""

from __future__ import annotations

from typing import Any

import pytest
import typer.main
from typer.testing import CliRunner

from fxport.cli import app


def _commands(group: Any, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = [prefix]
    for name, command in group.commands.items():
        if hasattr(command, "commands"):  # a group (typer vendors its own click: no isinstance)
            out += _commands(command, (*prefix, name))
        else:
            out.append((*prefix, name))
    return out


COMMANDS = _commands(typer.main.get_command(app))


def test_the_walk_finds_every_command():
    assert {("serve",), ("convert",), ("submit",), ("jobs", "list"), ("tokens", "new")} <= set(COMMANDS)


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "fxport")
def test_help_renders(command: tuple[str, ...]):
    result = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "100"})
    assert result.exit_code == 0, (result.output, result.exception)
    assert "Usage:" in result.output and "Traceback" not in result.output
