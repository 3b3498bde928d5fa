"""Load a user's model file, detecting its format from the content, never the extension.

This is the ONE place a model file is deserialized. Loading runs code from the file
(.pt2 may fall back to unpickling, torch.package imports packaged code), so it is only
ever called inside the sandbox process (docs/architecture.md, "Trust boundaries").

The formats it reads are the FORMATS registry (end of this file): adding an input format
is one InputFormat entry there plus its loader.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fxport.errors import InvalidInput, UnsupportedModelFormat


@dataclass
class LoadedModel:
    format: str  # an InputFormat name: torch_export | torch_package | torchscript | onnx
    module: Any = None  # a callable nn.Module (eager reference), None for ONNX
    exported_program: Any = None  # for torch_export (and TorchScript converted later)
    onnx_path: Path | None = None
    example_inputs: tuple[Any, ...] | None = None
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class InputFormat:
    """One model format fxport reads. Adding an input format = one entry in FORMATS plus its loader."""

    name: str  # LoadedModel.format
    accepted: str  # user-facing description, listed in rejections
    load: Callable[[Path], LoadedModel]
    # recognises a zip-based format from its archive's entry names (the tails below the top folder)
    zip_entries: Callable[[set[str]], bool] | None = None
    # content check for a non-zip format; it must not raise
    sniff: Callable[[Path], bool] | None = None


def _is_torch_export(tails: set[str]) -> bool:
    return "archive_format" in tails or any(t.startswith("models/") and t.endswith(".json") for t in tails)


def _is_torch_package(tails: set[str]) -> bool:
    return ".data/extern_modules" in tails


def _is_torchscript(tails: set[str]) -> bool:
    return "data.pkl" in tails and any(t.startswith("code/") for t in tails)


def _load_onnx(path: Path) -> LoadedModel:
    return LoadedModel(format="onnx", onnx_path=path)


def detect_format(path: Path) -> str:
    """Name the model format from the file's bytes. Raises UnsupportedModelFormat."""
    size = path.stat().st_size
    if size == 0:
        raise UnsupportedModelFormat(
            "the model file is empty (0 bytes)", stage="load", hint=f"upload one of: {ACCEPTED_TEXT}"
        )
    with path.open("rb") as fh:
        head = fh.read(4)
    if head.startswith(b"PK"):
        return _detect_zip(path)
    for fmt in FORMATS:
        if fmt.sniff is not None and fmt.sniff(path):
            return fmt.name
    raise UnsupportedModelFormat(
        f"the model file ({size} bytes, starting {head.hex()}) is not a format fxport reads",
        stage="load",
        hint=f"accepted: {ACCEPTED_TEXT}",
    )


# Decompression-bomb guards, checked on the declared sizes in the central directory before
# any entry is decompressed (zipfile and torch's reader both stop at the declared size, so
# the declared sizes bound what can be expanded). torch writes its archives uncompressed.
MAX_ZIP_ENTRIES = 100_000
MAX_ZIP_RATIO = 100  # uncompressed / compressed, for entries over 1 MiB
MAX_ZIP_UNCOMPRESSED = 64 << 30


