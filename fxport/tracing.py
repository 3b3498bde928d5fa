"""OpenTelemetry traces of a job, across processes: the API's SubmitJob, then the worker's run of
the job and each of its stages, in one trace with `job_id` and `tenant` on every span.

Off by default, at no cost: nothing of OpenTelemetry is imported unless FXPORT_OTLP_ENDPOINT is
set (the `tracing` extra installs it), or a test installs a provider. On, each process exports its
spans over OTLP/HTTP to that collector, named by its service (fxport-api, fxport-worker).

The context travels in the job record (`JobRecord.trace_context`, W3C `traceparent`), not only in
the queue's message: the worker continues the submit's trace whichever way the job reaches it (a
Celery task, the embedded pool, a redelivery after a worker died, the orphan sweeper's requeue,
the GPU stage's second task), all of which start from the record.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

log = logging.getLogger(__name__)

_tracer: Any = None  # an opentelemetry Tracer once tracing is on; None: off


def enabled() -> bool:
    return _tracer is not None


def configure(endpoint: str | None, service: str) -> bool:
    """Export this process's spans to the OTLP/HTTP collector at `endpoint` (FXPORT_OTLP_ENDPOINT);
    nothing when it is unset. Returns whether tracing is on."""
    if not endpoint:
        return False
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise RuntimeError(f"FXPORT_OTLP_ENDPOINT is set but OpenTelemetry is not installed ({exc.name}): "
                           "pip install 'fxport[tracing]', or unset it") from None
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=f"{endpoint.rstrip('/')}/v1/traces")))
    use_provider(provider)
    log.info("tracing to %s as %s", endpoint, service)
    return True


_configured_in: int | None = None  # the pid `configure_once` ran in


def configure_once(endpoint: str | None, service: str) -> None:
    """`configure`, once per process: a worker's pool children are forked after its start, and a
    fork keeps no exporter thread, so each configures its own on its first job."""
    global _configured_in
    import os

    if _configured_in == os.getpid():
        return
    _configured_in = os.getpid()
    configure(endpoint, service)


def use_provider(provider: Any) -> None:
    """Trace with `provider` (an opentelemetry-sdk TracerProvider): `configure`'s, or a test's."""
    global _tracer
    _tracer = provider.get_tracer("fxport")


def shutdown(provider: Any = None) -> None:
    """Tracing off (a provider given: flushed and shut down too)."""
    global _tracer
    _tracer = None
    if provider is not None:
        provider.shutdown()


def _parent(carrier: dict[str, str] | None) -> Any:
    if not carrier:
        return None
    from opentelemetry.propagate import extract

    return extract(carrier)


@contextlib.contextmanager
def span(name: str, *, parent: dict[str, str] | None = None, **attributes: Any) -> Iterator[Any]:
    """A span around the block (the current one's child, or `parent`'s: a carried context);
    None when tracing is off."""
    if _tracer is None:
        yield None
        return
    with _tracer.start_as_current_span(name, context=_parent(parent),
                                       attributes={k: v for k, v in attributes.items() if v is not None}) as current:
        yield current


def carrier() -> dict[str, str] | None:
    """The current span's context as W3C headers, to carry to another process; None when off."""
    if _tracer is None:
        return None
    from opentelemetry.propagate import inject

    out: dict[str, str] = {}
    inject(out)
    return out or None


class StageSpans:
    """One span per stage of a job, each ended when the next starts (or at `close`): the
    worker learns a stage's start from the sandbox's progress events, not from a block of code."""

    def __init__(self, job_span: Any, **attributes: Any) -> None:
        self.job_span, self.attributes = job_span, attributes
        self.current: Any = None
        self.stage: str | None = None

    def enter(self, stage: str) -> None:
        if self.job_span is None or _tracer is None or stage == self.stage:
            return
        from opentelemetry import trace

        self.close()
        self.stage = stage
        self.current = _tracer.start_span(f"fxport.stage {stage}", context=trace.set_span_in_context(self.job_span),
                                          attributes={"fxport.stage": stage, **self.attributes})

    def close(self) -> None:
        if self.current is not None:
            self.current.end()
            self.current = None
