"""Client-side errors: each maps a gRPC status to what a pipeline can act on (and an exit code).

Also the CLI's one way to word an error (`error_line`, `error_doc`) and to turn a finished job
into an exit code (`job_exit_code`), so `fxport convert` and `fxport submit --wait` say the same
thing and exit with the same code for the same input (README, "Command line").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import grpc

import fxport.errors as _engine_errors
from fxport.errors import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_TIMEOUT,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    FxportError,
    InvalidInput,
    SpecError,
)


class ServerUnreachable(FxportError):
    code = "unreachable"
    exit_code = EXIT_UNREACHABLE


class AuthFailed(FxportError):
    code = "auth"
    exit_code = EXIT_UNREACHABLE


class JobNotFound(InvalidInput):
    code = "not_found"


class TooLarge(InvalidInput):
    code = "too_large"


class RequestRefused(InvalidInput):
    """FAILED_PRECONDITION: the request cannot be served in the current state."""

    code = "failed_precondition"


class CannotRunHere(FxportError):
    """What was asked needs something this machine lacks (a TensorRT engine: TensorRT and a GPU):
    bad usage of a local command, not a failed conversion. Exit 2."""

    code = "unavailable_here"
    exit_code = EXIT_USAGE


class ServerBusy(FxportError):
    """RESOURCE_EXHAUSTED marked `fxport-retry: busy`: capacity every tenant shares (a stream
    slot, spool space) was taken, for this tenant or for all, for as long as the client retried.
    Exit 4, as for a server that cannot be reached: the request was fine, try again later."""

    code = "busy"
    exit_code = EXIT_UNREACHABLE


# The trailing metadata of a call refused while shared capacity was taken (service/limits.py).
BUSY_METADATA = ("fxport-retry", "busy")
# ... and of a submit refused because the tenant's jobs in flight are at their limit.
QUEUE_FULL_METADATA = ("fxport-retry", "queue-full")


class QueueFull(ServerBusy):
    """RESOURCE_EXHAUSTED marked `fxport-retry: queue-full`: the tenant already has as many jobs
    QUEUED or RUNNING as the server allows (FXPORT_MAX_JOBS_IN_FLIGHT), for as long as the client
    waited (`Client(queue_wait_s=...)`), resubmitting after each `retry-after`. Exit 4: the
    request was fine, the tenant's queue full."""

    code = "queue_full"


def is_queue_full(err: grpc.RpcError) -> bool:
    return (err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            and QUEUE_FULL_METADATA in tuple(err.trailing_metadata() or ()))


def retry_after(err: grpc.RpcError) -> float | None:
    """The `retry-after` seconds a refusal carries, if any."""
    for key, value in tuple(err.trailing_metadata() or ()):
        if key == "retry-after":
            try:
                return max(0.0, float(value))
            except ValueError:
                return None
    return None


def is_busy(err: grpc.RpcError) -> bool:
    """Whether `err` is the server refusing a call for want of shared capacity (retry later)."""
    return (err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            and BUSY_METADATA in tuple(err.trailing_metadata() or ()))


class WaitTimeout(FxportError):
    code = "timeout"
    exit_code = EXIT_TIMEOUT


class IntegrityError(FxportError):
    """A downloaded file does not match the sha256 the server recorded."""

    code = "integrity"


def _violations(err: grpc.RpcError) -> list[tuple[str, str]]:
    """google.rpc.BadRequest field violations from the trailing metadata, if any."""
    try:
        from google.rpc import error_details_pb2
        from grpc_status import rpc_status
    except ImportError:  # grpcio-status missing: the message still lists them
        return []
    try:
        status = rpc_status.from_call(err)
    except Exception:
        return []
    out: list[tuple[str, str]] = []
    for detail in status.details if status else ():
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            out += [(v.field, v.description) for v in bad.field_violations]
    return out


def from_rpc_error(err: grpc.RpcError, target: str = "") -> FxportError:
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    text = err.details() if hasattr(err, "details") else str(err)
    text = text or code.name
    if code == grpc.StatusCode.UNAVAILABLE:
        return ServerUnreachable(f"fxport server {target} unreachable: {text}",
                                 hint="check --server / FXPORT_SERVER and that `fxport serve` is running")
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return AuthFailed(f"authentication failed: {text}", hint="check --token / FXPORT_TOKEN")
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return AuthFailed(f"permission denied: {text}")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        violations = _violations(err)
        if violations:
            return SpecError(violations)
        return InvalidInput(text)
    if code == grpc.StatusCode.NOT_FOUND:
        return JobNotFound(text)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        if is_queue_full(err):
            return QueueFull(text, hint="wait for some of the tenant's jobs to finish (or cancel some); the fxport "
                                        "client resubmits for up to Client(queue_wait_s=...) first")
        if is_busy(err):
            return ServerBusy(f"fxport server {target} busy: {text}",
                              hint="retry later; the server's operator can raise the limit it names, or run more "
                                   "API replicas")
        return TooLarge(text)
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return RequestRefused(text)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return WaitTimeout(f"timed out: {text}")
    return FxportError(f"{code.name}: {text}")


# ---------------------------------------------------------------------------------------
# How the CLI words errors and which exit code a finished job gets
# ---------------------------------------------------------------------------------------

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
