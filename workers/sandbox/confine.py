"""The child's own layers, applied by fxport's code in the child before any byte of the model
is read (Linux). Each holds without the others and without privileges:

- **seccomp** (any Linux ≥ 3.5, unprivileged with no_new_privs): no new processes (fork,
  vfork, clone without CLONE_THREAD; threads still work), no sockets of any family (socket,
  socketpair: not unix, inet, netlink or packet), no io_uring, and none of the calls that reach
  other processes or the kernel's shared state (ptrace, process_vm_*, bpf, perf_event_open,
  userfaultfd, keyrings, mounts, namespaces, inotify and fanotify); syscalls of a foreign ABI
  (i386, x32) fail too. The calls the kernel allows between processes of one uid (every job,
  the zygote and the worker share one) act on the caller only: prlimit64, setpriority,
  sched_setaffinity/setscheduler/setparam/setattr, ioprio_set, migrate_pages and move_pages
  succeed with the pid 0 or the child's own, and fail with EPERM for any other.
- **Landlock** (Linux ≥ 5.13): reads only beneath the interpreter, the installed packages, the
  shared libraries, a few system files and the job's own inputs and folders; writes only
  beneath the job's folders and to /dev/null-like devices; no TCP (ABI ≥ 4); no signals to
  and no abstract unix sockets of processes outside the sandbox (ABI ≥ 6).
- **capabilities** dropped, **no_new_privs** set, so a worker running as root grants nothing.

`confine` returns what it applied; the worker measures what it can itself (sandbox/layers.py)
and takes the rest from the child's first event, sent before the model is opened. Everything
here runs while the process has one thread: Landlock, seccomp and capabilities apply per
thread, and threads created later inherit them.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import platform
import resource
import signal
import socket
import struct
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

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
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FS_MAKE_AND_REMOVE = sum(1 << i for i in range(4, 13))  # remove dir/file, make char/dir/reg/sock/fifo/block/sym
FS_REFER, FS_TRUNCATE, FS_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15  # ABI 2, 3, 5
FS_READ = FS_EXECUTE | FS_READ_FILE | FS_READ_DIR
FS_FILE_ONLY = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV  # what a rule on a file may grant
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1  # ABI 4
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1  # ABI 6

# Devices a job may open for writing (and read): the sinks and sources every runtime uses.
WRITABLE_DEVICES = ("/dev/null", "/dev/zero", "/dev/full")
READABLE_DEVICES = ("/dev/urandom", "/dev/random")
# A TensorRT build talks to the GPU through these (NVIDIA's container runtime mounts them).
GPU_DEVICE_PREFIXES = ("/dev/nvidia", "/dev/dri")
GPU_READ_PATHS = ("/proc/driver/nvidia", "/proc/devices", "/sys/bus/pci", "/sys/devices", "/etc/nvidia")
# System files a Python process with torch and onnxruntime reads after start-up: the loader's
# cache, time zone, user database (getpwuid), locale data, and the CPU's description. Not
# /etc as a whole (shadow, ssl keys, the pod's mounted secrets live there or nearby).
SYSTEM_READ_PATHS = (
    "/usr", "/lib", "/lib64", "/lib32", "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d",
    "/etc/localtime", "/etc/passwd", "/etc/group", "/etc/nsswitch.conf",
    "/proc/self", "/proc/cpuinfo", "/proc/meminfo", "/proc/stat",
    "/sys/devices/system/cpu", "/sys/devices/system/node", *(f"/sys/fs/cgroup/{name}" for name in (
        # the container's CPU and memory limits, for a runtime that sizes its threads or memory by them
        # (cgroup v2, then v1); not the rest of the cgroup tree, which shows the host's
        "cpu.max", "memory.max", "cpu/cpu.cfs_quota_us", "cpu/cpu.cfs_period_us", "cpu,cpuacct/cpu.cfs_quota_us",
        "cpu,cpuacct/cpu.cfs_period_us", "memory/memory.limit_in_bytes")),
)

# seccomp: per architecture, the audit arch, clone, clone3 and fork/vfork (x86_64 only).
_ARCHES: dict[str, dict[str, Any]] = {
    "x86_64": {"audit_arch": 0xC000003E, "clone": 56, "clone3": 435, "forks": (57, 58)},
    "aarch64": {"audit_arch": 0xC00000B7, "clone": 220, "clone3": 435, "forks": ()},
}
# Refused outright: name → (x86_64, aarch64) number (asm/unistd_64.h, asm-generic/unistd.h;
# checked against both headers). Sockets of every family; io_uring (its own way to every
# syscall above); reaching other processes; kernel objects shared across the machine
# (bpf maps, perf events, keyrings); mounts and namespaces.
REFUSED_SYSCALLS: dict[str, tuple[int, int | None]] = {  # None: not on that architecture
    "socket": (41, 198), "socketpair": (53, 199),
    "io_uring_setup": (425, 425), "io_uring_enter": (426, 426), "io_uring_register": (427, 427),
    "ptrace": (101, 117), "process_vm_readv": (310, 270), "process_vm_writev": (311, 271), "kcmp": (312, 272),
    "pidfd_getfd": (438, 438),
    "bpf": (321, 280), "perf_event_open": (298, 241), "userfaultfd": (323, 282),
    "add_key": (248, 217), "request_key": (249, 218), "keyctl": (250, 219),
    "mount": (165, 40), "umount2": (166, 39), "pivot_root": (155, 41), "open_tree": (428, 428),
    "move_mount": (429, 429), "fsopen": (430, 430), "fsconfig": (431, 431), "fsmount": (432, 432),
    "fspick": (433, 433), "mount_setattr": (442, 442),
    "unshare": (272, 97), "setns": (308, 268), "open_by_handle_at": (304, 265),
    # watching files another job opens in the shared package folders; another process's memory
    "inotify_init": (253, None), "inotify_init1": (294, 26), "fanotify_init": (300, 262),
    "process_madvise": (440, 440), "process_mrelease": (448, 448),
    # a file's metadata by its path: Landlock governs reads and writes, not these, so a child could
    # chmod, chown, re-time or tag any file its uid owns outside its job (another job's folder, the
    # worker's own files). fchmod and fchown stay: they need a descriptor, which Landlock bounds
    # (the fx_source exporter sets its weights file's mode so).
    "chmod": (90, None), "fchmodat": (268, 53), "fchmodat2": (452, 452),
    "chown": (92, None), "lchown": (94, None), "fchownat": (260, 54),
    "utime": (132, None), "utimes": (235, None), "futimesat": (261, None), "utimensat": (280, 88),
    "setxattr": (188, 5), "lsetxattr": (189, 6), "fsetxattr": (190, 7), "setxattrat": (463, 463),
    "removexattr": (197, 14), "lremovexattr": (198, 15), "fremovexattr": (199, 16), "removexattrat": (466, 466),
}
# Calls that act on another process of the same uid when given its pid (issue 40: a model set
# RLIMIT_CPU on the Celery master, RLIMIT_AS on another tenant's child, reniced the zygote): allowed
# only on the caller. The pid is args[0] for these...
OWN_PID_ARG0: dict[str, tuple[int, int]] = {
    "prlimit64": (302, 261), "sched_setaffinity": (203, 122), "sched_setscheduler": (144, 119),
    "sched_setparam": (142, 118), "sched_setattr": (314, 274), "migrate_pages": (256, 238), "move_pages": (279, 239),
}
# ...and (which, who) for these: only `which` = a process (PRIO_PROCESS 0, IOPRIO_WHO_PROCESS 1).
OWN_WHO_ARG1: dict[str, tuple[tuple[int, int], int]] = {
    "setpriority": ((141, 140), 0), "ioprio_set": ((251, 30), 1),
}
# A GPU job may make AF_UNIX sockets (below, seccomp_program), but may not send on one to a
# socket it did not make itself: no connect, no send with an address.
UNIX_SENDS_REFUSED: dict[str, tuple[int, int]] = {
    "connect": (42, 203), "sendto": (44, 206), "sendmsg": (46, 211), "sendmmsg": (307, 269),
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
    res = _syscall(SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0),
                   ctypes.c_uint32(LANDLOCK_CREATE_RULESET_VERSION))
    return max(int(res), 0)


def _no_new_privs() -> bool:
    return _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0


# -- what the child may read -----------------------------------------------------------------


@functools.lru_cache(maxsize=1)  # the interpreter's prefixes and site folders: fixed for a process's life
def python_read_paths() -> tuple[Path, ...]:
    """The interpreter, its standard library, the installed packages and fxport's own code.

    Only paths below the interpreter's prefixes, the site-packages folders and fxport's
    package folders: sys.path may also hold the working directory of whoever started the
    worker ("/" for the zygote, a checkout for a developer), which must not become readable.
    Found without importing anything (the zygote computes it once, before it forks)."""
    import importlib.util
    import site

    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    paths = [Path(p) for p in sorted(roots)]
    try:
        paths += [Path(p) for p in site.getsitepackages()]
    except AttributeError:  # an old virtualenv's site module
        pass
    for name in ("fxport", "fxport.workers", "fxport.service", "fxport.client"):
        spec = importlib.util.find_spec(name)  # fxport's own packages, installed with this module
        if spec is not None:
            paths += [Path(p) for p in (spec.submodule_search_locations or ())]
    return tuple(paths)


def gpu_paths() -> tuple[list[Path], list[Path]]:
    """(device files to read, write and ioctl; folders to read) for a TensorRT build."""
    devices = []
    try:
        devices = [Path("/dev") / name for name in sorted(os.listdir("/dev"))
                   if any(f"/dev/{name}".startswith(p) for p in GPU_DEVICE_PREFIXES)]
    except OSError:
        pass
    return devices, [Path(p) for p in GPU_READ_PATHS]


# -- resource limits and the network namespace ----------------------------------------------

CLONE_NEWNET = 0x40000000
MAX_FILE_BYTES = 16 << 30
MAX_OPEN_FILES = 1024


MAX_JOB_TASKS = 1024  # threads (and processes, which seccomp refuses anyway) of one job's child
PIDS_CGROUP_V1 = Path("/sys/fs/cgroup/pids")
JOB_CGROUP_PREFIX = "fxport-job-"


def _pids_cgroup_dir() -> Path | None:
    """The cgroup v1 pids hierarchy's folder of this process's cgroup, where there is one."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "pids" in controllers.split(","):
            return PIDS_CGROUP_V1 / path.lstrip("/")
    return None


