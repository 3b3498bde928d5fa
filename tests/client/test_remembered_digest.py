"""fxport/digest.py `remembered_sha256`: a file hashed once is not read again while it is unchanged,
and any change (in place, same size, same mtime) is hashed anew. Real files, real timestamps."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import pytest

from fxport import digest


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Every file sha256_file reads."""
    seen: list[Path] = []
    real = digest.sha256_file

    def counting(path: Path) -> tuple[str, int]:
        seen.append(Path(path))
        return real(path)

    monkeypatch.setattr(digest, "sha256_file", counting)
    return seen


def _settled(path: Path, racy_s: float) -> None:
    """Wait until the file's status change lies more than racy_s in the past (by the file's own clock)."""
    changed = path.stat().st_ctime_ns
    while time.time_ns() - changed < racy_s * 1e9 * 1.5:
        time.sleep(racy_s / 4)


def test_an_unchanged_file_is_hashed_once(tmp_path: Path, reads: list[Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(digest, "RACY_S", 0.2)
    model, cache = tmp_path / "model.pt2", tmp_path / "cache"
    model.write_bytes(b"weights" * 1000)
    _settled(model, digest.RACY_S)
    first = digest.remembered_sha256(model, cache)
    again = digest.remembered_sha256(model, cache)
    assert first == again == (_sha(b"weights" * 1000), 7000)
    assert reads == [model], "the unchanged file was read again"


def test_a_change_in_place_is_hashed_anew(tmp_path: Path, reads: list[Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(digest, "RACY_S", 0.2)
    model, cache = tmp_path / "model.pt2", tmp_path / "cache"
    model.write_bytes(b"a" * 4096)
    _settled(model, digest.RACY_S)
    stat = model.stat()
    assert digest.remembered_sha256(model, cache)[0] == _sha(b"a" * 4096)
    with model.open("r+b") as f:  # same size, and its mtime put back: only ctime tells
        f.write(b"b")
    os.utime(model, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert digest.remembered_sha256(model, cache)[0] == _sha(b"b" + b"a" * 4095)
    assert len(reads) == 2


def test_a_file_changed_just_now_is_not_remembered(tmp_path: Path, reads: list[Path],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Within the timestamp granularity a second write could leave every stamp as it was."""
    monkeypatch.setattr(digest, "RACY_S", 3600.0)
    model, cache = tmp_path / "model.pt2", tmp_path / "cache"
    model.write_bytes(b"x" * 10)
    digest.remembered_sha256(model, cache)
    digest.remembered_sha256(model, cache)
    assert len(reads) == 2
    assert not cache.exists() or not any(cache.iterdir())


def test_a_damaged_cache_entry_means_hashing(tmp_path: Path, reads: list[Path],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(digest, "RACY_S", 0.2)
    model, cache = tmp_path / "model.pt2", tmp_path / "cache"
    model.write_bytes(b"y" * 100)
    _settled(model, digest.RACY_S)
    digest.remembered_sha256(model, cache)
    (entry,) = cache.iterdir()
    entry.write_text("{not json")
    assert digest.remembered_sha256(model, cache)[0] == _sha(b"y" * 100)
    monkeypatch.setenv("FXPORT_DIGEST_CACHE", "0")
    assert digest.remembered_sha256(model, cache)[0] == _sha(b"y" * 100)
    assert len(reads) == 3
    with pytest.raises(FileNotFoundError):
        digest.remembered_sha256(tmp_path / "missing.pt2", cache)
