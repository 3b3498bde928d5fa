"""Build the gRPC server: ConversionService + health + reflection, embedded or distributed.

`create_server(settings) -> (server, port)`: binds `settings.listen` (127.0.0.1 by default;
port 0 picks a free port, for tests) but does not start it. With no broker configured the
jobs run in an in-process pool against a SQLite job store and a filesystem artifact store
under $FXPORT_HOME; with `broker_url` they go to Celery workers, the job store is Redis
and artifacts go wherever `store` says (S3).
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from fxport.config import Settings
from fxport.jobs import SweepResult, open_job_store, sweep_orphans
from fxport.periodic import PeriodicTask
from fxport.storage import open_store
from fxport.v1 import conversion_pb2 as pb
from fxport.v1 import conversion_pb2_grpc as pb_grpc
from fxport.service.auth import build_auth, server_credentials
from fxport.service.interceptors import LoggingInterceptor
from fxport.service.servicer import ConversionServicer
from fxport.service.tenancy import current_tenant
from fxport.service.unavailable import BackendUnavailableInterceptor

log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ConversionService"].full_name
MAX_MESSAGE = 8 << 20  # chunks are 1 MiB; headroom for a large spec


class FxportServer:
    """The grpc.Server plus what it owns (worker pool, stores); same start/stop/wait API."""

    def __init__(self, server: grpc.Server, port: int, settings: Settings, health_servicer: Any,
                 on_start: Sequence[Callable[[], Any]], on_stop: Sequence[Callable[[], Any]],
                 before_stop: Sequence[Callable[[], Any]] = ()) -> None:
        self.grpc_server = server
        self.port = port
        self.settings = settings
        self.address = f"{settings.listen.rsplit(':', 1)[0]}:{port}"
        self._health = health_servicer
        self._on_start, self._on_stop, self._before_stop = list(on_start), list(on_stop), list(before_stop)

    def start(self) -> None:
        self.grpc_server.start()
        for fn in self._on_start:
            fn()
        for name in ("", SERVICE_NAME):
            self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("serving", extra={"address": self.address, "mode": "embedded" if self.settings.embedded else "distributed"})

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
    """Every `orphan_sweep_interval_s`, `sweep_orphans` (fxport/jobs.py) in a daemon thread:
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
                           on_stop: list[Callable[[], Any]], before_stop: list[Callable[[], Any]]) -> None:
    """The result cache's eviction sweep and the Prometheus endpoint (FXPORT_METRICS_PORT)."""
    if settings.cache_enabled and settings.cache_sweep_interval_s > 0 and (settings.cache_max_age_s
                                                                           or settings.cache_max_bytes):
        from fxport.cache import CacheSweeper

        sweeper = CacheSweeper(servicer.cache, settings.cache_sweep_interval_s)
        on_start.append(sweeper.start)
        before_stop.append(sweeper.stop)
    if servicer.toolchains is not None:
        on_stop.append(servicer.toolchains.close)
    if settings.metrics_port is not None:
        from fxport.metrics import start_metrics_server

        addr = settings.metrics_bind_address(api=True)
        box: list[Any] = []
        on_start.append(lambda: box.append(start_metrics_server(settings.metrics_port, addr=addr)[0]))
        on_stop.append(lambda: [m.shutdown() for m in box])
        if settings.broker_url:
            from fxport.metrics import sample_queue_depth

            sampler: list[Any] = []
            on_start.append(lambda: sampler.append(sample_queue_depth(settings.broker_url)))
            on_stop.append(lambda: [stop.set() for stop in sampler])


def create_server(
    settings: Settings | None = None,
    *,
    tenant_of: Callable[[grpc.ServicerContext], str] = current_tenant,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
) -> tuple[FxportServer, int]:
    settings = settings or Settings()
    # Credentials first: a server that would listen unauthenticated never opens its stores.
    auth = build_auth(settings)
    tls = server_credentials(settings)
    artifacts = open_store(settings.store_url(), retry_s=settings.store_retry_s)
    # A blip is retried for a second; a longer outage answers UNAVAILABLE (service/unavailable.py).
    jobs = open_job_store(settings.job_store_url(), settings.home, retry_s=1.0, events_ttl_s=settings.events_ttl_s)
    if settings.metrics_port is not None:
        from fxport.metrics import MeteredJobStore

        jobs = MeteredJobStore(jobs)  # counts every state a job enters, in this process
    on_start: list[Callable[[], Any]] = []
    on_stop: list[Callable[[], Any]] = []
    before_stop: list[Callable[[], Any]] = []
    if settings.embedded:
        from fxport.service.embedded import EmbeddedPool
        from fxport.workers.jobs import WorkerContext

        ctx = WorkerContext(jobs=jobs, artifacts=artifacts, settings=settings,
                            **({"worker_id": settings.worker_id} if settings.worker_id else {}))
        dispatcher: Any = EmbeddedPool(ctx, settings.embedded_workers)
        on_start.append(dispatcher.recover)
        before_stop.append(dispatcher.close)
    else:
        from fxport.service.dispatch import CeleryDispatcher

        dispatcher = CeleryDispatcher(settings)
        on_stop.append(dispatcher.close)
        if settings.orphan_sweep_interval_s > 0:
            sweeper = OrphanSweeper(jobs, dispatcher.enqueue, settings)
            on_start.append(sweeper.start)
            before_stop.append(sweeper.stop)
    on_stop.append(jobs.close)

    server = grpc.server(
        ThreadPoolExecutor(max_workers=settings.grpc_max_workers, thread_name_prefix="fxport-rpc"),
        # Auth outermost: a refused call never reaches the servicer (it logs its own line).
        # Innermost: a backend outage leaves as UNAVAILABLE, which the logging interceptor records.
        interceptors=[*([auth] if auth else []), *interceptors, LoggingInterceptor(), BackendUnavailableInterceptor()],
        options=[("grpc.max_receive_message_length", MAX_MESSAGE), ("grpc.max_send_message_length", MAX_MESSAGE),
                 ("grpc.so_reuseport", 0)],
    )
    servicer = ConversionServicer(settings, jobs, artifacts, dispatcher, tenant_of=tenant_of)
    before_stop.insert(0, servicer.stopping.set)
    _add_cache_and_metrics(settings, servicer, on_start, on_stop, before_stop)
    pb_grpc.add_ConversionServiceServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
    )
    port = server.add_secure_port(settings.listen, tls) if tls else server.add_insecure_port(settings.listen)
    if port == 0:
        raise OSError(f"cannot listen on {settings.listen}")
    return FxportServer(server, port, settings, health_servicer, on_start, on_stop, before_stop), port
