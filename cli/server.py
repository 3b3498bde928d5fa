"""The API server as `fxport serve` runs it: the API (service/) and, in the embedded mode, the
in-process worker pool (workers/embedded.py) put together.

The API room never imports worker code, so this is where the two meet: the CLI may import every
room. Tests that want a real embedded server build it here too.
"""

from __future__ import annotations

from typing import Any

from fxport.config import Settings
from fxport.jobs import JobStore
from fxport.service.dispatch import EmbeddedDispatcher
from fxport.service.server import FxportServer
from fxport.service.server import create_server as create_api_server
from fxport.storage import ArtifactStore


def create_server(settings: Settings | None = None, **options: Any) -> tuple[FxportServer, int]:
    """`fxport.service.server.create_server` (same options) with the embedded worker pool: bound,
    not started."""
    return create_api_server(settings, embedded_pool=_embedded_pool, **options)


def _embedded_pool(jobs: JobStore, artifacts: ArtifactStore, settings: Settings) -> EmbeddedDispatcher:
    # Imported when built: a distributed API server (broker set) never loads worker code.
    from fxport.workers.embedded import create_embedded_pool

    return create_embedded_pool(jobs, artifacts, settings)