def _check_zip_sizes(zf: zipfile.ZipFile, archive_bytes: int) -> None:
    infos = zf.infolist()
    if infos and min(i.header_offset for i in infos) != 0:
        # zipfile found an end record that is not the file's: a truncated archive whose stored
        # entry (a .pt2 holds torch.save zips) ends in one of its own. Reading on would misname it.
        raise UnsupportedModelFormat(
            "the model archive is truncated or corrupt (its zip directory does not cover the file)",
            stage="load", hint="re-save the model and upload the complete file")
    hint = ("upload the archive torch wrote (torch.export.save / PackageExporter / torch.jit.save), "
            "not a re-compressed one")
    if len(infos) > MAX_ZIP_ENTRIES:
        raise UnsupportedModelFormat(f"the model archive has {len(infos)} entries; at most {MAX_ZIP_ENTRIES} are "
                                     "accepted", stage="load", hint=hint)
    total = 0
    for info in infos:
        total += info.file_size
        if info.file_size > (1 << 20) and info.file_size > MAX_ZIP_RATIO * max(info.compress_size, 1):
            raise UnsupportedModelFormat(
                f"the model archive looks like a decompression bomb: entry {info.filename[:200]!r} claims "
                f"{info.file_size} bytes from {info.compress_size} compressed (more than {MAX_ZIP_RATIO}:1); "
                "refusing to decompress it", stage="load", hint=hint)
    if total > MAX_ZIP_UNCOMPRESSED or total > MAX_ZIP_RATIO * max(archive_bytes, 1) + (64 << 20):
        raise UnsupportedModelFormat(
            f"the model archive looks like a decompression bomb: its entries claim {total} bytes in all from a "
            f"{archive_bytes}-byte file; refusing to decompress it", stage="load", hint=hint)


def _detect_zip(path: Path) -> str:
    try:
        with zipfile.ZipFile(path) as zf:
            names = zf.namelist()
            _check_zip_sizes(zf, path.stat().st_size)
            bad = zf.testzip()
    except (zipfile.BadZipFile, EOFError, OSError) as exc:
        raise UnsupportedModelFormat(
            f"the model archive is truncated or corrupt ({exc})",
            stage="load",
            hint="re-save the model and upload the complete file; check the upload did not stop early",
        ) from None
    if bad is not None:
        raise UnsupportedModelFormat(
            f"the model archive is corrupt: entry {bad!r} fails its CRC check",
            stage="load",
            hint="re-save the model and upload the complete file",
        )
    tails = {n.split("/", 1)[1] if "/" in n else n for n in names}
    for fmt in FORMATS:
        if fmt.zip_entries is not None and fmt.zip_entries(tails):
            return fmt.name
    if "data.pkl" in tails:
        raise UnsupportedModelFormat(
            "this is a torch.save checkpoint (a state_dict or a pickled module), which carries no graph",
            stage="load",
            hint="export it with torch.export.save(torch.export.export(model, example_args), 'model.pt2'), "
            "or save it with torch.package",
        )
    raise UnsupportedModelFormat(
        "the file is a zip archive but not one fxport reads", stage="load", hint=f"accepted: {ACCEPTED_TEXT}"
    )


def _looks_like_onnx(path: Path) -> bool:
    # ONNX has no magic number: parse the protobuf and require a real graph.
    if path.stat().st_size > (2 << 30):
        return False
    try:
        import onnx

        model = onnx.load_model(str(path), load_external_data=False)
    except Exception:
        return False
    return model.ir_version > 0 and len(model.graph.node) > 0 and len(model.graph.output) > 0


def load_model(path: Path) -> LoadedModel:
    """Deserialize the model at `path` (sandbox only). Raises InvalidInput with what to do."""
    fmt = detect_format(path)
    try:
        return input_format(fmt).load(path)
    except (InvalidInput, MemoryError):
        raise
    except Exception as exc:
        raise InvalidInput(
            f"could not load the {fmt.replace('_', ' ')} archive: {type(exc).__name__}: {exc}",
            stage="load",
            hint=hint_for(exc, LOAD_HINT, when="when it is loaded", shapes=False,
                          made_by=_pt2_made_by(path) if fmt == "torch_export" else None),
        ) from exc


def _load_pt2(path: Path) -> LoadedModel:
    import torch

    from fxport.workers.engine.warm_caches import cache_pt2_type_hints

    cache_pt2_type_hints()
    with _deserializing_errors() as logged:
        try:
            ep = torch.export.load(str(path))
        except RuntimeError as exc:
            if logged:  # torch logs what went wrong, then raises a generic "error when deserializing"
                raise logged[0] from exc
            raise
    example = None
    if ep.example_inputs is not None:
        args, kwargs = ep.example_inputs
        if not kwargs:
            example = tuple(args)
    return LoadedModel(format="torch_export", module=ep.module(), exported_program=ep, example_inputs=example)


