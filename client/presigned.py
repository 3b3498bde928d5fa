"""Bytes straight to and from the object store, through the presigned URLs the server hands out
(S3 stores): a download's GET, an upload's PUT. Any failure raises DirectUnavailable, and the
caller has the server relay the bytes instead."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

CHUNK = 1 << 20
DIRECT_URL_EXPIRY_S = 300
DIRECT_TIMEOUT_S = 5.0  # connect, and each read: a store that can't be reached from here costs this once
DIRECT_UPLOAD_IO_TIMEOUT_S = 60.0  # once connected, each write of an upload and the store's answer


class DirectUnavailable(Exception):
    """The object store did not serve a presigned URL from here (unreachable, refused, expired)."""


def url_chunks(url: str) -> Iterator[bytes]:
    """GET `url` in CHUNK pieces. Any failure to get the bytes (unreachable, refused, expired,
    cut off) raises DirectUnavailable: the caller has the server relay the artifact instead."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=DIRECT_TIMEOUT_S) as resp:
            while chunk := resp.read(CHUNK):
                yield chunk
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise DirectUnavailable(str(getattr(exc, "reason", exc))) from None


def put_file(url: str, headers: Mapping[str, str], path: Path) -> None:
    """PUT the file at `path` to a presigned `url` with exactly `headers`, streamed from disk.
    Any failure (unreachable, refused, expired, the bytes not matching the signed sha256)
    raises DirectUnavailable: the caller sends the bytes through the server instead."""
    import http.client
    import urllib.parse

    parts = urllib.parse.urlsplit(url)
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = kind(parts.hostname or "", parts.port, timeout=DIRECT_TIMEOUT_S, blocksize=CHUNK)
    try:
        conn.connect()
        if conn.sock is not None:  # connected: from here on the store may take its time per write
            conn.sock.settimeout(DIRECT_UPLOAD_IO_TIMEOUT_S)
        with open(path, "rb") as body:
            conn.request("PUT", parts.path + (f"?{parts.query}" if parts.query else ""), body=body,
                         headers=dict(headers))
            resp = conn.getresponse()
            answer = resp.read(4096)
        if resp.status != 200:
            raise DirectUnavailable(f"the store answered {resp.status}: {answer[:300].decode('utf-8', 'replace')}")
    except (OSError, http.client.HTTPException, ValueError) as exc:
        raise DirectUnavailable(str(exc)) from None
    finally:
        conn.close()
