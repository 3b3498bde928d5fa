"""Text that reaches a user (fxport/text.py): no terminal control sequences, and the cause of an
error kept in its record."""

from __future__ import annotations

import pytest

from fxport.errors import ConversionFailed, ErrorRecord, SpecError
from fxport.text import CAUSES_KEPT, cause_chain, printable, short_repr

HOSTILE = [
    "\x1b[96mThis is step 3/3\x1b[0m",  # torch's ONNX exporter colours its own messages
    "\x1b]52;c;cm0gLXJmIH4=\x07",  # OSC 52: set the clipboard
    "\x1b]0;owned\x1b\\",  # OSC 0: the window title, ST-terminated
    "\x1b]8;;http://x.invalid\x07link\x1b]8;;\x07",  # OSC 8: a hyperlink
    "\x1b[2J\x1b[H\x1b[1A\x1b[K",  # CSI: erase the screen, move the cursor
    "\x9b31m\x9d0;t\x9c",  # the same as C1 controls
    "bell\x07 back\x08space \rreturn \x00nul \x7fdel",
]


@pytest.mark.parametrize("text", HOSTILE)
def test_printable_leaves_no_control_character(text: str) -> None:
    out = printable("before " + text + " after\nnext\tline")
    assert out.startswith("before ") and out.endswith(" after\nnext\tline")
    assert not any(ord(c) < 0x20 and c not in "\n\t" or 0x7f <= ord(c) <= 0x9f for c in out), repr(out)


def test_printable_keeps_what_was_printable() -> None:
    assert printable("ONNX export failed: step 3/3 — ünïcode ✓") == "ONNX export failed: step 3/3 — ünïcode ✓"
    assert printable("\x1b[96mThis is step 3/3\x1b[0m of exporting") == "This is step 3/3 of exporting"


def test_short_repr_is_bounded_and_printable() -> None:
    assert short_repr("x" * 10_000).endswith("…") and len(short_repr("x" * 10_000)) == 80
    assert short_repr("tflite") == "'tflite'"
    assert "\x1b" not in short_repr("\x1b[2J")  # repr escapes it; never raw


def _raised() -> ConversionFailed:
    try:
        try:
            raise KeyError("No ONNX function found for quantized_decomposed.quantize_per_tensor")
        except KeyError as dispatch:
            raise RuntimeError("Failed to convert the exported program. \x1b[96mThis is step 3/3\x1b[0m") from dispatch
    except RuntimeError as step:
        err = ConversionFailed(f"ONNX export failed: {type(step).__name__}", stage="export", detail="exporter log tail")
        err.__cause__ = step
        return err


def test_an_error_record_keeps_the_chain_without_control_codes() -> None:
    record = _raised().to_dict()
    assert "\x1b" not in record["message"] and record["message"].startswith("ONNX export failed: RuntimeError")
    assert record["detail"].splitlines() == [
        "exporter log tail",
        "caused by RuntimeError: Failed to convert the exported program. This is step 3/3",
        "caused by KeyError: 'No ONNX function found for quantized_decomposed.quantize_per_tensor'",
    ]


def test_a_cause_the_message_already_quotes_is_not_repeated() -> None:
    try:
        try:
            raise ValueError("PAYLOAD RAN | refused unix")
        except ValueError as inner:
            raise ConversionFailed(f"could not load the archive: ValueError: {inner}", stage="load") from inner
    except ConversionFailed as err:
        assert err.to_dict()["detail"] is None


def test_a_chain_is_bounded() -> None:
    exc: BaseException = ValueError("root " + "y" * 5000)
    for i in range(20):
        try:
            raise RuntimeError(f"level {i}") from exc
        except RuntimeError as wrapped:
            exc = wrapped
    lines = cause_chain(exc).splitlines()
    assert len(lines) == CAUSES_KEPT + 1 and lines[-1].startswith("caused by … (more")
    assert all(len(line) < 600 for line in lines)


def test_records_strip_whatever_wrote_them() -> None:
    """A manifest a sandbox child wrote and a job record read back from the store are stripped too."""
    forged = {"stage": "export", "code": "x\x1b[2J", "message": "\x1b]52;c;aGk=\x07boom", "detail": "a\x1b[31mb"}
    assert ErrorRecord.model_validate(forged).model_dump() == {"stage": "export", "code": "x", "message": "boom",
                                                              "detail": "ab", "field": None}
    assert ErrorRecord(message="\x9b2Jdone", detail="\x1b[1Aup").model_dump()["message"] == "done"


def test_spec_errors_are_bounded() -> None:
    err = SpecError([(f"k{i}", "unknown key " + "z" * 1000) for i in range(100)])
    lines = str(err).splitlines()
    assert len(lines) == 1 + SpecError.MAX_VIOLATIONS + 1 and "and 80 more" in lines[-1]
    assert all(len(line) <= SpecError.MAX_LINE + 2 for line in lines)
