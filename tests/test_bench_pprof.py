"""bench/_pprof.py reads Go CPU profiles for the benchmark's account of SeaweedFS's CPU: a
profile written here by hand, in pprof's wire format, must come back as the same stacks."""

from __future__ import annotations

import gzip

from bench._pprof import parse


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _field(number: int, value: int | bytes) -> bytes:
    if isinstance(value, int):
        return _varint(number << 3) + _varint(value)
    return _varint(number << 3 | 2) + _varint(len(value)) + value


def _profile(stacks: list[tuple[list[str], int]]) -> bytes:
    """profile.proto: string_table (6), function (5: id, name), location (4: id, line{function_id}),
    sample (2: packed location_id, packed value). Values are (count, nanoseconds), as Go writes."""
    strings = [""]
    functions: dict[str, int] = {}
    body = b""
    for stack, _ in stacks:
        for name in stack:
            if name not in functions:
                functions[name] = len(functions) + 1
                strings.append(name)
                body += _field(5, _field(1, functions[name]) + _field(2, len(strings) - 1))
                body += _field(4, _field(1, functions[name]) + _field(4, _field(1, functions[name])))
    for stack, ns in stacks:
        ids = b"".join(_varint(functions[n]) for n in stack)
        body += _field(2, _field(1, ids) + _field(2, _varint(1) + _varint(ns)))
    return gzip.compress(body + b"".join(_field(6, s.encode()) for s in strings))


MD5 = "crypto/md5.(*digest).Write"
TEE = "io.(*teeReader).Read"
CHUNKS = "github.com/seaweedfs/seaweedfs/weed/operation.UploadReaderInChunks"
PARSE = "github.com/seaweedfs/seaweedfs/weed/storage/needle.ParseUpload"
PWRITE = "os.(*File).pwrite"


def test_a_profile_reads_back_as_its_stacks_with_shares_and_hashing_sites():
    prof = parse(_profile([
        ([MD5, TEE, CHUNKS], 30),
        ([MD5, TEE, TEE, CHUNKS], 20),
        ([MD5, PARSE], 10),
        ([PWRITE, "github.com/seaweedfs/seaweedfs/weed/storage.(*Volume).syncWrite"], 40),
    ]))
    assert prof.total_ns == 100
    assert prof.samples[1] == ([MD5, TEE, TEE, CHUNKS], 20)
    assert prof.share("crypto/md5.") == 0.6
    assert prof.share(PWRITE, "os.(*File).write") == 0.4
    # Each nested hashing reader is a pass of its own; a site is named by its package.function.
    assert prof.sites("crypto/md5.") == {
        "operation.UploadReaderInChunks via io.(*teeReader).Read": 0.3,
        "operation.UploadReaderInChunks via io.(*teeReader).Read ×2": 0.2,
        "needle.ParseUpload": 0.1,
    }
