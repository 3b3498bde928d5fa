"""How the CLI words errors and which exit code a finished job gets.

The CLI's one way to word an error (`error_line`, `error_doc`) and to turn a finished job into an
exit code (`job_exit_code`), so `fxport convert` and `fxport submit --wait` say the same thing and
exit with the same code for the same input (README, "Command line"). The errors themselves come
from the core (fxport/errors.py) and the client library (client/errors.py: gRPC statuses).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import fxport.errors as _engine_errors
from fxport.errors import EXIT_FAILED, EXIT_OK, EXIT_USAGE, FxportError, InvalidInput


class CannotRunHere(FxportError):
    """What was asked needs something this machine lacks (a TensorRT engine: TensorRT and a GPU):
    bad usage of a local command, not a failed conversion. Exit 2."""

    code = "unavailable_here"
    exit_code = EXIT_USAGE


# "submit" as an error's stage means the request was refused before any stage ran (the spec:
# fxport.errors.SpecError), whichever command checked it: it is not a stage of `convert`.
_REQUEST_STAGE = "submit"


def error_label(command: str, exc: FxportError) -> str:
    """`fxport COMMAND: error[ during STAGE]:` — the command that ran, and the stage the error
    happened in when it is one of the conversion's stages."""
    stage = exc.stage if exc.stage and exc.stage != _REQUEST_STAGE else None
    return f"fxport {command}: error{f' during {stage}' if stage else ''}:"


def error_line(command: str, exc: FxportError) -> str:
    """The line the CLI prints for an error, without markup: its label, then the message (and hint)."""
    return f"{error_label(command, exc)} {exc}"


def print_error(console: Any, command: str, exc: FxportError) -> None:
    """`error_line` on a rich console (stderr), the label in red; the message is never markup."""
    from rich.text import Text

    text = Text(error_label(command, exc), style="red")
    text.append(f" {exc}")
    console.print(text, highlight=False, soft_wrap=True)


def error_doc(command: str, exc: FxportError) -> dict[str, Any]:
    """The `--json` document of an error, the same from every command: {"error": {...}}."""
    doc: dict[str, Any] = {**exc.to_dict(), "command": command}
    violations = getattr(exc, "violations", None)
    if violations is not None:
        doc["violations"] = [{"field": f, "message": m} for f, m in violations]
    return {"error": doc}


def _input_error_codes() -> frozenset[str]:
    """The codes of the engine's invalid-input errors (fxport.errors: InvalidInput and its
    subclasses there): a job that failed with one of them failed on what the user gave it. The
    client's own InvalidInput subclasses (not_found, too_large, ...) answer requests, never jobs."""
    codes, todo = set(), [InvalidInput]
    while todo:
        cls = todo.pop()
        if cls.__module__ == _engine_errors.__name__:
            codes.add(cls.code)
        todo.extend(cls.__subclasses__())
    return frozenset(codes)


INPUT_ERROR_CODES = _input_error_codes()


def job_exit_code(state: str, error: Mapping[str, Any] | None) -> int:
    """A finished job's exit code, as `fxport convert` would exit on the same input: 0 when it
    succeeded; 2 when it failed on invalid input (the model file, the shapes, ...: its error code
    is one of INPUT_ERROR_CODES, what `convert` raises as InvalidInput); 1 otherwise (a conversion
    that failed: capture_failed, conversion_failed, verification_failed, ...)."""
    if state == "SUCCEEDED":
        return EXIT_OK
    if error and error.get("code") in INPUT_ERROR_CODES:
        return EXIT_USAGE
    return EXIT_FAILED
