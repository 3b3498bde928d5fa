"""The errors of the object stores: each a FxportError with the code a failed job records."""

from __future__ import annotations

from fxport.errors import FxportError


class StorageError(FxportError):
    code = "storage"


class ObjectNotFound(StorageError):
    code = "not_found"


class StoreUnreachable(StorageError):
    """The object store did not answer within the retry budget."""

    code = "store_unreachable"


class StoredObjectCorrupt(StorageError):
    """Bytes read back, or being stored, do not match the sha256 recorded for them (code
    "integrity"; the client's own IntegrityError is a download that does not match)."""

    code = "integrity"


class InvalidKey(StorageError):
    code = "invalid_key"
