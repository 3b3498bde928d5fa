"""Load a user's model file, detecting its format from the content, never the extension.

This is the ONE place a model file is deserialized. Loading runs code from the file
(.pt2 may fall back to unpickling, torch.package imports packaged code), so it is only
ever called inside the sandbox process (DESIGN.md §6).

The formats it reads are the FORMATS registry (end of this file): adding an input format
is one InputFormat entry there plus its loader.
"""

from __future__ import annotations

import zipfile
from collections.abc import Callable
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
            hint="check it was saved with the same torch major version and that the file is complete",
        ) from exc


def _load_pt2(path: Path) -> LoadedModel:
    import torch

    from fxport.workers.engine.warm_caches import cache_pt2_type_hints

    cache_pt2_type_hints()
    ep = torch.export.load(str(path))
    example = None
    if ep.example_inputs is not None:
        args, kwargs = ep.example_inputs
        if not kwargs:
            example = tuple(args)
    return LoadedModel(format="torch_export", module=ep.module(), exported_program=ep, example_inputs=example)


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