@contextmanager
def _deserializing_errors() -> Iterator[list[BaseException]]:
    """The exceptions torch.export.load logs (with exc_info) instead of raising, in order, while inside."""
    logged: list[BaseException] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.exc_info and isinstance(record.exc_info[1], BaseException):
                logged.append(record.exc_info[1])

    logger, handler = logging.getLogger("torch.export"), Keep(logging.WARNING)
    logger.addHandler(handler)
    try:
        yield logged
    finally:
        logger.removeHandler(handler)


def _load_torchscript(path: Path) -> LoadedModel:
    import torch

    module = torch.jit.load(str(path), map_location="cpu")
    module.eval()
    return LoadedModel(format="torchscript", module=module)


def _load_package(path: Path) -> LoadedModel:
    import torch
    from torch.package import PackageImporter

    importer = PackageImporter(str(path))
    pickles = []
    with zipfile.ZipFile(path) as zf:
        for name in zf.namelist():
            inner = name.split("/", 1)[1] if "/" in name else name
            if inner.endswith(".pkl") and not inner.startswith(".data/"):
                pickles.append(inner)
    if len(pickles) != 1:
        raise InvalidInput(
            f"the torch.package archive holds {len(pickles)} pickled objects ({', '.join(pickles) or 'none'}); "
            "fxport needs exactly one, the model",
            stage="load",
            hint="save the model with exporter.save_pickle('model', 'model.pkl', model)",
        )
    package, _, resource = pickles[0].rpartition("/")
    obj = importer.load_pickle(package.replace("/", "."), resource, map_location="cpu")
    if not isinstance(obj, torch.nn.Module):
        raise InvalidInput(
            f"the torch.package pickle {pickles[0]!r} holds a {type(obj).__name__}, not a torch.nn.Module",
            stage="load",
            hint="pickle the model itself, not its state_dict",
        )
    obj.eval()
    return LoadedModel(format="torch_package", module=obj)


# In detection order: the first entry whose check matches names the file.
FORMATS: tuple[InputFormat, ...] = (
    InputFormat("torch_export", "a torch.export archive (.pt2, from torch.export.save)", _load_pt2,
                zip_entries=_is_torch_export),
    InputFormat("torch_package",
                "a torch.package archive (torch.package.PackageExporter with one pickled nn.Module)", _load_package,
                zip_entries=_is_torch_package),
    InputFormat("torchscript", "a TorchScript archive (torch.jit.save)", _load_torchscript,
                zip_entries=_is_torchscript),
    InputFormat("onnx", "an ONNX model (only for the onnx and tensorrt targets)", _load_onnx,
                sniff=_looks_like_onnx),
)
FORMAT_NAMES = tuple(f.name for f in FORMATS)
ACCEPTED = tuple(f.accepted for f in FORMATS)
ACCEPTED_TEXT = "; ".join(ACCEPTED)


def input_format(name: str) -> InputFormat:
    """The registry entry named `name`. Raises KeyError."""
    for fmt in FORMATS:
        if fmt.name == name:
            return fmt
    raise KeyError(name)


# ---------------------------------------------------------------------------------------
# Hints: what to do, chosen from what actually went wrong
# ---------------------------------------------------------------------------------------

LOAD_HINT = ("the archive's own code or data raised this as it was read: check that the file is complete and that "
             "it loads on your machine with the call that reads it (torch.export.load, "
             "torch.package.PackageImporter(...).load_pickle, torch.jit.load)")
SHAPES_HINT = "check spec.inputs shapes and dtypes against what the model's forward() expects"
SANDBOX_HINT = ("the sandbox forbids new processes and sockets: remove torch.compile / subprocess / multiprocessing "
                "/ network calls from the model's code (torch.compile's inductor starts a compiler process), or use "
                "--no-sandbox for a model you trust")
