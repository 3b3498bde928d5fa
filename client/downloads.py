"""Where downloaded artifacts go: `safe_relative` keeps a server's artifact name inside the
destination folder, and `EarlyDownloads` fetches artifacts a job stores while it still runs
(Job.wait(download_to=...))."""

from __future__ import annotations

import logging
import shutil
import threading
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from fxport.client.errors import IntegrityError

if TYPE_CHECKING:
    from fxport.client.client import Job

log = logging.getLogger(__name__)


def safe_relative(name: str) -> PurePosixPath:
    """An artifact name from the server, as a path that cannot leave the destination folder."""
    p = PurePosixPath(name)
    if not name or p.is_absolute() or any(part in ("", ".", "..") for part in name.split("/")) or "\\" in name:
        raise IntegrityError(f"server sent an unsafe artifact name {name!r}")
    return p


class EarlyDownloads:
    """Job.wait(download_to=...): each artifact stored while the job runs is fetched at once
    (two at a time) into `dest/.fxport-<job id>.partial/`, which is always removed on exit."""

    STREAMS = 2

    def __init__(self, job: Job, dest: Path) -> None:
        self.job = job
        self.dir = dest / f".fxport-{job.id}.partial"
        self._pool: Any = None
        self._futures: list[Any] = []
        self._lock = threading.Lock()
        self._fetched: dict[str, tuple[Path, str]] = {}

    def __enter__(self) -> EarlyDownloads:
        return self

    def fetch(self, art: dict[str, Any]) -> None:
        try:
            rel = safe_relative(art["name"])
        except IntegrityError as exc:
            log.warning("not fetching early: %s", exc)
            return
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self.dir.mkdir(parents=True, exist_ok=True)
            self._pool = ThreadPoolExecutor(max_workers=self.STREAMS, thread_name_prefix="fxport-early")
        # A folder per offer: the worker may store the same name again while an older copy comes down.
        target = self.dir.joinpath(str(len(self._futures)), *rel.parts)
        self._futures.append(self._pool.submit(self._fetch, art, target))

    def _fetch(self, art: dict[str, Any], target: Path) -> None:
        try:
            self.job._client._download_one(self.job.id, art, target, early=True)
        except Exception as exc:  # noqa: BLE001 - only a head start: fetched again at the end
            log.info("early download of %s failed: %s", art["name"], exc)
            return
        with self._lock:
            self._fetched[art["name"]] = (target, art["sha256"])

    def finish(self) -> dict[str, tuple[Path, str]]:
        """Wait for the fetches under way; name → (file, sha256) of the latest copy of each."""
        for future in self._futures:
            future.result()
        with self._lock:
            return dict(self._fetched)

    def __exit__(self, *exc: Any) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        shutil.rmtree(self.dir, ignore_errors=True)
