"""The thin gRPC client library. Never imports torch, celery, onnx, boto3 or redis; the `fxport`
command line built on it is its own room (cli/, fxport.cli).

    from fxport.client import Client
    with Client("127.0.0.1:50051") as c:
        job = c.submit("model.pt2", {"targets": ["onnx"]})
        job.wait(timeout=600, on_event=print)
        job.download("artifacts/")          # every file's sha256 checked
        # or: job.wait(timeout=600, download_to="artifacts/") fetches them while the job runs

A model the server already holds (same sha256) is not sent again. One it lacks goes straight
to the object store through a presigned PUT the server offers (S3 stores, 16 MiB and up), else
it streams through the server in 1 MiB chunks. `Job.wait` follows WatchJob and, when the
connection drops, resumes from the last event it saw.

UNAVAILABLE is retried with exponential backoff: for up to `retry_s` when the server says a
backend of its own (Redis, the object store) is down, briefly when the server itself cannot
be reached. Only calls that are safe to repeat are retried: reads, cancel, and a submit,
which always carries an idempotency key (one is made up when the caller gives none), so a
submit whose response was lost cannot create a second job.
"""

from fxport.client.client import (
    DEFAULT_SERVER,
    Client,
    Job,
    JobPage,
    ProgressEvent,
)
from fxport.client.errors import (
    AuthFailed,
    IntegrityError,
    JobNotFound,
    QueueFull,
    RequestRefused,
    ServerBusy,
    ServerUnreachable,
    TooLarge,
    WaitTimeout,
)
from fxport.errors import FxportError

__all__ = [
    "Client", "Job", "ProgressEvent", "JobPage", "FxportError", "ServerUnreachable", "AuthFailed", "JobNotFound",
    "TooLarge", "RequestRefused", "ServerBusy", "QueueFull", "WaitTimeout", "IntegrityError", "DEFAULT_SERVER",
]