# torch.package: "Object '<torch_package_0>.helpers.KEY' was mocked out during packaging but it is being used in ..."
_MOCKED = re.compile(r"Object '(?:<torch_package_\d+>\.)?([\w.]+)' was mocked out during packaging")
_SHAPE = re.compile(r"size mismatch|shape|must match the size|Expected .* got|expected .* but got|mat1 and mat2|"
                    r"dimension|Dimension out of range|expected scalar type|dtype", re.IGNORECASE)
_VERSION = re.compile(r"version .*does not match|schema version|maximum supported version|newer version|"
                      r"this version of PyTorch|file format version|Saved archive version", re.IGNORECASE)
# A custom op no loaded library registers. torch.jit.load: "Unknown builtin op: torchvision::nms.";
# a graph calling torch.ops.NS.NAME: "'_OpNamespace' 'torchvision' object has no attribute 'nms'";
# torch.export.load: "We failed to resolve torch.ops.torchvision.roi_align.default to an operator"
_UNKNOWN_OP = re.compile(r"Unknown builtin op: ([\w:.]+?)\.?(?:\s|$)"
                         r"|'_OpNamespace' '(\w+)' object has no attribute '(\w+)'"
                         r"|failed to resolve torch\.ops\.(\w+)\.(\w+)")
_PROCESS_MODULES = ("subprocess.py", "socket.py", "popen_fork.py", "popen_spawn_posix.py", "popen_forkserver.py")
_PROCESS_CALLS = re.compile(r"\b(fork|vfork|spawn|Popen|subprocess|system|exec[lv]p?e?|socket|connect)\b")


def hint_for(exc: BaseException, default: str | None, *, when: str = "when it runs",
             shapes: bool = True, made_by: str | None = None) -> str | None:
    """The hint for an error the model's own code (or torch reading its archive) raised: from the
    error's class and words, and those of what it was raised from (torch.compile wraps what its
    backend raised).

    A mocked or missing module: intern or extern it. A process or socket the sandbox refused: what
    the sandbox forbids. The archive made by another torch: save it again with this one. A shape
    or dtype error (`shapes`): check spec.inputs. Anything else: `default`. `when` says where the
    model uses a mocked module ("when it is loaded"); `made_by`, the other torch the archive says
    made it (`_pt2_made_by`: torch.export.load words a schema mismatch as a bare RuntimeError)."""
    chain = list(_causes(exc, context=False))
    for err in chain:
        op_hint = unknown_op_hint(str(err))
        if op_hint is not None:
            return op_hint
    for err in chain:
        mocked = _MOCKED.search(str(err))
        if isinstance(err, NotImplementedError) and mocked:
            return _mocked_hint(mocked.group(1), when)
    for err in chain:
        if isinstance(err, ImportError) and err.name:
            module = _demangled(err.name)
            return (f"the model imports module {module} {when}, which the package does not hold and this worker "
                    f"cannot import: save it with exporter.intern({module!r}) (its code goes in the package) or "
                    f"exporter.extern({module!r}) with {module} installed where the model runs")
    if any(_refused_by_sandbox(err) for err in _causes(exc, context=True)):
        return SANDBOX_HINT
    if made_by or any(_VERSION.search(str(err)) for err in chain):
        import torch

        ours = torch.__version__.split("+")[0]
        return (f"the archive was made by {made_by or 'another torch version'}, which this worker's torch {ours} "
                f"cannot read: save it again with torch {ours}, or convert it where the torch it was made with is "
                "installed")
    if shapes and any(isinstance(err, RuntimeError | ValueError | IndexError | TypeError) and _SHAPE.search(str(err))
                      for err in chain):
        return SHAPES_HINT
    return default


