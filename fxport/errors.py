"""Typed errors: every failure carries the stage, a code, and what the user can do about it.

One record shape (`ErrorRecord`) carries an error wherever it goes: out of the sandbox, into a
job's record and manifest, onto the wire (the proto's JobError) and into the result document. A
record turns back into its exception class by its code alone (`error_class`): every class that
names a `code` registers itself, so no list is kept by hand. `GRPC_STATUS` is the one table from
code to the gRPC status the API answers with (fxport/service/status.py applies it).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict

from fxport.text import cause_chain, printable, printable_or_none

PrintableText = Annotated[str, AfterValidator(printable)]

# CLI exit codes (README, "Command line").
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_TIMEOUT = 3
EXIT_UNREACHABLE = 4


class ErrorRecord(BaseModel):
    """What failed, where, and what to do: the one shape of an error outside a process (no
    control characters, whoever wrote it). `message` includes the hint; `detail` ends with the
    exceptions the error was raised from."""

    model_config = ConfigDict(extra="ignore")

    stage: PrintableText | None = None
    code: PrintableText = "internal"
    message: PrintableText = ""
    detail: PrintableText | None = None
    field: PrintableText | None = None


_BY_CODE: dict[str, type[FxportError]] = {}


class FxportError(Exception):
    """Base error. `message` says what went wrong, `hint` what to do about it."""

    code = "internal"
    exit_code = EXIT_FAILED
    # Extra (key, value) pairs the API sends in the trailing metadata with this error's status.
    trailing_metadata: tuple[tuple[str, str], ...] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "code" in cls.__dict__:  # a class of its own code; the first one defined keeps it
            _BY_CODE.setdefault(cls.code, cls)

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
        return self.record().model_dump()

    def record(self) -> ErrorRecord:
        """This error as an ErrorRecord (`to_dict` is its plain form)."""
        causes = cause_chain(self)
        detail = "\n".join(part for part in (self.detail, causes) if part) or None
        return ErrorRecord(stage=self.stage, code=self.code, message=str(self), detail=detail, field=self.field)

    @classmethod
    def from_record(cls, record: ErrorRecord) -> FxportError:
        """The error a record describes, as an instance of the class its code names (this class
        for a code no class has). Its message is the record's, hint included."""
        kind = error_class(record.code, default=cls)
        err = kind.__new__(kind)  # not kind(...): a subclass's own constructor takes other arguments
        FxportError.__init__(err, record.message, stage=record.stage, detail=record.detail, field=record.field)
        return err


class InvalidInput(FxportError):
    """The user's input (spec, model file, shapes, calibration data) is wrong. Exit 2."""

    code = "invalid_input"
    exit_code = EXIT_USAGE


class SpecError(InvalidInput):
    """The job spec failed validation; `violations` lists (field path, message)."""

    code = "invalid_spec"
    violations: list[tuple[str, str]] = []  # an instance rebuilt from its record (from_record) has none
    count = 0

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


# -- errors of the API's requests (not of a job): each answers with its own gRPC status -------


class InvalidRequest(InvalidInput):
    """A request's field is malformed or missing (not the spec: SpecError)."""

    code = "invalid_request"


class NotFound(InvalidInput):
    """No such job or artifact in the caller's tenant."""

    code = "not_found"


class PreconditionFailed(InvalidInput):
    """The request conflicts with what the server holds (an idempotency key of another request,
    a stored input that is not there, a store that cannot presign)."""

    code = "failed_precondition"


class QuotaExceeded(FxportError):
    """A limit of the tenant's or the server's: the message names it and its setting."""

    code = "quota_exceeded"

    def __init__(self, message: str, *, trailing_metadata: tuple[tuple[str, str], ...] = (), **kw: Any) -> None:
        super().__init__(message, **kw)
        self.trailing_metadata = trailing_metadata  # e.g. the "retry later" marks a client acts on


class ServiceUnavailable(FxportError):
    """A backing service (object store, queue) failed: the same request may succeed later."""

    code = "unavailable"


class DataLoss(FxportError):
    """A stored artifact is missing or does not match its recorded digest."""

    code = "data_loss"


class Unauthenticated(FxportError):
    code = "unauthenticated"


class PermissionDenied(FxportError):
    code = "permission_denied"


def error_class(code: str | None, default: type[FxportError] | None = None) -> type[FxportError]:
    """The class whose `code` is `code`; `default` (ConversionFailed) for an unknown or missing one."""
    return _BY_CODE.get(code or "", default or ConversionFailed)


# The gRPC status (grpc.StatusCode's name) the API answers an error of each code with. Codes
# missing here answer INTERNAL; tests/test_errors.py checks that every code of this module is here.
GRPC_STATUS: dict[str, str] = {
    "internal": "INTERNAL",
    "invalid_input": "INVALID_ARGUMENT",
    "invalid_spec": "INVALID_ARGUMENT",
    "unsupported_format": "INVALID_ARGUMENT",
    "invalid_request": "INVALID_ARGUMENT",
    "not_found": "NOT_FOUND",
    "failed_precondition": "FAILED_PRECONDITION",
    "quota_exceeded": "RESOURCE_EXHAUSTED",
    "resource_limit": "RESOURCE_EXHAUSTED",
    "unavailable": "UNAVAILABLE",
    "data_loss": "DATA_LOSS",
    "unauthenticated": "UNAUTHENTICATED",
    "permission_denied": "PERMISSION_DENIED",
    "cancelled": "CANCELLED",
    # A job's failures are reported in its record, not as a status; raised by a handler they are internal.
    "capture_failed": "INTERNAL",
    "conversion_failed": "INTERNAL",
    "verification_failed": "INTERNAL",
    "sandbox_violation": "INTERNAL",
    "sandbox_unavailable": "INTERNAL",
}


def grpc_status_name(code: str) -> str:
    return GRPC_STATUS.get(code, "INTERNAL")
