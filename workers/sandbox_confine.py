"""Confine the sandbox child beyond its rlimits, before any user code runs (Linux only).

- no new processes: a seccomp filter refuses fork/vfork/clone without CLONE_THREAD (threads
  still work), so a fork bomb fails at its first fork and no grandchild outlives a kill;
- writes only beneath the job's own folders (Landlock): the rest of the filesystem is
  read-only to the model, whatever the process's uid;
- no TCP connect/bind (Landlock ABI ≥ 4): the network stays closed even where a network
  namespace can't be had (a Kubernetes pod without CAP_SYS_ADMIN);
- no signals to, ptrace of, or /proc/<pid>/environ reads from processes outside the
  sandbox (Landlock scoping, ABI ≥ 6 for signals; ptrace/environ from ABI 1);
- no capabilities, and no_new_privs, so running the worker as root grants the model nothing.

Each part is applied where the kernel allows; `confine` returns what was applied, and the
manifest's `sandbox` records it. Everything here must run while the process has one thread:
Landlock, seccomp and capabilities apply per thread, and threads created later inherit them.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import resource
import signal
import struct
from pathlib import Path
from typing import Any, Iterable

PR_SET_PDEATHSIG = 1
PR_SET_SECCOMP = 22
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
SECCOMP_MODE_FILTER = 2
_LINUX_CAPABILITY_VERSION_3 = 0x20080522

# Landlock (include/uapi/linux/landlock.h); the syscall numbers are the same on every architecture.
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
LANDLOCK_CREATE_RULESET_VERSION = 1
LANDLOCK_RULE_PATH_BENEATH = 1
FS_WRITE_FILE = 1 << 1
FS_WRITE_ACCESS = (
    FS_WRITE_FILE | 1 << 4 | 1 << 5 | 1 << 6 | 1 << 7 | 1 << 8 | 1 << 9 | 1 << 10 | 1 << 11 | 1 << 12
)  # write, remove dir/file, make char/dir/reg/sock/fifo/block/sym
FS_REFER, FS_TRUNCATE = 1 << 13, 1 << 14  # ABI 2, ABI 3
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1  # ABI 4
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1  # ABI 6

# seccomp: per architecture, (AUDIT_ARCH, clone, clone3, [fork, vfork]).
_ARCHES = {
    "x86_64": (0xC000003E, 56, 435, (57, 58)),
    "aarch64": (0xC00000B7, 220, 435, ()),
}
CLONE_THREAD = 0x00010000
_X32_SYSCALL_BIT = 0x40000000
SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_ERRNO = 0x00050000

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process as soon as its parent ends. A worker killed at its hard time limit
    (or by the OOM killer) must not leave a hung model running on its own: its warm children
    die with the zygote, which ends when the worker does, and a cold child dies with the worker."""
    _libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent ended before the signal was armed
        os._exit(70)


def _syscall(*args: Any) -> int:
    return _libc.syscall(*args)


def landlock_abi() -> int:
    """The kernel's Landlock ABI version, 0 when Landlock is unavailable."""
    res = _syscall(SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(LANDLOCK_CREATE_RULESET_VERSION))
    return max(int(res), 0)


def _no_new_privs() -> bool:
    return _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0


