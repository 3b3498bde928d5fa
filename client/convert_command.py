"""`fxport convert`: run the engine in this process, no servers (the newcomer's first try)."""

from __future__ import annotations


def convert_command() -> None:  # replaced by the engine work (issue 2)
    raise SystemExit("fxport convert: not built yet")
