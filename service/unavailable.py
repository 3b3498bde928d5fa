"""Backend outages leave the API as UNAVAILABLE, with a message naming the backend.

A call that finds Redis (job store, queue) or the object store unreachable would otherwise
surface as UNKNOWN with a stack trace in the message. UNAVAILABLE is the code every gRPC
client treats as "try again"; the trailing metadata `fxport-retry: backend` tells the
fxport client that the server itself is up, so retrying for longer is worth it (DESIGN.md
§7; the client retries idempotent calls, and a submit under its idempotency key).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from fxport.service.handlers import wrap_handler
from fxport.storage import StoreUnreachable

log = logging.getLogger(__name__)

RETRY_METADATA = ("fxport-retry", "backend")


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


class BackendUnavailableInterceptor(grpc.ServerInterceptor):
    def __init__(self) -> None:
        self._errors = _backend_errors()

    def _which(self, exc: BaseException) -> str | None:
        for cls, name in self._errors:
            if isinstance(exc, cls):
                return name
        return None

    def _abort(self, context: grpc.ServicerContext, exc: BaseException, backend: str, method: str) -> None:
        log.warning("%s unavailable during %s: %s", backend, method, exc)
        context.set_trailing_metadata((RETRY_METADATA,))
        context.abort(grpc.StatusCode.UNAVAILABLE,
                      f"{backend} unavailable: {exc}; "
                      "the call is safe to retry (the fxport client retries with backoff)")

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
                    backend = self._which(exc)
                    if backend is None:
                        raise
                    self._abort(context, exc, backend, method)
            return run

        def streaming(behavior: Callable[..., Iterator[Any]]) -> Callable[..., Iterator[Any]]:
            def run(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                try:
                    yield from behavior(request, context)
                except Exception as exc:
                    backend = self._which(exc)
                    if backend is None:
                        raise
                    self._abort(context, exc, backend, method)
            return run

        return wrap_handler(handler, unary, streaming)
