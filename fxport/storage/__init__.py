"""Artifact and input storage: one interface, an S3 backend and a filesystem backend.

One module per concern:
- keys.py: the object keys ({tenant}/inputs/{sha256}, {tenant}/jobs/{job_id}/{name}) and the
  checks that keep user text out of them;
- errors.py: StorageError and its kinds (ObjectNotFound, StoreUnreachable, StoredObjectCorrupt,
  InvalidKey);
- store.py: the `ArtifactStore` interface, `StoredObject`, `write_verified`;
- file_store.py (embedded) and s3_store.py (distributed): its two backends; streaming.py: an S3
  multipart upload fed while the bytes still arrive; backends.py: `open_store`, which picks a
  backend from a URL.

Import from here: `from fxport.storage import FileStore, artifact_key`.
boto3 is imported only when an S3 store is opened: the thin client never pays for it.
"""

from fxport.storage.backends import open_store
from fxport.storage.errors import InvalidKey, ObjectNotFound, StorageError, StoredObjectCorrupt, StoreUnreachable
from fxport.storage.file_store import FileStore
from fxport.storage.keys import (
    JOB_ID_RE,
    MAX_NAME_SEGMENTS,
    SHA256_RE,
    TENANT_RE,
    artifact_key,
    check_artifact_name,
    check_tenant,
    input_key,
    job_prefix,
)
from fxport.storage.s3_store import S3Store
from fxport.storage.store import ArtifactStore, StoredObject, write_verified
from fxport.storage.streaming import S3StreamUpload

__all__ = [
    "JOB_ID_RE", "MAX_NAME_SEGMENTS", "SHA256_RE", "TENANT_RE",
    "ArtifactStore", "FileStore", "InvalidKey", "ObjectNotFound", "S3Store", "S3StreamUpload", "StorageError",
    "StoreUnreachable", "StoredObject", "StoredObjectCorrupt",
    "artifact_key", "check_artifact_name", "check_tenant", "input_key", "job_prefix", "open_store",
    "write_verified",
]
