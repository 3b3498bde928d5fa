"""Errors leave the API as gRPC status codes, by one table (fxport.errors.GRPC_STATUS).

Handlers raise typed errors (fxport.errors: NotFound, InvalidRequest, QuotaExceeded, ...);
`ErrorStatusInterceptor`, innermost, answers each with the status its code maps to, its message
and its trailing metadata. A spec error also carries google.rpc.BadRequest field violations.

Backend outages leave as UNAVAILABLE with a message naming the backend. A call that finds Redis
(job store, queue) or the object store unreachable would otherwise surface as UNKNOWN with a
stack trace in the message. UNAVAILABLE is the code every gRPC client treats as "try again"; the
trailing metadata `fxport-retry: backend` tells the fxport client that the server itself is up,
so retrying for longer is worth it (deploy/README.md, "Reliability": the client retries
idempotent calls, and a submit under its idempotency key).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import grpc

from fxport.errors import FxportError, SpecError, grpc_status_name
from fxport.service.handlers import wrap_handler
from fxport.storage import StoreUnreachable

log = logging.getLogger(__name__)

RETRY_METADATA = ("fxport-retry", "backend")

# The spec error's share of the response's trailing metadata, which a gRPC client refuses past 8 KiB
# ("received metadata size exceeds soft limit"): the message goes there twice (grpc-message and the
# Status in grpc-status-details-bin, base64) beside the field violations.
MAX_SPEC_ERROR_CHARS = 1200


def status_of(exc: FxportError) -> grpc.StatusCode:
    return grpc.StatusCode[grpc_status_name(exc.code)]


def abort(context: grpc.ServicerContext, exc: FxportError) -> NoReturn:
    """End the call with `exc`'s status (by its code), message and trailing metadata."""
    if isinstance(exc, SpecError) and exc.violations:
        abort_invalid_spec(context, exc)
    if exc.trailing_metadata:
        context.set_trailing_metadata(exc.trailing_metadata)
    context.abort(status_of(exc), str(exc))
    raise AssertionError("context.abort raises")


def abort_invalid_spec(context: grpc.ServicerContext, err: SpecError) -> NoReturn:
    """INVALID_ARGUMENT with google.rpc.BadRequest field violations in the trailing metadata;
    the message lists the same violations for clients that don't read the details. Both are
    bounded (MAX_SPEC_ERROR_CHARS), whatever the spec: the rest is counted, not listed."""
    from google.rpc import code_pb2, error_details_pb2, status_pb2
    from grpc_status import rpc_status

    listed = len(err.lines(MAX_SPEC_ERROR_CHARS))
    bad = error_details_pb2.BadRequest(
        field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field=f, description=m[: SpecError.MAX_LINE])
            for f, m in err.violations[:listed]
        ]
    )
    status = status_pb2.Status(code=code_pb2.INVALID_ARGUMENT, message=err.text(MAX_SPEC_ERROR_CHARS))
    status.details.add().Pack(bad)
    context.abort_with_status(rpc_status.to_status(status))
    raise AssertionError("context.abort raises")


def _backend_errors() -> tuple[tuple[type[BaseException], str], ...]:
    out: list[tuple[type[BaseException], str]] = [(StoreUnreachable, "object store")]
    try:
        import redis

        # BusyLoadingError (Redis replaying its AOF after a restart) is a ConnectionError.
        out += [(redis.exceptions.ConnectionError, "job store (Redis)"),
                (redis.exceptions.TimeoutError, "job store (Redis)")]
    except ImportError:
        pass
    try:
        from kombu.exceptions import OperationalError

        out.append((OperationalError, "job queue (Redis)"))
    except ImportError:
        pass
    return tuple(out)


class ErrorStatusInterceptor(grpc.ServerInterceptor):
    """Innermost: a handler's typed error, or a backend outage, becomes the call's status (which
    the logging and metrics interceptors outside it then record)."""

    def __init__(self) -> None:
        self._backends = _backend_errors()

    def _which(self, exc: BaseException) -> str | None:
        for cls, name in self._backends:
            if isinstance(exc, cls):
                return name
        return None

    def _answer(self, context: grpc.ServicerContext, exc: Exception, method: str) -> NoReturn:
        if isinstance(exc, FxportError):
            abort(context, exc)
        backend = self._which(exc)
        if backend is None:
            raise exc
        log.warning("%s unavailable during %s: %s", backend, method, exc)
        context.set_trailing_metadata((RETRY_METADATA,))
        context.abort(grpc.StatusCode.UNAVAILABLE,
                      f"{backend} unavailable: {exc}; "
                      "the call is safe to retry (the fxport client retries with backoff)")
        raise AssertionError("context.abort raises")

    def intercept_service(self, continuation: Callable[[Any], Any], details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        if handler is None:
            return None
        method = details.method

        def unary(behavior: Callable[..., Any]) -> Callable[..., Any]:
            def run(request: Any, context: grpc.ServicerContext) -> Any:
                try:
                    return behavior(request, context)
                except Exception as exc:
                    self._answer(context, exc, method)
            return run

        def streaming(behavior: Callable[..., Iterator[Any]]) -> Callable[..., Iterator[Any]]:
            def run(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                try:
                    yield from behavior(request, context)
                except Exception as exc:
                    self._answer(context, exc, method)
            return run

        return wrap_handler(handler, unary, streaming)
