"""Client-side errors: each maps a gRPC status to what a pipeline can act on (and an exit code)."""

from __future__ import annotations

import grpc

from fxport.errors import EXIT_TIMEOUT, EXIT_UNREACHABLE, FxportError, InvalidInput, SpecError


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
        return TooLarge(text)
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return RequestRefused(text)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return WaitTimeout(f"timed out: {text}")
    return FxportError(f"{code.name}: {text}")
