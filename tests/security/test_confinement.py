"""The sandbox's confinement primitives on their own (workers/sandbox/confine.py) and the
loader's decompression-bomb guard (workers/engine/load.py): fast, no service needed."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

from fxport.errors import UnsupportedModelFormat
from fxport.workers.engine.load import detect_format
from fxport.workers.sandbox.confine import MAX_JOB_TASKS, landlock_abi, release_tasks_bound, seccomp_program
from tests.security.hostile import thread_hog, zip_bomb

PROBE = r"""
import ctypes, json, os, resource, socket, subprocess, sys, threading
from fxport.workers.sandbox.confine import apply_limits, bound_tasks, confine
inside, granted, outside, denied, port, unix_path, gpu = sys.argv[1:8]
# another process of the same uid, as every other job's child, the zygote and the worker are
neighbour = subprocess.Popen(["sleep", "120"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
isolated = apply_limits(1 << 33, 60, True)
tasks_bounded = bound_tasks()
info = {**confine([inside], [granted], gpu=gpu == "gpu"), "tasks_bounded": tasks_bounded}
out = {"info": info, "isolated": isolated, "neighbour": neighbour.pid, "pid": os.getpid()}
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
# the calls the kernel allows between processes of one uid: on the caller only
other, me = neighbour.pid, os.getpid()
attempt("prlimit_other", lambda: resource.prlimit(other, resource.RLIMIT_NOFILE, (512, 512)))
attempt("prlimit_other_read", lambda: resource.prlimit(other, resource.RLIMIT_NOFILE))
attempt("prlimit_self", lambda: resource.prlimit(0, resource.RLIMIT_CORE, (0, 0)))
attempt("prlimit_own_pid", lambda: resource.prlimit(me, resource.RLIMIT_CORE, (0, 0)))
attempt("setrlimit_self", lambda: resource.setrlimit(resource.RLIMIT_CORE, (0, 0)))
attempt("renice_other", lambda: os.setpriority(os.PRIO_PROCESS, other, 19))
attempt("renice_user", lambda: os.setpriority(os.PRIO_USER, os.getuid(), 19))
attempt("renice_self", lambda: os.setpriority(os.PRIO_PROCESS, 0, 1))
attempt("affinity_other", lambda: os.sched_setaffinity(other, {0}))
attempt("affinity_self", lambda: os.sched_setaffinity(0, os.sched_getaffinity(0)))
attempt("scheduler_other", lambda: os.sched_setscheduler(other, os.SCHED_BATCH, os.sched_param(0)))
attempt("sched_param_other", lambda: os.sched_setparam(other, os.sched_param(0)))
attempt("sched_attr_other", lambda: syscall(314, other, ctypes.create_string_buffer(56), 0))
attempt("ioprio_other", lambda: syscall(251, 1, other, (3 << 13)))  # IOPRIO_WHO_PROCESS, class idle
attempt("ioprio_self", lambda: syscall(251, 1, 0, (2 << 13) | 4))  # best effort, its default level
attempt("inotify", lambda: syscall(294, 0))
attempt("fanotify", lambda: syscall(300, 0, 0))
attempt("cgroup_tree", lambda: os.listdir("/sys/fs/cgroup"))
# threads: bounded per job, whatever else the uid runs
def threads(held, refused):
    out["threads_held"], out["threads_error"] = held, refused
{THREAD_HOG}
print(json.dumps(out))
""".replace("{THREAD_HOG}", thread_hog("threads", at_most=3000))

UNPRIVILEGED_UID = 10001  # a pod's securityContext.runAsUser, with no capabilities
MODES = {"full capabilities": [], "no CAP_SYS_ADMIN": ["setpriv", "--bounding-set", "-sys_admin", "--"],
         f"uid {UNPRIVILEGED_UID}": ["setpriv", f"--reuid={UNPRIVILEGED_UID}", f"--regid={UNPRIVILEGED_UID}",
                                     "--clear-groups", "--inh-caps=-all", "--bounding-set=-all", "--"]}
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
    "prlimit_other": errno.EPERM, "prlimit_other_read": errno.EPERM, "prlimit_self": "allowed",
    "prlimit_own_pid": "allowed", "setrlimit_self": "allowed", "renice_other": errno.EPERM,
    "renice_user": errno.EPERM, "renice_self": "allowed", "affinity_other": errno.EPERM, "affinity_self": "allowed",
    "scheduler_other": errno.EPERM, "sched_param_other": errno.EPERM, "sched_attr_other": errno.EPERM,
    "ioprio_other": errno.EPERM, "ioprio_self": "allowed", "inotify": errno.EPERM, "fanotify": errno.EPERM,
    "cgroup_tree": errno.EACCES,
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
    """The child's layers on their own, as a worker with all capabilities, as a Kubernetes pod's
    (no CAP_SYS_ADMIN: no network namespace) and as an unprivileged uid with no capabilities: no
    socket of any family, no io_uring, no process, no read or write outside what it was given,
    nothing of its parent, and nothing of another process of its uid (its limits, priority, CPUs,
    scheduling and I/O class stay its own). A GPU job's child (a TensorRT build) may make AF_UNIX
    sockets of its own but reach no other socket."""
    if MODES[mode] and shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is not installed")
    if mode.startswith("uid") and os.geteuid() != 0:
        pytest.skip("changing to another uid needs root")
    if mode.startswith("uid"):  # pytest's temp folders are its user's alone
        tmp_path = Path(tempfile.mkdtemp(prefix="fxport-confine-"))
        tmp_path.chmod(0o777)
    inside, granted, denied = tmp_path / "inside", tmp_path / "granted.txt", tmp_path / "denied.txt"
    inside.mkdir()
    granted.write_text("yours")
    denied.write_text("not yours")
    if mode.startswith("uid"):
        for path in (inside, granted, denied):
            os.chown(path, UNPRIVILEGED_UID, UNPRIVILEGED_UID)
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
        if mode.startswith("uid"):
            shutil.rmtree(tmp_path, ignore_errors=True)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    info, isolated = out.pop("info"), out.pop("isolated")
    neighbour = out.pop("neighbour")
    with contextlib.suppress(ProcessLookupError):
        os.kill(neighbour, signal.SIGKILL)
    release_tasks_bound(out.pop("pid"))
    held, error = out.pop("threads_held"), out.pop("threads_error", None)
    assert 500 < held < MAX_JOB_TASKS and error and "can't start new thread" in error, (held, error)
    assert info["tasks_bounded"] == ("rlimit_nproc" if mode.startswith("uid") else "pids_cgroup"), info
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
            assert len(prog) % 8 == 0 and 30 < len(prog) // 8 < 100
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
