"""What a job's model can make the worker do is bounded (issue 40): the bytes and files it writes
while it runs (DiskWatch), the shape of the manifest it hands back, and the report drawn from it."""

from __future__ import annotations

import copy
import json
import os
import time
from pathlib import Path

import pytest

from fxport.report import MAX_REPORT_ITEMS, render_report
from fxport.workers.sandbox.run import DiskWatch, manifest_shape_violation

FIXTURE = Path(__file__).resolve().parents[1] / "report" / "fixtures" / "manifest_resnet18_int8.json"


def _sparse(path: Path, size: int) -> None:
    with path.open("wb") as f:
        f.truncate(size)


def test_disk_watch_counts_sparse_files_at_their_full_size(tmp_path: Path) -> None:
    out, work = tmp_path / "out", tmp_path / "work"
    (out / "nested").mkdir(parents=True)
    work.mkdir()
    watch = DiskWatch((work, out), max_bytes=64 << 20, max_entries=100)
    (out / "model.onnx").write_bytes(b"x" * 1000)
    assert watch.check() is None
    _sparse(out / "nested" / "hole", 1 << 30)  # no disk used, 1 GiB to read or upload
    watch._next = 0.0
    excess = watch.check()
    assert excess is not None and "FXPORT_MAX_JOB_OUTPUT_BYTES" in excess, excess
    assert os.stat(out / "nested" / "hole").st_blocks == 0


def test_disk_watch_follows_no_link_and_bounds_entries(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    _sparse(elsewhere / "big", 1 << 30)
    out = tmp_path / "out"
    out.mkdir()
    (out / "link").symlink_to(elsewhere)  # what a child may swap in: never listed through
    watch = DiskWatch((out,), max_bytes=64 << 20, max_entries=50)
    assert watch.check() is None
    for i in range(60):
        (out / f"f{i}").write_bytes(b"")
    watch._next = 0.0
    assert "files and folders" in (watch.check() or "")


def test_disk_watch_looks_at_most_every_half_second(tmp_path: Path) -> None:
    watch = DiskWatch((tmp_path,), max_bytes=1 << 20, max_entries=10)
    assert watch.check() is None
    _sparse(tmp_path / "hole", 1 << 30)
    assert watch.check() is None  # within DISK_CHECK_S of the last look
    time.sleep(0.6)
    assert watch.check() is not None


def test_a_conversions_manifest_is_within_the_shape_bounds() -> None:
    assert manifest_shape_violation(json.loads(FIXTURE.read_text())) is None


@pytest.mark.parametrize("forge,said", [
    (lambda m: m["quantization"].update(layers=[{}] * 10_001), "has 10001 items at manifest.quantization.layers"),
    (lambda m: m.update(warnings=["x" * (65 << 10)]), "a string of 66560 characters at manifest.warnings[0]"),
    (lambda m: m.update(spec=json.loads("[" * 40 + "]" * 40)), "nests more than 32 levels deep at manifest.spec"),
    (lambda m: m.update(toolchain={f"k{i}": 1 for i in range(10_001)}), "has 10001 items at manifest.toolchain"),
])
def test_a_forged_manifest_is_refused_naming_the_path_and_bound(forge, said: str) -> None:
    manifest = json.loads(FIXTURE.read_text())
    forge(manifest)
    assert said in (manifest_shape_violation(manifest) or "")


def test_the_report_draws_a_bounded_part_of_a_huge_manifest() -> None:
    """A forged 4.7 MB manifest drew a 25 MB report in 7 s (measured on this suite's 2-core VM);
    bounded, its report is under 2 MB and says what it left out."""
    base = json.loads(FIXTURE.read_text())
    m = copy.deepcopy(base)
    m["verification"] = base["verification"] * 1000
    m["quantization"]["layers"] = base["quantization"]["layers"] * 1000
    m["profile"]["top_nodes"] = base["profile"]["top_nodes"] * 1000
    m["warnings"] = ["x" * 100_000] * 10
    page = render_report(m, layout=lambda source: b"<svg/>")
    assert len(page) < 2 << 20, len(page)
    assert f"This report draws at most {MAX_REPORT_ITEMS} items" in page
    assert "quantization.layers: 21000 items" in page and "warnings[0]: 100000 characters" in page
    assert "x" * 2001 not in page
    # a real manifest is drawn whole, with no note
    assert "This report draws at most" not in render_report(base, layout=lambda source: b"<svg/>")
