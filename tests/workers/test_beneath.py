"""The worker reads what a sandbox wrote without following its links (workers/sandbox/beneath.py),
and the early upload keeps to that while a child swaps folders for symlinks under it."""

from __future__ import annotations

import os
import random
import threading
import time
from pathlib import Path

import pytest

from fxport.errors import SandboxViolation
from fxport.jobs import new_job_id
from fxport.storage import FileStore
from fxport.workers.sandbox import beneath

SECRET = b"worker-only secret 7f3a"


@pytest.fixture()
def tree(tmp_path: Path) -> tuple[Path, Path]:
    """out/ (the child's) with a file and a folder, and secret/ (the worker's alone)."""
    out, secret = tmp_path / "out", tmp_path / "secret"
    (out / "fx_source").mkdir(parents=True)
    (out / "model.onnx").write_bytes(b"onnx")
    (out / "fx_source" / "module.py").write_text("class M: pass\n")
    secret.mkdir()
    (secret / "module.py").write_bytes(SECRET)
    return out, secret


def names(out: Path, **kw: object) -> list[str]:
    with beneath.opened_dir(out) as fd:
        found = list(beneath.walk_files(fd, max_files=100, **kw))
    for f in found:
        f.close()
    return [f.name for f in found]


def test_regular_files_are_listed_and_read_through_their_handle(tree):
    out, _ = tree
    assert names(out, strict=True) == ["fx_source/module.py", "model.onnx"]
    with beneath.opened_dir(out) as fd:
        f = beneath.open_file(fd, "fx_source/module.py")
        (out / "fx_source" / "module.py").unlink()  # the name goes; the handle still reads the file checked
        try:
            assert f.path.read_bytes() == b"class M: pass\n"
        finally:
            f.close()


def test_a_folder_swapped_for_a_symlink_is_never_followed(tree):
    out, secret = tree
    (out / "fx_source").rename(out / "was")
    (out / "fx_source").symlink_to(secret)
    assert names(out, strict=False) == ["model.onnx", "was/module.py"]  # passed over while the child runs
    with pytest.raises(beneath.Unsafe, match="fx_source"):
        names(out, strict=True)  # refused once it has exited
    with beneath.opened_dir(out) as fd, pytest.raises(beneath.Unsafe):
        beneath.open_file(fd, "fx_source/module.py")


def test_links_fifos_and_hard_links_are_refused_and_a_fifo_does_not_hang(tree, tmp_path: Path):
    out, secret = tree
    (out / "link.onnx").symlink_to(secret / "module.py")
    os.mkfifo(out / "pipe.onnx")
    os.link(secret / "module.py", out / "hard.onnx")  # what a child without Landlock could plant
    with beneath.opened_dir(out) as fd:
        for name in ("link.onnx", "pipe.onnx", "hard.onnx"):
            with pytest.raises(beneath.Unsafe):
                beneath.open_file(fd, name)
        for bad in ("../secret/module.py", "/etc/passwd", "a/./b", ""):
            with pytest.raises(beneath.Unsafe):
                beneath.open_beneath(fd, bad)
    assert names(out, strict=False) == ["fx_source/module.py", "model.onnx"]


def test_reads_of_what_the_child_wrote_are_bounded(tmp_path: Path):
    (tmp_path / "result.json").write_text("{}")
    with open(tmp_path / "big.json", "wb") as f:
        f.truncate(1 << 30)  # sparse: a child makes this in no time
    with open(tmp_path / "log", "wb") as f:
        f.seek(1 << 30)
        f.write(b"the end")
    with beneath.opened_dir(tmp_path) as fd:
        assert beneath.read_bounded(fd, "result.json", 1 << 20, "result.json") == b"{}"
        with pytest.raises(SandboxViolation, match=r"1024 MiB big.json, over the 16 MiB limit"):
            beneath.read_bounded(fd, "big.json", 16 << 20, "big.json")
        assert beneath.tail_bounded(fd, "log", 7) == b"the end"


def test_too_many_files_is_a_named_violation(tmp_path: Path):
    for i in range(5):
        (tmp_path / f"f{i}").write_text("x")
    with pytest.raises(SandboxViolation, match="more than 3 files"):
        with beneath.opened_dir(tmp_path) as fd:
            for f in beneath.walk_files(fd, strict=True, max_files=3):
                f.close()


def test_replacing_a_file_never_writes_through_a_symlink(tmp_path: Path):
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "manifest.json").symlink_to(victim)
    with beneath.opened_dir(tmp_path / "out") as fd:
        beneath.replace_file(fd, "manifest.json", b"{}")
    assert victim.read_text() == "keep me"
    assert not (tmp_path / "out" / "manifest.json").is_symlink()
    assert (tmp_path / "out" / "manifest.json").read_text() == "{}"


def test_the_early_upload_never_uploads_through_a_swapped_folder(tree, tmp_path: Path):
    """A child flips a folder of its output between a real one and a symlink to a folder only
    the worker can read while the early upload scans over and over: no object in the store ever
    holds the worker's file. (Before uploads opened files beneath the folder, 648 of 1097 such
    scans in 3 s uploaded it.)"""
    from fxport.workers.artifact_upload import EarlyUpload

    out, secret = tree
    store = FileStore(tmp_path / "store")
    job_id = new_job_id()
    early = EarlyUpload(store, "default", job_id, out, tmp_path / "spool")
    stop = threading.Event()
    flips = [0]

    def flip() -> None:  # each state held a moment: a listing sees the folder, the open meets the link
        real, side = out / "fx_source", out / "fx_source.real"
        while not stop.is_set():
            time.sleep(random.random() * 0.0005)
            real.rename(side)
            real.symlink_to(secret)
            time.sleep(random.random() * 0.0005)
            real.unlink()
            side.rename(real)
            flips[0] += 1

    flipper = threading.Thread(target=flip)
    flipper.start()
    try:
        deadline = time.monotonic() + 3.0
        scans = 0
        while time.monotonic() < deadline or scans < 50:
            early._seen.clear()
            early._scan()
            scans += 1
    finally:
        stop.set()
        flipper.join()
    assert flips[0] > 100, "the flipper did not run alongside the scans"
    stored = store.list_prefix(f"default/jobs/{job_id}/")
    assert stored, "nothing was uploaded at all"
    for obj in stored:
        assert SECRET not in b"".join(store.iter_chunks(obj.key)), obj.key
