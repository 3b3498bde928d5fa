"""A real custom op library for the tests of FXPORT_OP_LIBRARIES, and a model that needs it.

torchvision cannot be installed beside this torch here, so the tests build their own: a C++
shared library that registers `fxtest::twice(Tensor x) -> Tensor` (2 * x) with a CPU kernel and
a Meta one (shapes only, for torch.export), as torchvision registers `torchvision::nms`. It is
compiled with g++ against the installed torch's headers (about 7 s on the 2-core build VM) and
kept under .fxport/test-op-library/, keyed on its source, the torch version and the flags, so a
session builds it at most once. `probe` builds a variant whose start-up code tries what the
sandbox forbids and aborts the process if any of it works (tests/security/test_op_library_confined.py).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / ".fxport" / "test-op-library"

SOURCE = r"""
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#ifdef FXTEST_PROBE_SECRET
#include <cstdio>
#include <cstdlib>
#include <fcntl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>
#endif

namespace {
at::Tensor twice(const at::Tensor& x) { return x.mul(2); }
at::Tensor twice_meta(const at::Tensor& x) { return x.new_empty(x.sizes()); }

#ifdef FXTEST_PROBE_SECRET
// Runs when the library is loaded: a socket, a file outside the sandbox's reach, a new process.
// Any of them working kills the process, so a job that loads this library confined succeeds.
int probe() {
  int escaped = 0;
  int s = socket(AF_INET, SOCK_STREAM, 0);
  if (s >= 0) { escaped |= 1; close(s); }
  int fd = open(FXTEST_PROBE_SECRET, O_RDONLY);
  if (fd >= 0) { escaped |= 2; close(fd); }
  pid_t pid = fork();
  if (pid == 0) _exit(0);
  if (pid > 0) { escaped |= 4; waitpid(pid, nullptr, 0); }
  if (escaped) { fprintf(stderr, "fxtest probe escaped: %d\n", escaped); fflush(stderr); abort(); }
  return 0;
}
const int probed = probe();
#endif
}  // namespace

TORCH_LIBRARY(fxtest, m) { m.def("twice(Tensor x) -> Tensor"); }
TORCH_LIBRARY_IMPL(fxtest, CPU, m) { m.impl("twice", &twice); }
TORCH_LIBRARY_IMPL(fxtest, Meta, m) { m.impl("twice", &twice_meta); }
"""

# Saved in a subprocess: loading the library into the test process is not needed, and scripting
# a module needs its source in a file.
SAVE_MODEL = """
import sys, torch
torch.ops.load_library(sys.argv[1])

class Twice(torch.nn.Module):
    def forward(self, x):
        return torch.ops.fxtest.twice(x) + 1

if sys.argv[2].endswith(".pt2"):
    torch.export.save(torch.export.export(Twice(), (torch.randn(2, 3),)), sys.argv[2])
else:
    torch.jit.save(torch.jit.script(Twice()), sys.argv[2])
"""


def _compiler() -> str:
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler to build the test op library")
    return cxx


def build(folder: Path, *, defines: tuple[str, ...] = ()) -> Path:
    """libfxtest.so built into `folder`/<key>/ (reused when it is there), keyed on the source, the
    torch version, the compiler and `defines`."""
    import torch
    from torch.utils import cpp_extension

    cxx = _compiler()
    flags = ["-shared", "-fPIC", "-O1", "-std=c++20", "-w",
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
             *(f"-D{d}" for d in defines), *(f"-I{p}" for p in cpp_extension.include_paths())]
    libs = [*(f"-L{p}" for p in cpp_extension.library_paths()), "-lc10", "-ltorch_cpu"]
    key = hashlib.sha256("\0".join([SOURCE, torch.__version__, cxx, *flags]).encode()).hexdigest()[:16]
    lib = folder / key / "libfxtest.so"
    if lib.is_file():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    src = lib.parent / "fxtest_ops.cpp"
    src.write_text(SOURCE)
    partial = lib.with_name(f".libfxtest.{os.getpid()}.so")  # then renamed: a concurrent build never sees half
    proc = subprocess.run([cxx, *flags, str(src), "-o", str(partial), *libs], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, f"building the test op library failed:\n{proc.stderr[-3000:]}"
    os.replace(partial, lib)
    return lib


def save_model(lib: Path, path: Path) -> Path:
    """A model that calls torch.ops.fxtest.twice, saved with `lib` loaded: a TorchScript archive, or a
    torch.export program where `path` ends in .pt2."""
    script = path.with_suffix(".make.py")
    script.write_text(SAVE_MODEL)
    proc = subprocess.run([sys.executable, str(script), str(lib), str(path)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return path