def restrict_filesystem_and_network(writable: Iterable[Path], abi: int) -> dict[str, Any]:
    """Landlock: writes only beneath `writable` (plus opening existing device files for
    writing: /dev/null, GPU device nodes), no TCP, scoped signals and abstract sockets."""
    fs = FS_WRITE_ACCESS | (FS_REFER if abi >= 2 else 0) | (FS_TRUNCATE if abi >= 3 else 0)
    net = NET_BIND_TCP | NET_CONNECT_TCP if abi >= 4 else 0
    scoped = SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if abi >= 6 else 0
    attr = struct.pack("=QQQ", fs, net, scoped)[: 24 if abi >= 6 else 16 if abi >= 4 else 8]
    buf = ctypes.create_string_buffer(attr, len(attr))
    ruleset = _syscall(SYS_LANDLOCK_CREATE_RULESET, buf, ctypes.c_size_t(len(attr)), ctypes.c_uint32(0))
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset: " + os.strerror(ctypes.get_errno()))
    try:
        rules = [(Path(p), fs) for p in writable] + [(Path("/dev"), FS_WRITE_FILE | (FS_TRUNCATE if abi >= 3 else 0))]
        for path, access in rules:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            try:
                rule = ctypes.create_string_buffer(struct.pack("=Qi", access, fd), 12)
                if _syscall(SYS_LANDLOCK_ADD_RULE, ruleset, LANDLOCK_RULE_PATH_BENEATH, rule, ctypes.c_uint32(0)) != 0:
                    raise OSError(ctypes.get_errno(), f"landlock_add_rule {path}: " + os.strerror(ctypes.get_errno()))
            finally:
                os.close(fd)
        if _syscall(SYS_LANDLOCK_RESTRICT_SELF, ruleset, ctypes.c_uint32(0)) != 0:
            raise OSError(ctypes.get_errno(), "landlock_restrict_self: " + os.strerror(ctypes.get_errno()))
    finally:
        os.close(ruleset)
    return {"filesystem_writes_confined": True, "tcp_blocked": bool(net), "signals_scoped": bool(scoped)}


def _bpf_stmt(code: int, k: int) -> bytes:
    return struct.pack("=HBBI", code, 0, 0, k)


def _bpf_jump(code: int, k: int, jt: int, jf: int) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def no_new_processes_filter(machine: str | None = None) -> bytes:
    """A seccomp BPF program: process-creating clone/fork/vfork fail with EAGAIN/EPERM,
    clone3 with ENOSYS (so libc falls back to clone, whose flags the filter can read), and
    syscalls of a foreign ABI (i386 int 0x80, x32) with ENOSYS. Everything else is allowed."""
    arch, clone, clone3, forks = _ARCHES[machine or platform.machine()]
    ld_w_abs, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    allow = _bpf_stmt(ret, SECCOMP_RET_ALLOW)
    enosys = _bpf_stmt(ret, SECCOMP_RET_ERRNO | errno.ENOSYS)
    eperm = _bpf_stmt(ret, SECCOMP_RET_ERRNO | errno.EPERM)
    eagain = _bpf_stmt(ret, SECCOMP_RET_ERRNO | errno.EAGAIN)
    # Layout, with the four return statements at the end: ... | ALLOW | ENOSYS | EPERM | EAGAIN
    body: list[tuple[str, int, str | None, str | None]] = [
        ("ld", 4, None, None),                       # seccomp_data.arch
        ("jeq", arch, None, "ENOSYS"),
        ("ld", 0, None, None),                       # seccomp_data.nr
        ("jge", _X32_SYSCALL_BIT, "ENOSYS", None),
        ("jeq", clone3, "ENOSYS", None),
        *[("jeq", nr, "EPERM", None) for nr in forks],
        ("jeq", clone, None, "ALLOW"),
        ("ld", 16, None, None),                      # args[0] (clone flags), low 32 bits (little-endian)
        ("jset", CLONE_THREAD, "ALLOW", "EAGAIN"),
    ]
    labels = {"ALLOW": len(body), "ENOSYS": len(body) + 1, "EPERM": len(body) + 2, "EAGAIN": len(body) + 3}
    out = b""
    for i, (op, k, jt, jf) in enumerate(body):
        if op == "ld":
            out += _bpf_stmt(ld_w_abs, k)
            continue
        t = labels[jt] - i - 1 if jt else 0
        f = labels[jf] - i - 1 if jf else 0
        out += _bpf_jump({"jeq": jeq, "jge": jge, "jset": jset}[op], k, t, f)
    return out + allow + enosys + eperm + eagain


def forbid_new_processes() -> None:
    program = no_new_processes_filter()
    buf = ctypes.create_string_buffer(program, len(program))

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    prog = SockFprog(len(program) // 8, ctypes.cast(buf, ctypes.c_void_p))
    if _libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "seccomp: " + os.strerror(ctypes.get_errno()))


