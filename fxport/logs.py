"""Structured JSON logs: one JSON object per line, with the job id of the work in progress.

`job_context(job_id)` binds a job id for the current thread/task (a contextvar), so every
log line written while a job runs carries it without threading it through each call.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import sys
import time
from collections.abc import Iterator
from typing import Any

_job_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("fxport_job_id", default=None)
_RESERVED = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}


@contextlib.contextmanager
def job_context(job_id: str | None) -> Iterator[None]:
    token = _job_id.set(job_id)
    try:
        yield
    finally:
        _job_id.reset(token)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        job_id = getattr(record, "job_id", None) or _job_id.get()
        if job_id:
            out["job_id"] = job_id
        for key, value in record.__dict__.items():
            if key not in _RESERVED and key not in out and not key.startswith("_"):
                out[key] = value if isinstance(value, (str, int, float, bool, type(None))) else repr(value)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def configure_logging(level: str = "INFO", fmt: str = "json") -> None:
    """Route the root logger to stderr, JSON lines (or plain text with fmt="text")."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # Python's warnings (a library's DeprecationWarning, ...) become log records, JSON like the rest.
    logging.captureWarnings(True)
