"""Server interceptors. Logging: one structured line per RPC with method, status and time."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import grpc

from fxport.service.tenancy import current_tenant

log = logging.getLogger("fxport.rpc")


def _code_name(context: grpc.ServicerContext, exc: BaseException | None) -> str:
    code = context.code() if hasattr(context, "code") else None
    if code is None:
        return "UNKNOWN" if exc is not None else "OK"
    return code.name


class LoggingInterceptor(grpc.ServerInterceptor):
    def intercept_service(self, continuation: Callable[..., Any], details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        if handler is None:
            return None
        method = details.method

        def record(request: Any, context: grpc.ServicerContext, started: float, exc: BaseException | None) -> None:
            job_id = getattr(request, "job_id", None) if not hasattr(request, "__next__") else None
            extra = {"rpc": method, "code": _code_name(context, exc), "ms": round((time.perf_counter() - started) * 1000, 1),
                     "tenant": current_tenant()}  # set by the auth interceptor, which runs outside this one
            if job_id:
                extra["job_id"] = job_id
            log.info("rpc", extra=extra)

        def unary_response(behavior: Callable[..., Any]) -> Callable[..., Any]:
            def wrapper(request: Any, context: grpc.ServicerContext) -> Any:
                started, exc = time.perf_counter(), None
                try:
                    return behavior(request, context)
                except BaseException as e:
                    exc = e
                    raise
                finally:
                    record(request, context, started, exc)
            return wrapper

        def stream_response(behavior: Callable[..., Any]) -> Callable[..., Any]:
            def wrapper(request: Any, context: grpc.ServicerContext) -> Any:
                started, exc = time.perf_counter(), None
                try:
                    yield from behavior(request, context)
                except BaseException as e:
                    exc = e
                    raise
                finally:
                    record(request, context, started, exc)
            return wrapper

        kw = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(unary_response(handler.unary_unary), **kw)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(unary_response(handler.stream_unary), **kw)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(stream_response(handler.unary_stream), **kw)
        if handler.stream_stream:
            return grpc.stream_stream_rpc_method_handler(stream_response(handler.stream_stream), **kw)
        return handler