def unknown_op_hint(text: str) -> str | None:
    """Where `text` says the model calls a custom op that no loaded library registers: which op, the
    libraries this process loaded, and that FXPORT_OP_LIBRARIES is where its library goes. Else None."""
    found = _UNKNOWN_OP.search(text)
    if found is None:
        return None
    from fxport.toolchain import loaded_op_libraries

    op = found.group(1) or "::".join(g for g in found.groups()[1:] if g)
    return (f"the model calls the custom op {op}, which no loaded op library registers (FXPORT_OP_LIBRARIES: "
            f"{', '.join(loaded_op_libraries()) or 'none set'}): the worker's operator adds the library that defines "
            "it to FXPORT_OP_LIBRARIES (a module such as torchvision, or an absolute path to a shared library); "
            "`fxport convert` reads the same variable")


def _causes(exc: BaseException, *, context: bool) -> Iterator[BaseException]:
    """`exc`, then what it was raised from (`raise ... from`, torch._dynamo's inner_exception) and, with
    `context`, what it was raised while handling; at most 16, no cycles."""
    seen: set[int] = set()
    err: BaseException | None = exc
    while err is not None and id(err) not in seen and len(seen) < 16:
        seen.add(id(err))
        yield err
        inner = getattr(err, "inner_exception", None)  # BackendCompilerFailed: what the backend raised
        err = (err.__cause__ or (inner if isinstance(inner, BaseException) else None)
               or (err.__context__ if context else None))


_PT2_SCHEMA = re.compile(rb'"schema_version":\s*\{\s*"major":\s*(\d+),\s*"minor":\s*(\d+)\s*\}')
_PT2_TORCH = re.compile(rb'"torch_version":\s*"([^"]{1,64})"')
MAX_PT2_PROGRAM_BYTES = 256 << 20  # a program's JSON read for its version; past this, no version hint


def _pt2_made_by(path: Path) -> str | None:
    """"torch X (export schema M.N)" when the .pt2's program says it was written in an export schema
    this torch cannot read (another major version); None when it is this torch's or cannot tell."""
    try:
        from torch._export.serde.schema import SCHEMA_VERSION

        with zipfile.ZipFile(path) as zf:
            programs = [i for i in zf.infolist() if "/models/" in f"/{i.filename}" and i.filename.endswith(".json")]
            if not programs or programs[0].file_size > MAX_PT2_PROGRAM_BYTES:
                return None
            data = zf.read(programs[0])
    except Exception:  # a hint never fails the error it explains
        return None
    schema, made_with = _PT2_SCHEMA.search(data), _PT2_TORCH.search(data)
    if schema is None or int(schema.group(1)) == SCHEMA_VERSION[0]:
        return None
    version = f"{schema.group(1).decode()}.{schema.group(2).decode()}"
    if made_with is None:
        return f"a torch that writes export schema {version}"
    return f"torch {made_with.group(1).decode(errors='replace')} (export schema {version})"


def _demangled(name: str) -> str:
    return re.sub(r"^<torch_package_\d+>\.", "", name)


def _mocked_hint(obj: str, when: str) -> str:
    module = obj.rsplit(".", 1)[0] if "." in obj else obj
    return (f"the package mocks module {module}, which the model uses {when} ({obj}): save it with "
            f"exporter.intern({module!r}) (its code goes in the package) or exporter.extern({module!r}) (imported "
            "where the model runs) instead of exporter.mock")


def _refused_by_sandbox(err: BaseException) -> bool:
    """A process or socket the sandbox's seccomp layer refused: EPERM (fork, vfork, socket) or EAGAIN
    (clone), raised where the model starts a process or opens a socket. Only inside the sandbox:
    elsewhere the same errno means something else."""
    if os.environ.get("FXPORT_SANDBOX") != "1":
        return False
    if not isinstance(err, OSError) or err.errno not in (errno.EPERM, errno.EAGAIN):
        return False
    import traceback

    for frame in traceback.extract_tb(err.__traceback__):
        name = os.path.basename(frame.filename)
        if name in _PROCESS_MODULES or _PROCESS_CALLS.search(frame.line or "") or "_inductor" in frame.filename:
            return True
    return False
