"""One typed settings object, read from FXPORT_* environment variables and CLI flags.

The defaults make the embedded mode work with no configuration at all: no broker means an
in-process worker pool, no store means files under $FXPORT_HOME (./.fxport).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="FXPORT_", extra="ignore")

    home: Path = Field(Path(".fxport"), description="State folder of the embedded mode (jobs, artifacts).")
    listen: str = Field("127.0.0.1:50051", description="gRPC listen address (host:port; port 0 picks one).")
    broker_url: str | None = Field(
        None, description="Celery broker + job store, e.g. redis://127.0.0.1:6379/0. Unset = embedded pool."
    )
    store: str | None = Field(
        None, description="Artifact store: s3://BUCKET[/prefix] or file:///dir. Unset = file://$FXPORT_HOME/store."
    )
    max_upload_bytes: int = Field(4 << 30, description="Largest model or calibration upload accepted.")
    max_spec_bytes: int = Field(64 << 10, description="Largest job spec accepted.")
    embedded_workers: int = Field(2, ge=1, description="Concurrent jobs in the embedded worker pool.")
    job_soft_time_limit_s: int = Field(1800, description="Soft per-job limit: the job FAILS cleanly, naming the stage.")
    job_hard_time_limit_s: int = Field(2100, description="Hard per-job limit: the worker process is killed.")
    metrics_port: int | None = Field(None, description="Serve Prometheus metrics on this port (unset = off).")
    spool_dir: Path | None = Field(None, description="Where uploads are spooled before storage (default: system temp).")

    @property
    def embedded(self) -> bool:
        return self.broker_url is None

    def store_url(self) -> str:
        return self.store or f"file://{(self.home / 'store').resolve()}"
