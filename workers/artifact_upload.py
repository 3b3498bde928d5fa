"""Upload a job's artifacts while its verification still runs (docs/architecture.md, "Speed").

The engine writes the artifacts one after another during `export` and then spends seconds
verifying them; the manifest records each artifact's sha256 as export leaves it. So each time
the sandbox reports export progress (a next target begins: the earlier ones are written) and
when `verify` begins, a background thread uploads the files that appeared in the output
folder since. The engine writes each artifact under a hidden folder (names starting with '.',
which are never artifact names and never scanned here) and renames it into place when it is
whole. A file that changes anyway after it went up costs a second upload of it, never a wrong
artifact (below).

The sandbox child is untrusted and still running, so an early upload proves nothing by
itself: each file goes up as a snapshot (`ArtifactStore.put_snapshot`: on S3, hashed and then
sent with that digest as x-amz-checksum-sha256, which the store checks; elsewhere through a
private copy), so the object and its recorded digest always agree, whatever the child does to
the file meanwhile. After the child exits, `upload_outputs` keeps an early object
only if its digest is the one the validated manifest states for that file (or, for a file
the manifest does not list, the digest the file has now); anything else is uploaded again,
and early objects of files that are gone are deleted.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fxport.storage import StoredObject, artifact_key, check_artifact_name

if TYPE_CHECKING:
    from fxport.workers.sandbox.beneath import OutputFile

log = logging.getLogger(__name__)

# Written after verification (by the child or by the worker): never worth an early upload.
LATE_FILES = ("manifest.json", "report.html")
SPARSE_CHECK_BYTES = 1 << 20  # files past this size that are mostly holes are not sent early


class EarlyUpload:
    """`offer()` whenever more artifacts may be final; `wait()` → {name: StoredObject} of what went up."""

    def __init__(self, artifacts: Any, tenant: str, job_id: str, out_dir: Path, spool_dir: Path,
                 on_stored: Callable[[str, StoredObject], None] | None = None, max_bytes: int | None = None) -> None:
        """`on_stored(name, stored)` is called (from the upload thread) after each file went up.
        `max_bytes`: the most it sends for the job (FXPORT_MAX_JOB_OUTPUT_BYTES); past it, and for
        a sparse file (not one a conversion writes), it leaves the file to the upload after."""
        self.artifacts, self.tenant, self.job_id = artifacts, tenant, job_id
        self.max_bytes, self.sent_bytes = max_bytes, 0
        self.on_stored = on_stored
        self.out_dir, self.spool_dir = out_dir, spool_dir
        self.uploaded: dict[str, StoredObject] = {}
        self._seen: dict[str, tuple[int, int]] = {}  # name → (size, mtime_ns) when it was snapshotted
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()
        self._closing = threading.Event()
        self._stop = threading.Event()

    @property
    def started(self) -> bool:
        return self._thread is not None

    def offer(self) -> None:
        """Look for new files in the output folder soon (in the background)."""
        if self._closing.is_set():
            return
        if self._thread is None:
            self.spool_dir.mkdir(parents=True, exist_ok=True)
            self._thread = threading.Thread(target=self._run, name=f"early-upload-{self.job_id}", daemon=True)
            self._thread.start()
        self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._stop.is_set() or self._closing.is_set():
                return
            try:
                self._scan()
            except Exception as exc:  # the late upload does it all; the next offer scans again
                log.warning("early upload scan failed: %s", exc)

    def _scan(self) -> None:
        """Each new file under out_dir, opened beneath it with no link followed and snapshotted
        from that open file (workers/sandbox/beneath.py): the child may swap a folder for a
        symlink at any moment, and the worker must never read through it. Names that are links,
        FIFOs or hard links, or vanish while listed, are passed over here; the upload after the
        child exits refuses them. Hidden names (the engine's staging folder) are not listed."""
        from fxport.workers.sandbox import beneath
        from fxport.workers.sandbox.run import MAX_OUTPUT_FILES

        with beneath.opened_dir(self.out_dir) as out_fd:
            for f in beneath.walk_files(out_fd, strict=False, max_files=MAX_OUTPUT_FILES, skip_hidden=True):
                try:
                    if self._stop.is_set() or self._closing.is_set():
                        return
                    self._offer_file(f)
                finally:
                    f.close()

    def _offer_file(self, f: OutputFile) -> None:
        name = f.name
        if name in LATE_FILES or self._seen.get(name) == (f.size, f.mtime_ns):
            return
        if self.max_bytes is not None and self.sent_bytes + f.size > self.max_bytes:
            return
        if f.size > SPARSE_CHECK_BYTES and os.fstat(f.fd).st_blocks * 512 < f.size // 2:
            return  # mostly holes: a size to cost the store, not an artifact
        self.sent_bytes += f.size
        try:
            key = artifact_key(self.tenant, self.job_id, check_artifact_name(name))
            self.uploaded[name] = self.artifacts.put_snapshot(key, f.path, spool_dir=self.spool_dir)
            self._seen[name] = (f.size, f.mtime_ns)
        except Exception as exc:  # the late upload does it again; nothing is lost
            log.info("early upload of %s failed (it is retried after verification): %s", name, exc)
            return
        if self.on_stored is not None and not self._stop.is_set():
            try:
                self.on_stored(name, self.uploaded[name])
            except Exception as exc:  # only an offer to the client: the job goes on
                log.info("could not announce the early upload of %s: %s", name, exc)

    def wait(self) -> dict[str, StoredObject]:
        """Finish the file in flight and stop (at once, if nothing started)."""
        self._closing.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
        return dict(self.uploaded)

    def abandon(self) -> None:
        """Stop after the current file and delete everything uploaded early (a failed or
        cancelled job publishes no model files)."""
        self._stop.set()
        for name, stored in self.wait().items():
            try:
                self.artifacts.delete_object(stored.key)
            except Exception as exc:
                log.warning("could not delete the early upload %s: %s", name, exc)
        self.uploaded.clear()
