"""Read a Go CPU profile (pprof's gzipped protobuf) well enough to say where a server's CPU went.

SeaweedFS serves one at /debug/pprof/profile when started with `-debug`. There is no Go
toolchain here, so this decodes the few fields of profile.proto it needs by hand: samples
(location ids, values), locations (their function ids) and functions (their names).
"""

from __future__ import annotations

import collections
import gzip
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[i]
        i += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, i


def _fields(buf: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """(field number, wire type, value) of each field of one protobuf message."""
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire == 2:
            n, i = _varint(buf, i)
            value, i = buf[i:i + n], i + n
        elif wire == 1:
            value, i = buf[i:i + 8], i + 8
        elif wire == 5:
            value, i = buf[i:i + 4], i + 4
        else:
            raise ValueError(f"protobuf wire type {wire} at byte {i}: not a pprof profile")
        yield number, wire, value


def _ints(wire: int, value: int | bytes) -> list[int]:
    """A repeated integer field, packed (wire type 2) or not."""
    if isinstance(value, int):
        return [value]
    out, i = [], 0
    while i < len(value):
        x, i = _varint(value, i)
        out.append(x)
    return out


@dataclass
class CpuProfile:
    """Each sample as its stack of function names, leaf first, with its CPU nanoseconds."""

    samples: list[tuple[list[str], int]]

    @property
    def total_ns(self) -> int:
        return sum(ns for _, ns in self.samples)

    def share(self, *names: str) -> float:
        """Fraction of all CPU in samples whose stack holds any of `names` (a prefix match)."""
        hit = sum(ns for stack, ns in self.samples if any(f.startswith(names) for f in stack))
        return hit / max(1, self.total_ns)

    def sites(self, prefix: str) -> dict[str, float]:
        """Share of all CPU in leaf functions starting with `prefix`, by call site: the first
        caller outside Go's standard library, with the standard-library reader that fed the hash
        (and how many of it were nested: a site running one hashing reader inside another
        makes two passes, and two keys)."""
        by: collections.Counter[str] = collections.Counter()
        for stack, ns in self.samples:
            if not stack or not stack[0].startswith(prefix):
                continue
            via = []
            for f in stack[1:]:
                short = f.rsplit("/", 1)[-1]
                if "/" in f and "." in f.split("/", 1)[0]:  # github.com/…: not the standard library
                    # The reader that fed the hash, and how many of it were nested (one pass each).
                    feed = f" via {via[0]}" + (f" ×{via.count(via[0])}" if via.count(via[0]) > 1 else "") if via else ""
                    by[short + feed] += ns
                    break
                if not f.startswith(prefix):
                    via.append(short)
            else:
                by["?"] += ns
        total = max(1, self.total_ns)
        return {k: v / total for k, v in by.most_common()}


def parse(data: bytes) -> CpuProfile:
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    strings: list[str] = []
    raw_samples: list[tuple[list[int], list[int]]] = []
    locations: dict[int, list[int]] = {}
    functions: dict[int, int] = {}
    for number, _wire, value in _fields(data):
        if number == 6 and isinstance(value, bytes):  # string_table
            strings.append(value.decode(errors="replace"))
        elif number == 2 and isinstance(value, bytes):  # sample
            ids: list[int] = []
            values: list[int] = []
            for n, w, v in _fields(value):
                if n == 1:
                    ids += _ints(w, v)
                elif n == 2:
                    values += _ints(w, v)
            raw_samples.append((ids, values))
        elif number == 4 and isinstance(value, bytes):  # location
            loc_id, funcs = 0, []
            for n, _, v in _fields(value):
                if n == 1 and isinstance(v, int):
                    loc_id = v
                elif n == 4 and isinstance(v, bytes):  # line: its function_id
                    funcs += [x for m, _, x in _fields(v) if m == 1 and isinstance(x, int)]
            locations[loc_id] = funcs
        elif number == 5 and isinstance(value, bytes):  # function: id, name (a string index)
            fields = {n: v for n, _, v in _fields(value)}
            functions[int(fields.get(1, 0))] = int(fields.get(2, 0))
    samples = []
    for ids, values in raw_samples:
        stack = [strings[functions[f]] if f in functions else "?" for loc in ids for f in locations.get(loc, [])]
        samples.append((stack, values[-1] if values else 0))  # the last value is CPU nanoseconds
    return CpuProfile(samples)


def fetch(debug_url: str, seconds: int) -> CpuProfile:
    """Profile a Go server for `seconds` through its /debug/pprof endpoint (blocks that long)."""
    with urllib.request.urlopen(f"{debug_url}/debug/pprof/profile?seconds={seconds}", timeout=seconds + 30) as r:
        return parse(r.read())