def bound_tasks(limit: int = MAX_JOB_TASKS) -> str | None:
    """Bound the threads this process (a job's child) may hold to `limit`, whatever else runs
    under its uid, and say how: "pids_cgroup" or "rlimit_nproc"; None where neither applies.

    - A pids cgroup of its own (`join_job_cgroup`), where this process may make one (root, or a
      delegated hierarchy). A spare child joins it while it waits for its job (moving a process
      into a cgroup can wait for an RCU grace period: 7 ms on a 2-core Intel Xeon VM).
    - Otherwise RLIMIT_NPROC at what the uid runs now, its own tasks aside, plus `limit`. That limit
      counts every task of the uid, so it is set from the count at the job's start; the kernel
      enforces it only on a non-root uid without CAP_SYS_ADMIN or CAP_SYS_RESOURCE (a pod's uid),
      which is where no cgroup can be made either."""
    if join_job_cgroup(limit):
        return "pids_cgroup"
    if os.getuid() == 0:
        return None  # RLIMIT_NPROC is not enforced for root
    others = _tasks_of_uid(os.getuid()) - len(os.listdir("/proc/self/task"))  # the uid's tasks but its own
    resource.setrlimit(resource.RLIMIT_NPROC, (others + limit, others + limit))
    return "rlimit_nproc"