def drop_capabilities() -> bool:
    """Empty bounding, ambient, effective, permitted and inheritable sets (a no-op for an
    unprivileged process). Returns whether the process ends with no capabilities."""
    try:
        last = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    except (OSError, ValueError):
        last = 63
    for cap in range(last + 1):
        _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)  # EPERM without CAP_SETPCAP: nothing to drop then
    _libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    header = ctypes.create_string_buffer(struct.pack("=Ii", _LINUX_CAPABILITY_VERSION_3, 0), 8)
    data = ctypes.create_string_buffer(b"\0" * 24, 24)
    _libc.capset(header, data)
    try:
        status = Path("/proc/self/status").read_text()
        eff = next(line.split()[1] for line in status.splitlines() if line.startswith("CapEff:"))
        return int(eff, 16) == 0
    except (OSError, StopIteration, ValueError):
        return False


def confine(writable: Iterable[Path]) -> dict[str, Any]:
    """Apply every confinement the kernel allows; returns what was applied (for the manifest)
    and, under "errors", why a part could not be."""
    info: dict[str, Any] = {"no_new_processes": False, "filesystem_writes_confined": False, "tcp_blocked": False,
                            "signals_scoped": False, "capabilities_dropped": False, "landlock_abi": 0}
    errors: list[str] = []
    if platform.system() != "Linux":
        return {**info, "errors": ["not Linux: only resource limits apply"]}
    if not _no_new_privs():
        errors.append("prctl(PR_SET_NO_NEW_PRIVS) failed: " + os.strerror(ctypes.get_errno()))
    abi = landlock_abi()
    info["landlock_abi"] = abi
    if abi > 0:
        try:
            info.update(restrict_filesystem_and_network(writable, abi))
        except OSError as exc:
            errors.append(str(exc))
    else:
        errors.append("Landlock is not available in this kernel (writes and TCP are not confined)")
    try:
        if platform.machine() not in _ARCHES:
            raise OSError(errno.ENOSYS, f"no seccomp filter for {platform.machine()}")
        forbid_new_processes()
        info["no_new_processes"] = True
    except OSError as exc:
        errors.append(str(exc))
    info["capabilities_dropped"] = drop_capabilities()
    if errors:
        info["errors"] = errors
    return info


# -- Graphviz `dot` for the job report, outside the engine's sandbox ------------------------

DOT_MEMORY_BYTES = 1 << 30
DOT_CPU_S = 30


def _confine_dot() -> None:
    """preexec_fn of `dot` (the forked child, one thread, before exec): rlimits, then `confine`
    with nothing writable — no writes, no TCP, no new processes, no capabilities. Imports nothing:
    it runs between fork and exec of a process that may have other threads (the embedded server)."""
    resource.setrlimit(resource.RLIMIT_AS, (DOT_MEMORY_BYTES, DOT_MEMORY_BYTES))
    resource.setrlimit(resource.RLIMIT_CPU, (DOT_CPU_S, DOT_CPU_S))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    confine([])


def confined_dot(source: bytes) -> bytes:
    """`dot -Tsvg` for a report drawn from an untrusted manifest (fxport/report.py `DotLayout`).

    The engine's sandbox may not start processes, so report.html is drawn by its trusted
    parent (workers/sandbox.py). The graph's labels come from the model (node names and
    targets, escaped and quoted in the DOT source), so `dot` runs confined like the sandbox:
    an empty environment (no credentials), an empty working folder, address-space and CPU
    limits, and `confine([])` — nothing writable, no TCP, no new processes, no ptrace or
    /proc/<pid>/environ of the worker."""
    import subprocess
    import tempfile

    from fxport.report import DOT_TIMEOUT_S, find_dot

    search = os.environ.get("PATH", "/usr/bin:/bin")
    dot = find_dot(search)  # before the fork: none at all without Graphviz
    with tempfile.TemporaryDirectory(prefix="fxport-dot-") as cwd:
        return subprocess.run([dot, "-Tsvg"], input=source, capture_output=True, check=True, cwd=cwd,
                              env={"PATH": search, "LC_ALL": "C.UTF-8"},
                              preexec_fn=_confine_dot if platform.system() == "Linux" else None,
                              timeout=DOT_TIMEOUT_S).stdout
