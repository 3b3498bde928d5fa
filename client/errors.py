"""Client-side errors: each maps a gRPC status to what a pipeline can act on (and an exit code).

`from_rpc_error` turns a failed call into one of them. How the CLI words an error and which exit
code a finished job gets live with the CLI (cli/errors.py).
"""

from __future__ import annotations

import grpc

from fxport.errors import (
    EXIT_TIMEOUT,
    EXIT_UNREACHABLE,
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
