"""Typed errors: every failure carries the stage, a code, and what the user can do about it."""

from __future__ import annotations

from typing import Any

from fxport.text import cause_chain, printable, printable_or_none

# CLI exit codes (DESIGN.md §4).
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_TIMEOUT = 3
EXIT_UNREACHABLE = 4


class FxportError(Exception):
    """Base error. `message` says what went wrong, `hint` what to do about it."""

    code = "internal"
    exit_code = EXIT_FAILED

    def __init__(
        self,
        message: str,
        *,
        stage: str | None = None,
        hint: str | None = None,
        field: str | None = None,
        detail: str | None = None,
    ) -> None:
        message = printable(message)  # a model's or a library's escape sequences never reach a terminal
        super().__init__(message)
        self.message = message
        self.stage = stage
        self.hint = printable_or_none(hint)
        self.field = printable_or_none(field)
        self.detail = printable_or_none(detail)

    def __str__(self) -> str:
        text = self.message
        if self.hint:
            text += f" — {self.hint}"
        return text

    def to_dict(self) -> dict[str, Any]:
        """The error record: `detail` ends with the exceptions this one was raised from, so that
        the real cause (a library's own error under "ONNX export failed") is kept."""
        causes = cause_chain(self)
        detail = "\n".join(part for part in (self.detail, causes) if part) or None
        return {
            "stage": self.stage,
            "code": self.code,
            "message": str(self),
            "detail": detail,
            "field": self.field,
        }


class InvalidInput(FxportError):
    """The user's input (spec, model file, shapes, calibration data) is wrong. Exit 2."""

    code = "invalid_input"
    exit_code = EXIT_USAGE


class SpecError(InvalidInput):
    """The job spec failed validation; `violations` lists (field path, message)."""

    code = "invalid_spec"

    MAX_VIOLATIONS = 20  # listed; the rest are counted
    MAX_LINE = 400  # characters of one violation's line

    def __init__(self, violations: list[tuple[str, str]]) -> None:
        self.count = len(violations)  # all of them; `violations` keeps the first MAX_VIOLATIONS
        self.violations = violations = [(_cut(path, 120), msg) for path, msg in violations[: self.MAX_VIOLATIONS]]
        super().__init__(
            self.text(),
            stage="submit",
            field=violations[0][0] if violations else None,
        )

    def __str__(self) -> str:
        return self.message

    def lines(self, max_chars: int | None = None) -> list[str]:
        """A line per violation (each at most MAX_LINE characters), as many as fit in `max_chars`
        (at least one)."""
        lines: list[str] = []
        used = 0
        for path, msg in self.violations:
            line = _cut(f"{path}: {msg}", self.MAX_LINE)
            if max_chars is not None and lines and used + len(line) > max_chars:
                break
            lines.append(line)
            used += len(line) + 3
        return lines

    def text(self, max_chars: int | None = None) -> str:
        """The message: `lines(max_chars)`, then how many violations were left out."""
        lines = self.lines(max_chars)
        left_out = self.count - len(lines)
        if left_out:
            lines.append(f"… and {left_out} more violation(s): fix these first")
        return "invalid job spec:\n  " + "\n  ".join(lines)


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


class UnsupportedModelFormat(InvalidInput):
    code = "unsupported_format"


class CaptureFailed(FxportError):
    """No rung of the capture ladder could turn the model into a graph; the message lists each rung's
    reason and the user's source line where known. A failed conversion (exit 1), not invalid input:
    the model loaded and ran on the spec's inputs (a shape it cannot take fails before the ladder, as
    InvalidInput); it is its code that no capture method can follow."""

    code = "capture_failed"


class ConversionFailed(FxportError):
    """A pass or exporter failed on a model that loaded and captured."""

    code = "conversion_failed"


class VerificationFailed(FxportError):
    """An artifact does not compute what the original model computes."""

    code = "verification_failed"


class ResourceLimitExceeded(FxportError):
    code = "resource_limit"


class JobCancelled(FxportError):
    code = "cancelled"


class SandboxViolation(FxportError):
    """The model broke a rule of its sandbox: it left a link or a FIFO among its outputs, wrote
    an oversized result or too many files, or wrote to the sandbox's event channel."""

    code = "sandbox_violation"


class SandboxUnavailable(FxportError):
    """A layer the worker requires (FXPORT_SANDBOX_REQUIRE) could not be applied, or the child
    found state inherited from its warm parent: the model was not run."""

    code = "sandbox_unavailable"
