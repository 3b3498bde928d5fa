"""The sandbox's confinement primitives on their own (workers/sandbox/confine.py) and the
loader's decompression-bomb guard (workers/engine/load.py): fast, no service needed."""

from __future__ import annotations

import errno
import json
import platform
import shutil
import socket
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from fxport.errors import UnsupportedModelFormat
from fxport.workers.engine.load import detect_format
from fxport.workers.sandbox.confine import landlock_abi, seccomp_program
from tests.security.hostile import zip_bomb

PROBE = r"""
import ctypes, json, os, socket, sys, threading
from fxport.workers.sandbox.confine import apply_limits, confine
inside, granted, outside, denied, port, unix_path, gpu = sys.argv[1:8]
isolated = apply_limits(1 << 33, 60, True)
info = confine([inside], [granted], gpu=gpu == "gpu")
out = {"info": info, "isolated": isolated}
libc = ctypes.CDLL(None, use_errno=True)
def attempt(name, fn):
    try:
        fn()
        out[name] = "allowed"
    except OSError as exc:
        out[name] = exc.errno
def syscall(nr, *args):
    if libc.syscall(nr, *args) < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
attempt("write_inside", lambda: open(os.path.join(inside, "f"), "w").write("x"))
attempt("write_outside", lambda: open(outside, "w").write("x"))
attempt("read_granted", lambda: open(granted).read())
attempt("read_denied", lambda: open(denied).read())
attempt("read_shadow", lambda: open("/etc/shadow").read())
attempt("read_parent_status", lambda: open(f"/proc/{os.getppid()}/status").read())
attempt("read_own_status", lambda: open("/proc/self/status").read())
attempt("devnull", lambda: open(os.devnull, "w").write("x"))
attempt("dev_shm", lambda: open(f"/dev/shm/fxport-probe-{os.getpid()}", "w").write("x"))
attempt("tcp", lambda: socket.create_connection(("127.0.0.1", int(port)), timeout=2).close())
attempt("udp", lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"x", ("127.0.0.1", int(port))))
attempt("unix", lambda: socket.socket(socket.AF_UNIX).connect(unix_path))
attempt("netlink", lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0))
attempt("packet", lambda: socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0))
attempt("socketpair", lambda: socket.socketpair())
def unix_dgram_to(path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.sendto(b"x", path)
attempt("unix_sendto", lambda: unix_dgram_to(unix_path + ".dgram"))
def unix_sendmsg(path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.sendmsg([b"x"], [], 0, path)
attempt("unix_sendmsg", lambda: unix_sendmsg(unix_path + ".dgram"))
attempt("abstract_bind", lambda: socket.socket(socket.AF_UNIX).bind(b"\0fxport-probe-%d" % os.getpid()))
attempt("name_own_thread", lambda: open(f"/proc/self/task/{threading.get_native_id()}/comm", "w").write("fxport"))
attempt("io_uring", lambda: syscall(425, 8, ctypes.create_string_buffer(120)))
attempt("ptrace", lambda: syscall(101, 0, 0, 0, 0))  # PTRACE_TRACEME
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

MODES = {"full capabilities": [], "no CAP_SYS_ADMIN": ["setpriv", "--bounding-set", "-sys_admin", "--"]}
# What a CPU job's child may do; a GPU job's (a TensorRT build) differs only as GPU_DIFFERS says.
CPU_EXPECTED = {
    "write_inside": "allowed", "read_granted": "allowed", "read_own_status": "allowed", "devnull": "allowed",
    "thread": "allowed",
    "write_outside": errno.EACCES, "read_denied": errno.EACCES, "read_shadow": errno.EACCES,
    "read_parent_status": errno.EACCES, "parent_environ": errno.EACCES, "dev_shm": errno.EACCES,
    "name_own_thread": errno.EACCES,
    "tcp": errno.EPERM, "udp": errno.EPERM, "unix": errno.EPERM, "netlink": errno.EPERM, "packet": errno.EPERM,
    "socketpair": errno.EPERM, "unix_sendto": errno.EPERM, "unix_sendmsg": errno.EPERM, "abstract_bind": errno.EPERM,
    "io_uring": errno.EPERM, "ptrace": errno.EPERM, "signal_parent": errno.EPERM, "fork": errno.EAGAIN,
}
# CUDA does not start without these (error 304 on an H200; bench/gpu_check.py): AF_UNIX sockets of
# its own, bound (an abstract name), and its threads' names. Connecting or sending to any other
# socket is still refused ("unix", "unix_sendto", "unix_sendmsg" stay EPERM).
GPU_DIFFERS = {"socketpair": "allowed", "abstract_bind": "allowed", "name_own_thread": "allowed"}


@pytest.mark.skipif(sys.platform != "linux" or landlock_abi() < 6 or platform.machine() != "x86_64",
                    reason="needs x86_64 Linux with Landlock ABI >= 6")
@pytest.mark.parametrize("job", ["cpu", "gpu"])
@pytest.mark.parametrize("mode", list(MODES))
def test_every_layer_holds_with_and_without_cap_sys_admin(tmp_path: Path, mode: str, job: str):
    """The child's layers on their own, as a worker with all capabilities and as a Kubernetes
    pod's (no CAP_SYS_ADMIN: no network namespace): no socket of any family, no io_uring, no
    process, no read or write outside what it was given, nothing of its parent. A GPU job's
    child (a TensorRT build) may make AF_UNIX sockets of its own but reach no other socket."""
    if MODES[mode] and shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is not installed")
    inside, granted, denied = tmp_path / "inside", tmp_path / "granted.txt", tmp_path / "denied.txt"
    inside.mkdir()
    granted.write_text("yours")
    denied.write_text("not yours")
    outside = tmp_path / "outside-marker"
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    unix = socket.socket(socket.AF_UNIX)
    unix_path = str(tmp_path / "store.sock")  # like SeaweedFS's local sockets
    unix.bind(unix_path)
    unix.listen(1)
    dgram = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)  # like syslog's /dev/log
    dgram.bind(unix_path + ".dgram")
    dgram.setblocking(False)
    try:
        res = subprocess.run([*MODES[mode], sys.executable, "-c", PROBE, str(inside), str(granted), str(outside),
                              str(denied), str(listener.getsockname()[1]), unix_path, job],
                             capture_output=True, text=True, timeout=60)
        with pytest.raises(BlockingIOError):
            dgram.recv(16)  # nothing reached it
    finally:
        listener.close()
        unix.close()
        dgram.close()
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    info, isolated = out.pop("info"), out.pop("isolated")
    assert isolated is (not MODES[mode])  # a network namespace only with CAP_SYS_ADMIN
    for layer in ("no_new_processes", "sockets_blocked", "filesystem_reads_confined", "filesystem_writes_confined",
                  "tcp_blocked", "signals_scoped", "capabilities_dropped"):
        assert info[layer], (layer, info)
    assert info["unix_sockets_local"] is (job == "gpu")
    assert out == {**CPU_EXPECTED, **(GPU_DIFFERS if job == "gpu" else {})}
    assert not outside.exists()


INHERIT_PROBE = r"""
import json, mmap, os, sys
from fxport.workers.sandbox.confine import inherited_state
clean = inherited_state({0, 1, 2})
kept = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)  # a database a library keeps open
os.ftruncate(kept, 4096)
shared = mmap.mmap(kept, 4096, mmap.MAP_SHARED)  # a lock in shared memory
found = inherited_state({0, 1, 2})
print(json.dumps({"clean": clean, "found": found}))
"""


def test_inherited_descriptors_and_shared_mappings_are_found(tmp_path: Path):
    """What the child checks before the model runs (and fails closed on): a descriptor it did not
    open, a writable shared mapping. A fresh process has neither."""
    res = subprocess.run([sys.executable, "-c", INHERIT_PROBE, str(tmp_path / "db")], capture_output=True, text=True,
                         timeout=60, close_fds=True)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["clean"] == []
    assert any("file descriptor" in p and str(tmp_path / "db") in p for p in out["found"]), out
    assert any("writable shared mapping" in p and str(tmp_path / "db") in p for p in out["found"]), out


def test_seccomp_program_shape():
    for machine in ("x86_64", "aarch64"):
        for unix_sockets in (False, True):
            prog = seccomp_program(machine, unix_sockets=unix_sockets)
            assert len(prog) % 8 == 0 and 30 < len(prog) // 8 < 70
    with pytest.raises(KeyError):
        seccomp_program("sparc")


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


def test_a_gpu_jobs_own_unix_sockets_are_recorded_and_named():
    """The manifest and the worker's log say when a job's child could make AF_UNIX sockets (a
    TensorRT build), rather than a plain "no sockets"."""
    from fxport.isolation import describe_layers
    from fxport.workers.sandbox.layers import record

    measured = {"seccomp_filters": 1, "no_new_privs": True, "capabilities_dropped": True}
    reported = {"no_new_processes": True, "sockets_blocked": True, "filesystem_reads_confined": True,
                "filesystem_writes_confined": True, "inherited_state_clean": True}
    cpu = record(measured, {**reported, "unix_sockets_local": False})
    gpu = record(measured, {**reported, "unix_sockets_local": True})
    assert cpu["unix_sockets_local"] is False and gpu["unix_sockets_local"] is True
    assert "no sockets" in describe_layers(cpu)[0]
    have, missing = describe_layers(gpu)
    assert "no sockets but its own AF_UNIX ones" in have and "no sockets" not in have and not missing