def join_job_cgroup(limit: int = MAX_JOB_TASKS) -> bool:
    """Move this process into a pids cgroup of its own, `fxport-job-<pid>` beneath the worker's,
    with pids.max = `limit` (at once when it is there already). False where none can be made;
    `release_tasks_bound` removes it once the process has been reaped."""
    folder = _pids_cgroup_dir()
    if folder is None:
        return False
    if folder.name == f"{JOB_CGROUP_PREFIX}{os.getpid()}":
        return True  # joined ahead of its job (a spare child)
    job = folder / f"{JOB_CGROUP_PREFIX}{os.getpid()}"
    try:
        job.mkdir(exist_ok=True)
        (job / "pids.max").write_text(str(limit))
        (job / "cgroup.procs").write_text(str(os.getpid()))
        return True
    except OSError:
        with contextlib.suppress(OSError):
            job.rmdir()
        return False


def _tasks_of_uid(uid: int) -> int:
    """Threads of every process of `uid` now (what RLIMIT_NPROC counts)."""
    total = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat().st_uid != uid:
                continue
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                total += int(f.read().rsplit(b")", 1)[1].split()[17])  # num_threads
        except (OSError, ValueError, IndexError):
            continue
    return total


def release_tasks_bound(pid: int) -> None:
    """Remove the pids cgroup `join_job_cgroup` made for the child `pid`, now reaped (an empty
    cgroup). Called by the process that reaped it, from its own cgroup (the child's parent one)."""
    folder = _pids_cgroup_dir()
    if folder is not None:
        with contextlib.suppress(OSError):
            (folder / f"{JOB_CGROUP_PREFIX}{pid}").rmdir()


