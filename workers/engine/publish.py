"""Writing and publishing artifacts: each exporter writes into a staging folder, the finished files
are renamed into the output folder (so a file under its artifact name is always whole), and the
manifest records every file of every artifact with its size and sha256.

And withdrawing them: a job that fails keeps no model file (README, "What a conversion does"), so
the artifacts a failed job wrote, verified or not, leave the output folder again (`withdraw`);
manifest.json and report.html stay and say what was built and why the job failed.

Torch is imported only where an artifact is written or hashed: `fxport convert` withdraws a
failed job's files from --out without loading it.
"""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from fxport.digest import sha256_file
from fxport.errors import ConversionFailed, FxportError
from fxport.manifest import ArtifactRecord, Manifest
from fxport.spec import JobSpec
from fxport.workers.engine.exporters.registry import REGISTRY, ExportJob, Writer
from fxport.workers.engine.load import hint_for

WRITING_DIR = ".writing"  # where an exporter writes; never an artifact name (those never start with '.')


def export_one(target: str, writer: Writer, job: ExportJob, out_dir: Path
               ) -> tuple[Path, str, dict[str, Any] | None]:
    """Write one artifact with its registry writer. Returns its path, a note for the manifest ('' when
    none) and, for ONNX, its interface (names, dtypes and shapes of inputs and outputs).

    The exporter writes into out_dir/WRITING_DIR; the finished files are then renamed into
    out_dir. So a file under its artifact name is always whole: the worker uploads files
    while the engine still exports (workers/artifact_upload.py) and never catches one half-written."""
    from fxport.workers.engine.exporters.interface import finish_onnx
    from fxport.workers.engine.exporters.onnx import as_one_file, refuse_past_one_protobuf, weight_bytes

    one_file = REGISTRY[target].onnx and job.spec.onnx.single_file
    if one_file:  # weights past one protobuf: refused before minutes of export and gigabytes of disk
        refuse_past_one_protobuf(weight_bytes(job.graph if job.graph is not None else job.module))
    staging = out_dir / WRITING_DIR
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        written, note = _write_artifact(target, writer, job, staging / REGISTRY[target].path)
        interface = None
        if REGISTRY[target].onnx:  # names and provenance, before anyone can upload it
            interface = finish_onnx(written, input_shapes=[(i.name, i.shape) for i in job.sig.inputs],
                                    output_names=job.spec.outputs, provenance=job.provenance)
            if one_file:  # last: the steps above read and rewrite the model without its weights
                as_one_file(written)
        return _publish(staging, written, out_dir), note, interface
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def provenance(manifest: Manifest, spec: JobSpec) -> dict[str, str]:
    """Where an artifact came from, written into it (ONNX metadata_props, archives' extra files).

    Only what the artifact is a function of: the same model, spec and toolchain give the same
    bytes in every job (the result cache hands them to later jobs; a redelivered job must
    reproduce them). The job that made them is in its manifest, beside each artifact's sha256."""
    return {"version": str(manifest.fxport_version), "source_sha256": str(manifest.input.sha256),
            "spec_digest": spec.artifact_digest()}


def _publish(staging: Path, written: Path, out_dir: Path) -> Path:
    """Rename everything the exporter wrote from staging into out_dir, the artifact itself last
    (after e.g. the model.onnx.data it refers to). Returns the artifact's path in out_dir."""
    for entry in sorted(staging.iterdir(), key=lambda p: p == written):
        dest = out_dir / entry.name
        if dest.is_dir() and not dest.is_symlink():
            shutil.rmtree(dest)
        entry.replace(dest)
    return out_dir / written.relative_to(staging)


def _write_artifact(target: str, writer: Writer, job: ExportJob, path: Path) -> tuple[Path, str]:
    """`writer(job, path)`, with an exporter's own failure turned into a ConversionFailed naming the target."""
    try:
        return writer(job, path)
    except FxportError:
        raise
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ConversionFailed(
            f"{target} export failed: {type(exc).__name__}: {first}", stage="export",
            # a sandbox refusal or a mocked module the export ran into: its own hint; else the way round it
            hint=hint_for(exc, f"drop {target!r} from targets to get the other artifacts", shapes=False),
        ) from exc


def records_of(artifacts: Sequence[tuple[str, Path, str | None]], out_dir: Path) -> list[ArtifactRecord]:
    """The manifest's records of every file of `artifacts` ((target, path, int8 scheme or None)).
    The files are hashed side by side, up to the job's thread budget: hashlib lets go of the GIL,
    and nothing else of the job runs meanwhile. Where no thread can start, one after another."""
    files: list[tuple[str, Path, str | None]] = []
    for target, path, scheme in artifacts:
        if target in REGISTRY:
            found = REGISTRY[target].files(path)
        else:  # a file of the package stage (samples.npz, the Triton repository)
            found = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        files.extend((target, f, scheme) for f in found)
    import torch

    digests = None
    workers = min(len(files), torch.get_num_threads())
    if workers > 1:
        try:
            with ThreadPoolExecutor(max_workers=workers) as pool:
                digests = list(pool.map(lambda item: sha256_file(item[1]), files))
        except RuntimeError:  # no thread could start (near the sandbox's address-space limit)
            pass
    if digests is None:
        digests = [sha256_file(f) for _, f, _ in files]
    return [
        ArtifactRecord(format=target, path=str(f.relative_to(out_dir)), bytes=size, sha256=digest,
                       **({"int8_scheme": scheme} if scheme else {}))  # left out, not null, when there is none
        for (target, f, scheme), (digest, size) in zip(files, digests)
    ]


# What the package stage writes beside the artifacts (package.py: the sample requests, the Triton repository).
PACKAGE_NAMES = ("samples.npz", "triton")


def output_names(targets: Iterable[str] | None = None) -> list[str]:
    """The names the artifacts of `targets` take in the output folder (an ONNX model's weights file
    too); by default every target's and the package stage's: every name a conversion writes but
    manifest.json and report.html."""
    names: list[str] = [] if targets is not None else list(PACKAGE_NAMES)
    for name in REGISTRY if targets is None else targets:
        target = REGISTRY.get(name)
        if target is not None:
            names += [target.path, f"{target.path}.data"] if target.onnx else [target.path]
    return names


def withdraw(out_dir: Path, names: Iterable[str]) -> list[str]:
    """Remove each of `names` (a file, or a folder with everything in it) from `out_dir`, never
    following a link: a link is removed itself, and a folder is removed through descriptors
    opened beneath out_dir (shutil.rmtree's fd-based walk). Returns the names that were there.
    A name that cannot be removed is left (the caller's error is the one to report)."""
    removed: list[str] = []
    try:
        fd = os.open(out_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return removed
    try:
        for name in dict.fromkeys(names):
            if not name or "/" in name or name in (".", ".."):
                continue
            try:
                if stat.S_ISDIR(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                    shutil.rmtree(name, dir_fd=fd)
                else:
                    os.unlink(name, dir_fd=fd)
            except OSError:  # not there (FileNotFoundError), or not removable
                continue
            removed.append(name)
    finally:
        os.close(fd)
    return removed
