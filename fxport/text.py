"""Text that reaches a user: no terminal control sequences, and causes that are never lost.

A model, a library it calls and the exporters' own messages can put escape sequences in an
error (torch's ONNX exporter colours "This is step 3/3"; a hostile model can write OSC 52 to set
a clipboard, or CSI sequences that erase what a terminal showed). Every error record, event
message and line the CLI prints passes through `printable`; an error's `detail` keeps the
exception's chain of causes (`cause_chain`), so the real cause is never lost.

Standard library only: the thin client imports it to print what a server sent.
"""

from __future__ import annotations

import re

# An escape sequence as a terminal reads it: CSI (ESC [ ... final byte), OSC / DCS / APC / PM /
# SOS strings up to their terminator (BEL or ST) or the end of the text, and the two-byte escapes.
_ESCAPE = re.compile(
    r"\x1b\[[0-?]*[ -/]*[@-~]?"                      # CSI
    r"|\x1b[\]PX^_][^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)?"  # OSC, DCS, SOS, PM, APC strings
    r"|\x1b[ -~]?"                                     # two-byte escapes (and a lone ESC)
    r"|[\x9b][0-?]*[ -/]*[@-~]?"                       # C1 CSI
    r"|[\x90\x98\x9d\x9e\x9f][^\x07\x1b\x9c]*(?:\x07|\x9c)?"  # C1 string introducers
)
# C0 and C1 control characters but newline and tab, and DEL.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")

REPR_CHARS = 80  # of a user's value quoted in a message
CAUSES_KEPT = 8  # links of an exception chain a detail keeps
CAUSE_CHARS = 500  # characters of each cause's message


def printable(text: str) -> str:
    """`text` without terminal escape sequences or control characters (newline and tab stay)."""
    if text.isprintable():  # the common case, and cheap
        return text
    return _CONTROL.sub("", _ESCAPE.sub("", text))


def short_repr(value: object, limit: int = REPR_CHARS) -> str:
    """repr(value), printable, cut to `limit` characters (`…` marks a cut): a message quotes what
    it refuses without growing with it."""
    text = printable(repr(value))
    return text if len(text) <= limit else text[: limit - 1] + "…"


def printable_or_none(text: str | None) -> str | None:
    return None if text is None else printable(text)


def cause_chain(exc: BaseException) -> str | None:
    """The exceptions `exc` was raised from (`raise ... from`) or while handling, one line each,
    innermost last: `caused by DispatchError: No ONNX function found for ...`. A cause whose
    message `exc`'s own message already quotes whole is not repeated. Bounded: at most
    `CAUSES_KEPT` links of `CAUSE_CHARS` characters each. None when there is nothing to add."""
    lines: list[str] = []
    said = printable(str(exc))
    seen = {id(exc)}
    cause = _cause_of(exc)
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if len(lines) == CAUSES_KEPT:
            lines.append("caused by … (more causes left out)")
            break
        message = printable(str(cause)).strip()
        if not message or message not in said:
            if len(message) > CAUSE_CHARS:
                message = message[:CAUSE_CHARS] + "…"
            lines.append(f"caused by {type(cause).__name__}: {message}" if message
                         else f"caused by {type(cause).__name__}")
        cause = _cause_of(cause)
    return "\n".join(lines) or None


def _cause_of(exc: BaseException) -> BaseException | None:
    if exc.__cause__ is not None:
        return exc.__cause__
    return None if exc.__suppress_context__ else exc.__context__