def release_stale_task_bounds() -> None:
    """Remove job cgroups whose child is gone (left by a worker that was killed)."""
    folder = _pids_cgroup_dir()
    if folder is None or not folder.is_dir():
        return
    with contextlib.suppress(OSError):
        for entry in folder.iterdir():
            pid = entry.name.removeprefix(JOB_CGROUP_PREFIX)
            if pid != entry.name and not Path("/proc", pid).exists():
                with contextlib.suppress(OSError):
                    entry.rmdir()


def apply_limits(memory_bytes: int, cpu_seconds: int, isolate_network: bool, limit_address_space: bool = True) -> bool:
    """rlimits (address space, CPU time, file size, open files, no core dumps), then an empty
    network namespace where the kernel allows one (CAP_SYS_ADMIN). Returns whether it could.
    The threads it may hold are bounded by `bound_tasks`, called beside it.

    `limit_address_space=False` (a TensorRT build): CUDA reserves far more virtual address
    space than it uses and fails to initialise under RLIMIT_AS, so there the container's
    memory limit is what bounds the job."""
    if limit_address_space:
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 5))
    resource.setrlimit(resource.RLIMIT_FSIZE, (MAX_FILE_BYTES, MAX_FILE_BYTES))
    resource.setrlimit(resource.RLIMIT_NOFILE, (MAX_OPEN_FILES, MAX_OPEN_FILES))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if not isolate_network or platform.system() != "Linux":
        return False
    return _libc.unshare(CLONE_NEWNET) == 0


# -- Landlock --------------------------------------------------------------------------------


def _handled_fs(abi: int) -> int:
    return (FS_READ | FS_WRITE_FILE | FS_MAKE_AND_REMOVE | (FS_REFER if abi >= 2 else 0)
            | (FS_TRUNCATE if abi >= 3 else 0) | (FS_IOCTL_DEV if abi >= 5 else 0))


