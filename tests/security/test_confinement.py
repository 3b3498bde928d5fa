"""The sandbox's confinement primitives on their own (workers/sandbox_confine.py) and the
loader's decompression-bomb guard (workers/engine/load.py): fast, no service needed."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from fxport.errors import UnsupportedModelFormat
from fxport.workers.engine.load import detect_format
from fxport.workers.sandbox_confine import landlock_abi, no_new_processes_filter
from tests.security.hostile import zip_bomb

PROBE = r"""
import json, os, socket, sys, threading
from fxport.workers.sandbox_confine import confine
inside, outside, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
info = confine([inside])
out = {"info": info}
def attempt(name, fn):
    try:
        fn()
        out[name] = "allowed"
    except OSError as exc:
        out[name] = exc.errno
attempt("write_inside", lambda: open(os.path.join(inside, "f"), "w").write("x"))
attempt("write_outside", lambda: open(outside, "w").write("x"))
attempt("devnull", lambda: open(os.devnull, "w").write("x"))
attempt("tcp", lambda: socket.create_connection(("127.0.0.1", port), timeout=2).close())
attempt("parent_environ", lambda: open(f"/proc/{os.getppid()}/environ", "rb").read())
attempt("signal_parent", lambda: os.kill(os.getppid(), 0))
def fork():
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
attempt("fork", fork)
def thread():
    t = threading.Thread(target=lambda: None)
    t.start()
    t.join()
attempt("thread", thread)
print(json.dumps(out))
"""


@pytest.mark.skipif(sys.platform != "linux" or landlock_abi() < 4, reason="needs Linux with Landlock ABI >= 4")
def test_confine_blocks_processes_writes_tcp_and_ancestors(tmp_path: Path):
    import errno

    inside = tmp_path / "inside"
    inside.mkdir()
    outside = tmp_path / "outside-marker"
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    try:
        res = subprocess.run([sys.executable, "-c", PROBE, str(inside), str(outside), str(listener.getsockname()[1])],
                             capture_output=True, text=True, timeout=60)
    finally:
        listener.close()
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    info = out.pop("info")
    assert info["no_new_processes"] and info["filesystem_writes_confined"] and info["tcp_blocked"]
    assert out == {
        "write_inside": "allowed", "devnull": "allowed", "thread": "allowed",
        "write_outside": errno.EACCES, "tcp": errno.EACCES, "parent_environ": errno.EACCES,
        "signal_parent": errno.EPERM if info["signals_scoped"] else "allowed", "fork": errno.EAGAIN,
    }
    assert not outside.exists()


def test_seccomp_program_shape():
    for machine in ("x86_64", "aarch64"):
        prog = no_new_processes_filter(machine)
        assert len(prog) % 8 == 0 and 8 < len(prog) // 8 < 20
    with pytest.raises(KeyError):
        no_new_processes_filter("sparc")


def test_zip_bomb_is_refused_before_any_decompression(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    bomb = zip_bomb(tmp_path / "bomb.pt2", expanded_mib=64)
    assert bomb.stat().st_size < (1 << 20)

    def no_decompression(*a, **k):
        raise AssertionError("an entry was decompressed")

    monkeypatch.setattr(zipfile.ZipFile, "testzip", no_decompression)
    monkeypatch.setattr(zipfile.ZipFile, "open", no_decompression)
    with pytest.raises(UnsupportedModelFormat, match="decompression bomb: entry 'model/data/weights/weight_0' claims "
                                                      "67108864 bytes"):
        detect_format(bomb)


def test_many_small_entries_are_a_bomb_too(tmp_path: Path):
    path = tmp_path / "many.pt2"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zf:
        zf.writestr("m/archive_format", "pt2")
        one_mib = bytes(1 << 20)
        for i in range(100):
            zf.writestr(f"m/data/weights/weight_{i}", one_mib)
    with pytest.raises(UnsupportedModelFormat, match=r"its entries claim 104857603 bytes in all from a \d+-byte file"):
        detect_format(path)


def test_truncated_archive_is_not_misread_as_its_inner_zip(tiny_pt2: Path, tmp_path: Path):
    # A .pt2 stores torch.save zips uncompressed; cut off the outer directory and zipfile finds the inner one.
    cut = tmp_path / "cut.pt2"
    cut.write_bytes(tiny_pt2.read_bytes()[:-300])
    with pytest.raises(UnsupportedModelFormat, match="truncated or corrupt"):
        detect_format(cut)
    assert detect_format(tiny_pt2) == "torch_export"
