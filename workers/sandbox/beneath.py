"""What the sandbox wrote, read by the worker without following any link the child made.

The child owns its folders and may swap a file or a folder for a symlink at any moment, also
while the worker reads (the early upload runs beside it). So the worker never resolves a name
the child controls: it opens the folder once, then every file and folder beneath it relative
to that handle with no symlink resolution at any step (openat2 with RESOLVE_BENEATH |
RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS, or O_NOFOLLOW component by component where
openat2 is missing), checks the handle (a regular file, one link, not a FIFO), and then
hashes and uploads from that handle: `OutputFile.path` is /proc/self/fd/N, which reopens the
same inode whatever happens to the names meanwhile. Every read of a file the child made is
bounded (`read_bounded`).
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from fxport.errors import SandboxViolation

SYS_OPENAT2 = 437  # the same on every architecture
RESOLVE_NO_XDEV, RESOLVE_NO_MAGICLINKS, RESOLVE_NO_SYMLINKS, RESOLVE_BENEATH = 0x01, 0x02, 0x04, 0x08
_RESOLVE = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_openat2_works: bool | None = None


class Unsafe(SandboxViolation):
    """A name beneath the folder is a link, a FIFO, a device or a hard link, or lies outside it."""


def _openat2(dir_fd: int, rel: str, flags: int) -> int:
    how = struct.pack("=QQQ", flags, 0, _RESOLVE)
    fd = _libc.syscall(SYS_OPENAT2, dir_fd, rel.encode(), ctypes.c_char_p(how), ctypes.c_size_t(len(how)))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), rel)
    return int(fd)


def _parts(rel: str) -> list[str]:
    parts = rel.split("/")
    if rel.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise Unsafe(f"{rel!r} is not a plain relative path", stage="upload")
    return parts


def open_beneath(dir_fd: int, rel: str, flags: int = os.O_RDONLY) -> int:
    """Open `rel` (a relative path of plain names) beneath the folder `dir_fd` without
    following any symlink. Raises Unsafe for a symlink on the way, OSError otherwise."""
    global _openat2_works
    _parts(rel)
    flags |= os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK  # NONBLOCK: a FIFO must not hang the worker
    if _openat2_works is not False:
        try:
            fd = _openat2(dir_fd, rel, flags)
            _openat2_works = True
            return fd
        except OSError as exc:
            if exc.errno in (errno.ENOSYS, errno.EPERM) and _openat2_works is None:
                _openat2_works = False  # an old kernel, or a runtime's seccomp profile refusing it
            elif exc.errno in (errno.ELOOP, errno.EXDEV):
                raise Unsafe(f"{rel!r} goes through a symlink or leaves the folder", stage="upload") from None
            else:
                raise
    current = dir_fd
    parts = _parts(rel)
    try:
        for part in parts[:-1]:
            try:
                nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=current)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise Unsafe(f"{rel!r} goes through a symlink", stage="upload") from None
                raise
            if current != dir_fd:
                os.close(current)
            current = nxt
        try:
            return os.open(parts[-1], flags, dir_fd=current)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise Unsafe(f"{rel!r} is a symlink", stage="upload") from None
            raise
    finally:
        if current != dir_fd:
            os.close(current)


@dataclass
class OutputFile:
    """A regular file the child wrote, held open: hash and upload it through `path`."""

    name: str  # relative to the folder, '/'-separated
    fd: int
    size: int
    mtime_ns: int

    @property
    def path(self) -> Path:
        """/proc/self/fd/N: reopens this very inode, so APIs that take a path (boto3, hashlib
        helpers) read exactly the file that was checked, whatever the child renames."""
        return Path(f"/proc/self/fd/{self.fd}")

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _check_regular(fd: int, name: str) -> os.stat_result:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise Unsafe(f"{name!r} is not a regular file", stage="upload")
    if st.st_nlink != 1:
        raise Unsafe(f"{name!r} has {st.st_nlink} hard links", stage="upload")
    return st


def open_file(dir_fd: int, rel: str) -> OutputFile:
    """Open one regular file beneath `dir_fd` (Unsafe if it is anything else)."""
    fd = open_beneath(dir_fd, rel)
    try:
        st = _check_regular(fd, rel)
    except BaseException:
        os.close(fd)
        raise
    return OutputFile(rel, fd, st.st_size, st.st_mtime_ns)


@contextmanager
def opened_dir(path: Path) -> Iterator[int]:
    """The folder the worker itself made (the job's output or work folder), opened once."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        yield fd
    finally:
        os.close(fd)


def read_bounded(dir_fd: int, rel: str, limit: int, what: str) -> bytes:
    """The whole of a small file the child wrote (result.json, manifest.json), refused with a
    named reason when it is larger than `limit` bytes, without reading more than that."""
    out = open_file(dir_fd, rel)
    try:
        if out.size > limit:
            raise SandboxViolation(f"the sandbox wrote a {out.size >> 20} MiB {what}, over the {limit >> 20} MiB "
                                   "limit", stage="upload", hint="a model cannot make its own results this big; "
                                   "check the model")
        with os.fdopen(os.dup(out.fd), "rb") as f:
            data = f.read(limit + 1)
        if len(data) > limit:  # it grew while read
            raise SandboxViolation(f"the sandbox's {what} grew past the {limit >> 20} MiB limit", stage="upload")
        return data
    finally:
        out.close()


def tail_bounded(dir_fd: int, rel: str, limit: int) -> bytes:
    """The last `limit` bytes of a file the child wrote (its log); b"" when there is none."""
    try:
        out = open_file(dir_fd, rel)
    except (OSError, SandboxViolation):
        return b""
    try:
        with os.fdopen(os.dup(out.fd), "rb") as f:
            f.seek(max(0, out.size - limit))
            return f.read(limit)
    finally:
        out.close()


def walk_files(dir_fd: int, *, strict: bool, max_files: int, skip_hidden: bool = False,
               prefix: str = "") -> Iterator[OutputFile]:
    """Every regular file beneath `dir_fd`, opened, in name order. `strict` (the child has
    exited): a symlink, FIFO, device, socket or hard link anywhere raises Unsafe. Not strict (the
    child still runs): such names, and names that vanish while listed, are passed over.
    `skip_hidden`: names starting with '.' are not listed (the engine's staging folder).
    More than `max_files` files raises SandboxViolation. The caller closes each file."""
    count = [0]
    yield from _walk(dir_fd, prefix, strict, max_files, skip_hidden, count)


def _walk(dir_fd: int, prefix: str, strict: bool, max_files: int, skip_hidden: bool,
          count: list[int]) -> Iterator[OutputFile]:
    listing = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        names = sorted(os.listdir(listing))
    finally:
        os.close(listing)
    for name in names:
        if skip_hidden and name.startswith("."):
            continue
        rel = prefix + name
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            continue
        if stat.S_ISDIR(st.st_mode):
            try:
                sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
            except OSError as exc:
                if strict and exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise Unsafe(f"{rel!r} was swapped for a symlink", stage="upload") from None
                continue
            try:
                yield from _walk(sub, rel + "/", strict, max_files, skip_hidden, count)
            finally:
                os.close(sub)
            continue
        if not stat.S_ISREG(st.st_mode):
            if strict:
                kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a regular file"
                raise Unsafe(f"the sandbox left {rel!r}, which is {kind}", stage="upload")
            continue
        try:
            out = open_file(dir_fd, name)
        except (OSError, Unsafe):
            if strict:
                raise
            continue
        out.name = rel
        count[0] += 1
        if count[0] > max_files:
            out.close()
            raise SandboxViolation(f"the sandbox wrote more than {max_files} files", stage="upload",
                                   hint="a conversion writes a handful of artifacts; check the model")
        yield out


def replace_file(dir_fd: int, name: str, data: bytes) -> None:
    """Write `data` as `name` in the folder `dir_fd`: a new file renamed over whatever stood
    there (a symlink the child left is replaced, never written through)."""
    tmp = f".fxport-{os.getpid()}-{os.urandom(4).hex()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        raise


def remove_tree(path: Path) -> None:
    """Remove the folder `path` and everything in it, following no link the child made: a link is
    removed itself, never what it points at, and a folder the child made unwritable is made
    writable (0700) through its own descriptor, not by a name it could swap. (shutil.rmtree follows
    no link but leaves such a folder; tempfile's cleanup chmods by name, CVE-2023-6597.) Raises
    OSError or RecursionError where something could not be removed."""
    head, name = os.path.split(os.fspath(path))
    parent = os.open(head or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        _remove_beneath(parent, name)
    finally:
        os.close(parent)


def _remove_beneath(dir_fd: int, name: str) -> None:
    try:
        fd = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except NotADirectoryError:  # a file, a link (O_PATH | O_NOFOLLOW opens the link itself), a FIFO
        os.unlink(name, dir_fd=dir_fd)
        return
    except FileNotFoundError:
        return
    try:
        os.chmod(f"/proc/self/fd/{fd}", 0o700)  # the folder's own inode, whatever its name leads to now
        listing = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd)
        try:
            names = os.listdir(listing)
        finally:
            os.close(listing)
        for entry in names:
            _remove_beneath(fd, entry)
    finally:
        os.close(fd)
    try:
        os.rmdir(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