def landlock_rules(writable: Iterable[Path], readable: Iterable[Path], abi: int, *,
                   gpu: bool = False) -> list[tuple[Path, int]]:
    """(path, access) pairs: the job's folders read-write, the rest read-only, devices as
    devices. Paths that do not exist here are left out (a distribution without /lib64, say)."""
    handled = _handled_fs(abi)
    rules: list[tuple[Path, int]] = [(Path(p), handled) for p in writable]
    read_only: list[str | Path] = [*SYSTEM_READ_PATHS, *python_read_paths(), *readable]
    rules += [(Path(p), FS_READ) for p in read_only]
    device = (FS_READ_FILE | FS_WRITE_FILE | FS_TRUNCATE | FS_IOCTL_DEV) & handled
    rules += [(Path(p), device) for p in WRITABLE_DEVICES]
    rules += [(Path(p), FS_READ_FILE) for p in READABLE_DEVICES]
    # its own peak-RSS mark, reset between the benchmark's measurements (workers/engine/benchmark.py)
    rules.append((Path("/proc/self/clear_refs"), FS_WRITE_FILE))
    if gpu:
        devices, folders = gpu_paths()
        rules += [(p, device) for p in devices] + [(p, FS_READ) for p in folders]
        # CUDA names the threads it starts (/proc/self/task/<tid>/comm) and fails to initialise,
        # error 304, when it cannot (measured on an H200, bench/gpu_check.py). Files of this
        # process's own threads: writing them reaches nothing outside the sandbox.
        rules.append((Path("/proc/self/task"), (FS_READ | FS_WRITE_FILE | FS_TRUNCATE) & handled))
    return rules


def restrict_filesystem_and_network(rules: Iterable[tuple[Path, int]], abi: int) -> dict[str, Any]:
    """Landlock: reads and writes only as `rules` (from `landlock_rules`) grant, no TCP, scoped
    signals and abstract unix sockets. Returns what it applied."""
    fs = _handled_fs(abi)
    net = NET_BIND_TCP | NET_CONNECT_TCP if abi >= 4 else 0
    scoped = SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if abi >= 6 else 0
    attr = struct.pack("=QQQ", fs, net, scoped)[: 24 if abi >= 6 else 16 if abi >= 4 else 8]
    buf = ctypes.create_string_buffer(attr, len(attr))
    ruleset = _syscall(SYS_LANDLOCK_CREATE_RULESET, buf, ctypes.c_size_t(len(attr)), ctypes.c_uint32(0))
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset: " + os.strerror(ctypes.get_errno()))
    try:
        for path, access in rules:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue  # not on this machine
            try:
                if not os.path.isdir(f"/proc/self/fd/{fd}"):
                    access &= FS_FILE_ONLY  # a rule on a file grants file rights only
                rule = ctypes.create_string_buffer(struct.pack("=Qi", access, fd), 12)
                if _syscall(SYS_LANDLOCK_ADD_RULE, ruleset, LANDLOCK_RULE_PATH_BENEATH, rule, ctypes.c_uint32(0)) != 0:
                    raise OSError(ctypes.get_errno(), f"landlock_add_rule {path}: " + os.strerror(ctypes.get_errno()))
            finally:
                os.close(fd)
        if _syscall(SYS_LANDLOCK_RESTRICT_SELF, ruleset, ctypes.c_uint32(0)) != 0:
            raise OSError(ctypes.get_errno(), "landlock_restrict_self: " + os.strerror(ctypes.get_errno()))
    finally:
        os.close(ruleset)
    return {"filesystem_reads_confined": True, "filesystem_writes_confined": True, "tcp_blocked": bool(net),
            "signals_scoped": bool(scoped)}


# -- seccomp ---------------------------------------------------------------------------------


def _bpf_stmt(code: int, k: int) -> bytes:
    return struct.pack("=HBBI", code, 0, 0, k)


def _bpf_jump(code: int, k: int, jt: int, jf: int) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


OWN_PID_SENTINEL = 0xFFFFFFFF  # no pid is -1: the program's place for the caller's own pid


def seccomp_program(machine: str | None = None, *, unix_sockets: bool = False, own_pid: int = 0) -> bytes:
    """`seccomp_template` with the caller's own pid in place (0: none but 0 is its own)."""
    template = seccomp_template(machine, unix_sockets=unix_sockets)
    jeq, pid = 0x15, struct.pack("=I", own_pid)
    rows = [template[i:i + 8] for i in range(0, len(template), 8)]  # struct sock_filter {u16 code; u8 jt, jf; u32 k}
    return b"".join(row[:4] + pid if struct.unpack_from("=H", row)[0] == jeq and row[4:] == b"\xff\xff\xff\xff"
                    else row for row in rows)


