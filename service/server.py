"""Build the gRPC server: ConversionService + health + reflection, embedded or distributed.

Health is grpc.health.v1 with Check, Watch and List; reflection is served as both
grpc.reflection.v1 and grpc.reflection.v1alpha (grpcurl, Postman, grpc_cli, Kreya...).

`create_server(settings) -> (server, port)`: binds `settings.listen` (127.0.0.1 by default;
port 0 picks a free port, for tests) but does not start it. With no broker configured the
jobs run in an in-process pool against a SQLite job store and a filesystem artifact store
under $FXPORT_HOME; with `broker_url` they go to Celery workers, the job store is Redis
and artifacts go wherever `store` says (S3).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from fxport.config import Settings
from fxport.jobs import JobStore, SweepResult, open_job_store, sweep_orphans
from fxport.periodic import PeriodicTask
from fxport.service.auth import build_auth, server_credentials
from fxport.service.dispatch import CeleryDispatcher, EmbeddedPoolFactory
from fxport.service.interceptors import (
    CallSlotsInterceptor,
    LoggingInterceptor,
    MetricsInterceptor,
    TracingInterceptor,
)
from fxport.service.limits import CallSlots, SpoolBudget, StreamSlots
from fxport.service.servicer import ConversionServicer
from fxport.service.status import ErrorStatusInterceptor
from fxport.service.tenancy import current_tenant
from fxport.storage import open_store
from fxport.v1 import conversion_pb2 as pb
from fxport.v1 import conversion_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ConversionService"].full_name
HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
REFLECTION_V1ALPHA = reflection.SERVICE_NAME
REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"
REFLECTION_V1_FILE = "grpc/reflection/v1/reflection.proto"
MAX_MESSAGE = 8 << 20  # chunks are 1 MiB; headroom for a large spec


class HealthServicer(health.HealthServicer):
    """grpcio-health-checking's servicer plus List (its 1.85 stubs define List, its servicer
    answers UNIMPLEMENTED): the status of every service this server has set."""

    def List(
        self, request: health_pb2.HealthListRequest, context: grpc.ServicerContext
    ) -> health_pb2.HealthListResponse:
        with self._lock:  # the base class keeps its statuses here, under this lock
            statuses = dict(self._server_status)
        return health_pb2.HealthListResponse(
            statuses={name: health_pb2.HealthCheckResponse(status=status) for name, status in statuses.items()})


def _reflection_v1_descriptor() -> None:
    """Put grpc.reflection.v1 in the default descriptor pool, so reflection describes it too.

    v1 is v1alpha under a new package name, message for message and field for field
    (grpc-proto's grpc/reflection/v1/reflection.proto); grpcio-reflection only ships v1alpha
    (grpc/grpc#38576), so v1's file is v1alpha's with the package renamed."""
    pool = descriptor_pool.Default()
    try:
        pool.FindServiceByName(REFLECTION_V1)
        return  # a grpcio-reflection that ships v1 already put it there
    except KeyError:
        pass
    old, new = f".{reflection_pb2.DESCRIPTOR.package}.", ".grpc.reflection.v1."
    fdp = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(fdp)
    fdp.name, fdp.package = REFLECTION_V1_FILE, "grpc.reflection.v1"
    fdp.options.java_package = "io.grpc.reflection.v1"
    fdp.options.go_package = "google.golang.org/grpc/reflection/grpc_reflection_v1"
    fdp.options.ClearField("deprecated")
    for message in fdp.message_type:
        for field in message.field:
            if field.type_name:
                field.type_name = field.type_name.replace(old, new)
    for service in fdp.service:
        for method in service.method:
            method.input_type = method.input_type.replace(old, new)
            method.output_type = method.output_type.replace(old, new)
    pool.AddSerializedFile(fdp.SerializeToString())


def enable_reflection(service_names: Sequence[str], server: grpc.Server) -> None:
    """Server reflection as grpc.reflection.v1 and v1alpha, both listing `service_names` and
    themselves. One servicer answers both: the two protocols are the same bytes on the wire."""
    _reflection_v1_descriptor()
    servicer = reflection.ReflectionServicer((*service_names, REFLECTION_V1, REFLECTION_V1ALPHA))
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    handlers = {"ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(REFLECTION_V1, handlers),))
    server.add_registered_method_handlers(REFLECTION_V1, handlers)


def served_services() -> list[Any]:
    """Descriptors of every service create_server registers (for the per-method metrics)."""
    _reflection_v1_descriptor()
    pool = descriptor_pool.Default()
    return [pool.FindServiceByName(name) for name in (SERVICE_NAME, HEALTH_SERVICE, REFLECTION_V1, REFLECTION_V1ALPHA)]


class FxportServer:
    """The grpc.Server plus what it owns (worker pool, stores); same start/stop/wait API."""

    def __init__(self, server: grpc.Server, port: int, settings: Settings, health_servicer: Any,
                 on_start: Sequence[Callable[[], Any]], on_stop: Sequence[Callable[[], Any]],
                 before_stop: Sequence[Callable[[], Any]] = (), metrics_servers: Sequence[Any] = (),
                 stream_slots: StreamSlots | None = None, spool: SpoolBudget | None = None,
                 call_slots: CallSlots | None = None) -> None:
        self.grpc_server = server
        self.port = port
        self.settings = settings
        self.address = f"{settings.listen.rsplit(':', 1)[0]}:{port}"
        self._health = health_servicer
        self._on_start, self._on_stop, self._before_stop = list(on_start), list(on_stop), list(before_stop)
        self._metrics_servers = metrics_servers  # filled at start when FXPORT_METRICS_PORT is set
        self.stream_slots = stream_slots  # the streaming calls open now
        self.call_slots = call_slots  # the other calls in progress now
        self.spool = spool  # the upload bytes spooled now

    @property
    def metrics_port(self) -> int | None:
        """The port /metrics is served on once started (FXPORT_METRICS_PORT=0 picks one); None if off."""
        return self._metrics_servers[0].server_port if self._metrics_servers else None

    def start(self) -> None:
        self.grpc_server.start()
        for fn in self._on_start:
            fn()
        for name in ("", SERVICE_NAME):
            self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        mode = "embedded" if self.settings.embedded else "distributed"
        log.info("serving", extra={"address": self.address, "mode": mode})

    def stop(self, grace: float | None = -1.0) -> None:
        """Health goes NOT_SERVING first (readiness drops while calls still complete), open
        WatchJob streams end (clients resume elsewhere from their last event), embedded jobs
        are interrupted and left to be re-run, in-flight calls get `grace` seconds (default
        Settings.shutdown_grace_s; None = cut them now), then the stores close."""
        if grace is not None and grace < 0:
            grace = self.settings.shutdown_grace_s
        self._health.enter_graceful_shutdown()
        for fn in self._before_stop:
            try:
                fn()
            except Exception as exc:
                log.warning("error while stopping: %s", exc)
        self.grpc_server.stop(grace).wait()
        for fn in self._on_stop:
            try:
                fn()
            except Exception as exc:
                log.warning("error while stopping: %s", exc)

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        return self.grpc_server.wait_for_termination(timeout)


class OrphanSweeper(PeriodicTask):
    """Every `orphan_sweep_interval_s`, `sweep_orphans` (fxport/jobs/orphans.py) in a daemon thread:
    RUNNING jobs whose worker died and that no redelivery picked up are requeued, or failed
    after their last attempt. Orphaned means silent for twice the redelivery bound."""

    name = "orphan-sweeper"

    def __init__(self, jobs: Any, requeue: Callable[[str], Any], settings: Settings) -> None:
        import os
        import socket

        super().__init__(settings.orphan_sweep_interval_s)
        self.jobs, self.requeue, self.settings = jobs, requeue, settings
        self.orphan_after_s = 2 * settings.redelivery_bound_s
        self.owner = f"sweeper:{socket.gethostname()}:{os.getpid()}"

    def sweep(self) -> SweepResult:
        result = sweep_orphans(self.jobs, self.requeue, orphan_after_s=self.orphan_after_s, owner=self.owner)
        for job_id in result.requeued:
            log.warning("requeued orphaned job: its worker is gone", extra={"job_id": job_id})
        for job_id in result.failed:
            log.warning("failed orphaned job: its worker is gone and it used its attempts", extra={"job_id": job_id})
        return result

    def tick(self) -> None:
        self.sweep()


def _add_cache_and_metrics(settings: Settings, servicer: ConversionServicer, on_start: list[Callable[[], Any]],
                           on_stop: list[Callable[[], Any]], before_stop: list[Callable[[], Any]]) -> list[Any]:
    """The result cache's eviction sweep and the Prometheus endpoint (FXPORT_METRICS_PORT);
    returns the list the endpoint's server is put in when it starts."""
    if settings.cache_enabled and settings.cache_sweep_interval_s > 0 and (settings.cache_max_age_s
                                                                           or settings.cache_max_bytes):
        from fxport.cache import CacheSweeper

        sweeper = CacheSweeper(servicer.cache, settings.cache_sweep_interval_s)
        on_start.append(sweeper.start)
        before_stop.append(sweeper.stop)
    if servicer.toolchains is not None:
        on_stop.append(servicer.toolchains.close)
    box: list[Any] = []
    if settings.metrics_port is not None:
        from fxport.metrics import start_metrics_server

        addr = settings.metrics_bind_address(api=True)
        # (settings.metrics_port is checked above)
        on_start.append(lambda: box.append(start_metrics_server(cast(int, settings.metrics_port), addr=addr)[0]))
        on_stop.append(lambda: [(m.shutdown(), m.server_close()) for m in box])
        if settings.broker_url:
            from fxport.metrics import sample_queue_depth

            sampler: list[Any] = []
            on_start.append(lambda: sampler.append(sample_queue_depth(cast(str, settings.broker_url))))
            on_stop.append(lambda: [stop.set() for stop in sampler])
    return box


def create_server(
    settings: Settings | None = None,
    *,
    tenant_of: Callable[[grpc.ServicerContext], str] = current_tenant,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
    embedded_pool: EmbeddedPoolFactory | None = None,
) -> tuple[FxportServer, int]:
    """`embedded_pool` builds the in-process worker pool of the embedded mode from the server's
    stores; the API never imports worker code, so whoever builds an embedded server passes it
    (fxport.workers.embedded.create_embedded_pool; `fxport serve` and tests: cli/server.py)."""
    settings = settings or Settings()
    if settings.embedded and embedded_pool is None:
        raise ValueError("the embedded mode runs jobs in this process: pass embedded_pool="
                         "fxport.workers.embedded.create_embedded_pool (fxport.cli.server.create_server does)")
    # Credentials first: a server that would listen unauthenticated never opens its stores.
    auth = build_auth(settings)
    tls = server_credentials(settings)
    artifacts = open_store(settings.store_url(), retry_s=settings.store_retry_s)
    # A blip is retried for a second; a longer outage answers UNAVAILABLE (service/status.py).
    jobs = open_job_store(settings.job_store_url(), settings.home, retry_s=1.0, events_ttl_s=settings.events_ttl_s)
    if settings.metrics_port is not None:
        from fxport.metrics import MeteredJobStore

        jobs = cast(JobStore, MeteredJobStore(jobs))  # counts every state a job enters, in this process
    on_start: list[Callable[[], Any]] = []
    on_stop: list[Callable[[], Any]] = []
    before_stop: list[Callable[[], Any]] = []
    if settings.embedded:
        assert embedded_pool is not None  # checked above, before any store was opened
        dispatcher: Any = embedded_pool(jobs, artifacts, settings)
        on_start.append(dispatcher.recover)
        before_stop.append(dispatcher.close)
    else:
        dispatcher = CeleryDispatcher(settings)
        on_stop.append(dispatcher.close)
        if settings.orphan_sweep_interval_s > 0:
            sweeper = OrphanSweeper(jobs, dispatcher.enqueue, settings)
            on_start.append(sweeper.start)
            before_stop.append(sweeper.stop)
    on_stop.append(jobs.close)

    # Metrics outermost: refused calls count too (Unauthenticated). Then auth: a refused call
    # never reaches the servicer (it logs its own line). Then the stream and call slots, which need
    # the tenant auth found. Innermost: a backend outage leaves as UNAVAILABLE, which the logging and
    # metrics interceptors record.
    rpc_metrics = [MetricsInterceptor(served_services())] if settings.metrics_port is not None else []
    stream_slots = StreamSlots(settings.max_streams_per_tenant, settings.stream_slots, settings.grpc_max_workers,
                               settings.max_uploads_per_tenant)
    call_slots = CallSlots(settings.calls_per_tenant)
    server = grpc.server(
        ThreadPoolExecutor(max_workers=settings.grpc_max_workers, thread_name_prefix="fxport-rpc"),
        interceptors=[*rpc_metrics, *([auth] if auth else []),
                      CallSlotsInterceptor(stream_slots, call_slots, SERVICE_NAME), TracingInterceptor(SERVICE_NAME),
                      *interceptors, LoggingInterceptor(), ErrorStatusInterceptor()],
        options=[("grpc.max_receive_message_length", MAX_MESSAGE), ("grpc.max_send_message_length", MAX_MESSAGE),
                 ("grpc.so_reuseport", 0)],
    )
    servicer = ConversionServicer(settings, jobs, artifacts, dispatcher, tenant_of=tenant_of)
    before_stop.insert(0, servicer.stopping.set)
    if settings.retention_sweep_interval_s > 0:
        from fxport.retention import RetentionSweeper

        retention = RetentionSweeper(jobs, artifacts, servicer.retention, settings.retention_sweep_interval_s)
        servicer.retention_sweeper = retention
        on_start.append(retention.start)
        before_stop.append(retention.stop)
    metrics_servers = _add_cache_and_metrics(settings, servicer, on_start, on_stop, before_stop)
    pb_grpc.add_ConversionServiceServicer_to_server(servicer, server)
    health_servicer = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    enable_reflection((SERVICE_NAME, HEALTH_SERVICE), server)
    port = server.add_secure_port(settings.listen, tls) if tls else server.add_insecure_port(settings.listen)
    if port == 0:
        raise OSError(f"cannot listen on {settings.listen}")
    return FxportServer(server, port, settings, health_servicer, on_start, on_stop, before_stop, metrics_servers,
                        stream_slots, servicer.spool, call_slots), port
