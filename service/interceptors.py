"""Server interceptors. Logging: one structured line per RPC with method, status and time.
Metrics: the gRPC server metrics of go-grpc-prometheus (fxport/metrics.py) for every RPC.
Stream slots: each streaming call holds one of the limits.StreamSlots while it is open."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import grpc

from fxport.service.handlers import wrap_handler
from fxport.service.limits import (
    BUSY_RETRY_METADATA,
    STREAM_ADMITTED_METADATA,
    UNAUTHENTICATED,
    UPLOADS,
    CallSlots,
    StreamSlots,
)
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
            extra = {"rpc": method, "code": _code_name(context, exc),
                     "ms": round((time.perf_counter() - started) * 1000, 1),
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

        return wrap_handler(handler, unary_response, stream_response)


def _status_name(context: grpc.ServicerContext, exc: BaseException | None) -> str:
    """The status the call ends with, as go-grpc-prometheus spells it (NotFound, Canceled, ...)."""
    from fxport.metrics import GRPC_CODES

    code = context.code()
    if code is not None:
        return GRPC_CODES.get(code.name, "Unknown")
    if not context.is_active():  # the client went away (or its deadline passed) before the end
        return "Canceled"
    return "Unknown" if exc is not None else "OK"


class MetricsInterceptor(grpc.ServerInterceptor):
    """grpc_server_started_total, grpc_server_handled_total{grpc_code} and
    grpc_server_handling_seconds per method, for unary and streaming calls alike.

    Written here rather than taken from py-grpc-prometheus 0.8.0 (the Python port of
    go-grpc-prometheus, released 2024-02): that one never counts a server-streaming call as
    handled nor times it (WatchJob, DownloadArtifact, Health/Watch), never counts a
    client-streaming call as started (SubmitJob), spells grpc_type and grpc_code unlike Go
    (UNARY, NOT_FOUND) and reads the context's private state. Put it outermost, so that calls
    the auth interceptor refuses are counted too (Unauthenticated)."""

    def __init__(self, services: Any = (), metrics: Any = None) -> None:
        from fxport.metrics import METRICS

        self.metrics = metrics or METRICS
        self.metrics.init_rpc_methods(services)

    def intercept_service(self, continuation: Callable[..., Any], details: grpc.HandlerCallDetails) -> Any:
        from fxport.metrics import rpc_type

        handler = continuation(details)
        if handler is None:
            return None
        service, _, name = details.method.lstrip("/").rpartition("/")
        labels = (rpc_type(handler.request_streaming, handler.response_streaming), service, name)
        m = self.metrics

        def done(context: grpc.ServicerContext, started: float, exc: BaseException | None) -> None:
            m.grpc_server_handled_total.labels(*labels, _status_name(context, exc)).inc()
            m.grpc_server_handling_seconds.labels(*labels).observe(time.perf_counter() - started)

        def unary_response(behavior: Callable[..., Any]) -> Callable[..., Any]:
            def wrapper(request: Any, context: grpc.ServicerContext) -> Any:
                m.grpc_server_started_total.labels(*labels).inc()
                started, exc = time.perf_counter(), None
                try:
                    return behavior(request, context)
                except BaseException as e:
                    exc = e
                    raise
                finally:
                    done(context, started, exc)
            return wrapper

        def stream_response(behavior: Callable[..., Any]) -> Callable[..., Any]:
            def wrapper(request: Any, context: grpc.ServicerContext) -> Any:
                m.grpc_server_started_total.labels(*labels).inc()  # now, not at the first message
                return stream(behavior, request, context, time.perf_counter())
            return wrapper

        def stream(behavior: Callable[..., Any], request: Any, context: grpc.ServicerContext, started: float) -> Any:
            exc = None
            try:
                yield from behavior(request, context)
            except BaseException as e:  # GeneratorExit too: gRPC dropped the stream (client gone)
                exc = e
                raise
            finally:
                done(context, started, exc)

        return wrap_handler(handler, unary_response, stream_response)


class CallSlotsInterceptor(grpc.ServerInterceptor):
    """Every streaming call holds a `StreamSlots` slot from its start to its end, and every other
    call of fxport's own service a `CallSlots` slot; one past the limits ends at once with
    RESOURCE_EXHAUSTED, the limit and the setting named, and the trailing metadata
    `fxport-retry: busy`, on which the fxport client retries (and follows a job by polling
    GetJob meanwhile). An admitted stream sends its headers at once, with
    `fxport-stream: admitted`, so a client knows it holds a slot. Calls to `own_service` count
    against their tenant, so this goes inside the auth interceptor, which sets it; health and
    reflection streams, which need no token, share one count, and their other calls hold none."""

    def __init__(self, streams: StreamSlots, calls: CallSlots, own_service: str) -> None:
        self.streams, self.calls, self.prefix = streams, calls, f"/{own_service}/"

    def intercept_service(self, continuation: Callable[..., Any], details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        if handler is None:
            return None
        tenant_bound = details.method.startswith(self.prefix)
        if not (handler.request_streaming or handler.response_streaming):
            return self._unary(handler, details) if tenant_bound else handler
        slots = self.streams
        upload = details.method.endswith("/SubmitJob")  # a tenant's submits have a budget of their own

        def take(context: grpc.ServicerContext) -> str:
            caller = current_tenant() if tenant_bound else UNAUTHENTICATED
            _admit_or_abort(slots.take(caller, upload=upload), "streams", context, details.method)
            context.send_initial_metadata((STREAM_ADMITTED_METADATA,))
            return caller + UPLOADS if upload else caller

        def unary_response(behavior: Callable[..., Any]) -> Callable[..., Any]:  # a client stream: SubmitJob
            def wrapper(requests: Any, context: grpc.ServicerContext) -> Any:
                caller = take(context)
                try:
                    return behavior(requests, context)
                finally:
                    slots.release(caller)
            return wrapper

        def stream_response(behavior: Callable[..., Any]) -> Callable[..., Any]:
            def wrapper(request: Any, context: grpc.ServicerContext) -> Any:
                caller = take(context)  # at the first message asked for, in the thread the stream holds
                try:
                    yield from behavior(request, context)
                finally:  # GeneratorExit too: the client went away
                    slots.release(caller)
            return wrapper

        return wrap_handler(handler, unary_response, stream_response)

    def _unary(self, handler: Any, details: grpc.HandlerCallDetails) -> Any:
        calls = self.calls

        def unary_response(behavior: Callable[..., Any]) -> Callable[..., Any]:
            def wrapper(request: Any, context: grpc.ServicerContext) -> Any:
                tenant = current_tenant()
                _admit_or_abort(calls.take(tenant), "calls", context, details.method)
                try:
                    return behavior(request, context)
                finally:
                    calls.release(tenant)
            return wrapper

        return wrap_handler(handler, unary_response, unary_response)


_REFUSAL_LOG_EVERY_S = 10.0
_refusal_logged: dict[str, float] = {}  # resource -> when a refusal of it was last logged


def _admit_or_abort(refused: tuple[str, str] | None, resource: str, context: grpc.ServicerContext,
                    method: str) -> None:
    """Nothing when admitted; otherwise the call ends, busy, naming the limit. Every refusal is
    counted; one per resource and 10 s is logged, so a flood of refused calls is no flood of logs."""
    if refused is None:
        return
    from fxport.metrics import METRICS

    limit, why = refused
    METRICS.busy_refusals_total.labels(resource, limit).inc()
    now = time.monotonic()
    if now - _refusal_logged.get(resource, -_REFUSAL_LOG_EVERY_S) >= _REFUSAL_LOG_EVERY_S:
        _refusal_logged[resource] = now
        log.warning("call refused (%s; the next for %.0f s are counted in fxport_busy_refusals_total, not logged): "
                    "%s", resource, _REFUSAL_LOG_EVERY_S, why, extra={"rpc": method})
    context.set_trailing_metadata((BUSY_RETRY_METADATA,))
    context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, why)


class TracingInterceptor(grpc.ServerInterceptor):
    """Each call to fxport's own service is a span (`rpc.method`, the tenant, the job it names)
    when tracing is on (fxport/tracing.py); nothing when it is off. Inside the auth interceptor,
    which sets the tenant."""

    def __init__(self, own_service: str) -> None:
        self.prefix = f"/{own_service}/"

    def intercept_service(self, continuation: Callable[..., Any], details: grpc.HandlerCallDetails) -> Any:
        from fxport import tracing

        handler = continuation(details)
        if handler is None or not details.method.startswith(self.prefix):
            return handler
        method = details.method[1:]

        def attributes(request: Any) -> dict[str, Any]:
            job_id = getattr(request, "job_id", None) or None  # a stream of requests (SubmitJob) names none
            return {"rpc.method": method, "tenant": current_tenant(), "job_id": job_id}

        def unary_response(behavior: Callable[..., Any]) -> Callable[..., Any]:
            def wrapper(request: Any, context: grpc.ServicerContext) -> Any:
                if not tracing.enabled():
                    return behavior(request, context)
                with tracing.span(method, **attributes(request)):
                    return behavior(request, context)
            return wrapper

        def stream_response(behavior: Callable[..., Any]) -> Callable[..., Any]:
            def wrapper(request: Any, context: grpc.ServicerContext) -> Any:
                if not tracing.enabled():
                    yield from behavior(request, context)
                    return
                with tracing.span(method, **attributes(request)):
                    yield from behavior(request, context)
            return wrapper

        return wrap_handler(handler, unary_response, stream_response)