@functools.lru_cache(maxsize=8)  # keyed on its whole input (machine, unix_sockets)
def seccomp_template(machine: str | None = None, *, unix_sockets: bool = False) -> bytes:
    """A seccomp BPF program: sockets, io_uring and the calls in `refused` fail with EPERM;
    process-creating clone/fork/vfork with EAGAIN/EPERM; clone3 with ENOSYS (so libc falls
    back to clone, whose flags the filter can read); syscalls of a foreign ABI (i386 int 0x80,
    x32) with ENOSYS; the calls of OWN_PID_ARG0 and OWN_WHO_ARG1 with EPERM unless their pid is 0
    (the caller) or the caller's own (OWN_PID_SENTINEL here, put in by `seccomp_program`: a child
    forked from the zygote, which builds this once, only patches it). Everything else is allowed.

    `unix_sockets` (a GPU job): socket() and socketpair() of AF_UNIX are allowed, every other
    family still fails. NVIDIA's driver library makes both when CUDA starts, and CUDA fails
    to initialise without them (error 304; measured on an H200, bench/gpu_check.py)."""
    machine = machine or platform.machine()
    arch = _ARCHES[machine]
    which = list(_ARCHES).index(machine)
    socket_calls = [nr for name in ("socket", "socketpair") if (nr := REFUSED_SYSCALLS[name][which]) is not None]
    refused = [nr for numbers in REFUSED_SYSCALLS.values() if (nr := numbers[which]) is not None]
    own_pid_calls = [numbers[which] for numbers in OWN_PID_ARG0.values()]
    own_who_calls = [(numbers[which], who) for numbers, who in OWN_WHO_ARG1.values()]
    if unix_sockets:
        refused = [nr for nr in refused if nr not in socket_calls]
        refused += [numbers[which] for numbers in UNIX_SENDS_REFUSED.values()]
    ld_w_abs, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    # Layout, with the four return statements at the end: ... | ALLOW | ENOSYS | EPERM | EAGAIN
    body: list[tuple[str, int, str | None, str | None]] = [
        ("ld", 4, None, None),                       # seccomp_data.arch
        ("jeq", arch["audit_arch"], None, "ENOSYS"),
        ("ld", 0, None, None),                       # seccomp_data.nr
        ("jge", _X32_SYSCALL_BIT, "ENOSYS", None),
        ("jeq", arch["clone3"], "ENOSYS", None),
        *[("jeq", nr, "EPERM", None) for nr in (*arch["forks"], *refused)],
        *[("jeq", nr, "SOCKET_FAMILY", None) for nr in (socket_calls if unix_sockets else ())],
        *[("jeq", nr, "OWN_PID_ARG0", None) for nr in own_pid_calls],
        *[("jeq", nr, f"WHO_IS_{who}", None) for nr, who in own_who_calls],
        ("jeq", arch["clone"], None, "ALLOW"),
        ("ld", 16, None, None),                      # args[0] (clone flags), low 32 bits (little-endian)
        ("jset", CLONE_THREAD, "ALLOW", "EAGAIN"),
        # a pid in args[0] (pid_t: its low 32 bits): 0 or the caller's own
        ("label", 0, "OWN_PID_ARG0", None),
        ("ld", 16, None, None),
        ("jeq", 0, "ALLOW", None),
        ("jeq", OWN_PID_SENTINEL, "ALLOW", "EPERM"),
    ]
    for who in sorted({who for _, who in own_who_calls}):  # args[0] says a process; args[1] which
        body += [("label", 0, f"WHO_IS_{who}", None),
                 ("ld", 16, None, None),
                 ("jeq", who, None, "EPERM"),
                 ("ld", 24, None, None),             # args[1], low 32 bits
                 ("jeq", 0, "ALLOW", None),
                 ("jeq", OWN_PID_SENTINEL, "ALLOW", "EPERM")]
    if unix_sockets:
        body += [("label", 0, "SOCKET_FAMILY", None),
                 ("ld", 16, None, None),             # args[0] (the address family)
                 ("jeq", socket.AF_UNIX, "ALLOW", "EPERM")]
    labels = {name: i - sum(op == "label" for op, *_ in body[:i])
              for i, (op, _, name, _) in enumerate(body) if op == "label"}
    body = [row for row in body if row[0] != "label"]
    labels.update({"ALLOW": len(body), "ENOSYS": len(body) + 1, "EPERM": len(body) + 2, "EAGAIN": len(body) + 3})
    out = b""
    for i, (op, k, jt, jf) in enumerate(body):
        if op == "ld":
            out += _bpf_stmt(ld_w_abs, k)
            continue
        t = labels[jt] - i - 1 if jt else 0
        f = labels[jf] - i - 1 if jf else 0
        out += _bpf_jump({"jeq": jeq, "jge": jge, "jset": jset}[op], k, t, f)
    return (out + _bpf_stmt(ret, SECCOMP_RET_ALLOW) + _bpf_stmt(ret, SECCOMP_RET_ERRNO | errno.ENOSYS)
            + _bpf_stmt(ret, SECCOMP_RET_ERRNO | errno.EPERM) + _bpf_stmt(ret, SECCOMP_RET_ERRNO | errno.EAGAIN))


def install_seccomp(program: bytes) -> None:
    buf = ctypes.create_string_buffer(program, len(program))

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    prog = SockFprog(len(program) // 8, ctypes.cast(buf, ctypes.c_void_p))
    if _libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "seccomp: " + os.strerror(ctypes.get_errno()))


# -- capabilities ----------------------------------------------------------------------------


def _last_cap() -> int:
    try:
        return int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    except (OSError, ValueError):
        return 63


def drop_capabilities(last_cap: int | None = None) -> bool:
    """Empty bounding, ambient, effective, permitted and inheritable sets (a no-op for an
    unprivileged process). Returns whether the process ends with no capabilities."""
    for cap in range((_last_cap() if last_cap is None else last_cap) + 1):
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


# -- all of it -------------------------------------------------------------------------------

LAYER_KEYS = ("no_new_processes", "sockets_blocked", "filesystem_reads_confined", "filesystem_writes_confined",
              "tcp_blocked", "signals_scoped", "capabilities_dropped")


def confine(writable: Iterable[Path], readable: Iterable[Path] = (), *, gpu: bool = False) -> dict[str, Any]:
    """Apply every layer the kernel allows; returns what was applied and, under "errors", why a
    layer could not be. `writable`: the job's folders; `readable`: its inputs (beside the
    interpreter, packages and system files every job reads)."""
    info: dict[str, Any] = {key: False for key in LAYER_KEYS}
    info["landlock_abi"] = 0
    errors: list[str] = []
    if platform.system() != "Linux":
        return {**info, "errors": ["not Linux: only resource limits apply"]}
    writable, readable = list(writable), list(readable)
    last_cap = _last_cap()  # read before Landlock hides /proc/sys
    if not _no_new_privs():
        errors.append("prctl(PR_SET_NO_NEW_PRIVS) failed: " + os.strerror(ctypes.get_errno()))
    abi = landlock_abi()
    info["landlock_abi"] = abi
    if abi > 0:
        try:
            info.update(restrict_filesystem_and_network(landlock_rules(writable, readable, abi, gpu=gpu), abi))
        except OSError as exc:
            errors.append(str(exc))
    else:
        errors.append("Landlock is not available in this kernel (reads and writes are not confined)")
    try:
        if platform.machine() not in _ARCHES:
            raise OSError(errno.ENOSYS, f"no seccomp filter for {platform.machine()}")
        install_seccomp(seccomp_program(unix_sockets=gpu, own_pid=os.getpid()))
        info["no_new_processes"] = info["sockets_blocked"] = True
        # a GPU job: no network socket, but unconnected AF_UNIX sockets of its own (CUDA makes them)
        info["unix_sockets_local"] = gpu
    except OSError as exc:
        errors.append(str(exc))
    info["capabilities_dropped"] = drop_capabilities(last_cap)
    if errors:
        info["errors"] = errors
    return info


# -- what the child must not have inherited ------------------------------------------------


def inherited_state(allowed_fds: Iterable[int]) -> list[str]:
    """What this process holds that it did not open itself: file descriptors beyond
    `allowed_fds` and writable shared mappings. A forked child starts with its warm parent's
    (a semaphore a library made in /dev/shm, a database a library opened read-write): another
    job's child would share them. Returns the findings; empty means clean."""
    problems = []
    allowed = set(allowed_fds)
    listing = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for name in os.listdir(listing):
            fd = int(name)
            if fd in allowed or fd == listing:
                continue
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue  # closed meanwhile
            problems.append(f"file descriptor {fd} ({target}) inherited from the warm parent")
    finally:
        os.close(listing)
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            perms = fields[1]
            if perms[1] == "w" and perms[3] == "s":
                what = fields[5].strip() if len(fields) > 5 else "[anonymous]"
                problems.append(f"writable shared mapping {fields[0]} of {what}")
    return problems


# -- Graphviz `dot` for the job report, outside the engine's sandbox ------------------------

DOT_MEMORY_BYTES = 1 << 30
DOT_CPU_S = 30


# What `dot` reads: itself, its libraries and plugins, fontconfig's files. It writes nothing.
DOT_READ_PATHS = ("/usr", "/lib", "/lib64", "/etc/ld.so.cache", "/etc/fonts", "/var/cache/fontconfig", "/etc/localtime")


def _dot_preexec() -> Any:
    """preexec_fn of `dot`: everything is computed here, before the fork, because it runs between
    fork and exec of a process that may have other threads (the embedded server), where only
    async-signal-safe work is sound. In the child: rlimits, no_new_privs, Landlock (read-only,
    nothing writable but /dev/null), the seccomp filter (no sockets, no new processes; exec
    itself stays allowed), no capabilities."""
    abi = landlock_abi()
    rules = [(Path(p), FS_READ) for p in DOT_READ_PATHS] + [(Path("/dev/null"), FS_READ_FILE | FS_WRITE_FILE)]
    program = seccomp_program() if platform.machine() in _ARCHES else b""
    last_cap = _last_cap()

    def confine_dot() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (DOT_MEMORY_BYTES, DOT_MEMORY_BYTES))
        resource.setrlimit(resource.RLIMIT_CPU, (DOT_CPU_S, DOT_CPU_S))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        _no_new_privs()
        if abi > 0:
            restrict_filesystem_and_network(rules, abi)
        if program:
            install_seccomp(program)
        drop_capabilities(last_cap)

    return confine_dot


def confined_dot(source: bytes) -> bytes:
    """`dot -Tsvg` for a report drawn from an untrusted manifest (fxport/report.py `DotLayout`).

    The engine's sandbox may not start processes, so report.html is drawn by its trusted
    parent (workers/sandbox/run.py). The graph's labels come from the model (node names and
    targets, escaped and quoted in the DOT source), so `dot` runs confined like the sandbox:
    an empty environment (no credentials), an empty working folder, address-space and CPU
    limits, nothing writable, no sockets, no new processes, no ptrace or /proc/<pid>/environ
    of the worker."""
    import subprocess
    import tempfile

    from fxport.report import DOT_TIMEOUT_S, find_dot

    search = os.environ.get("PATH", "/usr/bin:/bin")
    dot = find_dot(search)  # before the fork: none at all without Graphviz
    with tempfile.TemporaryDirectory(prefix="fxport-dot-") as cwd:
        return subprocess.run([dot, "-Tsvg"], input=source, capture_output=True, check=True, cwd=cwd,
                              env={"PATH": search, "LC_ALL": "C.UTF-8"},
                              preexec_fn=_dot_preexec() if platform.system() == "Linux" else None,
                              timeout=DOT_TIMEOUT_S).stdout
