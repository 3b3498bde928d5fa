"""A Triton Inference Server model repository from a job's verified artifacts.

One model directory per servable artifact whose verification passed:

    REPO/NAME_onnx/config.pbtxt         platform onnxruntime_onnx, KIND_CPU
    REPO/NAME_onnx/1/model.onnx
    REPO/NAME_onnx/samples.npz          inputs and the original model's outputs (when the job kept them)
    REPO/NAME_torchscript/...           platform pytorch_libtorch, 1/model.pt, tensors named <name>__<i>
    REPO/NAME_tensorrt/...              platform tensorrt_plan, 1/model.plan, KIND_GPU (when the job built one)
    REPO/README.md                      the model card (fxport/serving/model_card.py)

Every value of a config comes from a recorded fact: names, data types and dims from the
manifest's signature (every artifact serves the model's float32 interface, fp16 and int8 ones
too), `max_batch_size` from the batch axis's range (the axis itself left out of `dims`, as
Triton wants), preferred batch sizes from the benchmark where it ran, warm-up requests at the
spec's opt shape. What cannot be decided is said in the config's comments and the model card
rather than guessed: without a batch axis that every input and output carries, the model is
served unbatched (`max_batch_size: 0`, full dims).

Each config is parsed into Triton's own `inference.ModelConfig` message (its model_config.proto,
fxport/serving/triton_model_config.py) and checked for what Triton refuses at load (the rules
are in `check_config`) before anything is written: a problem is a PackageError naming the model
and the field.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fxport.errors import InvalidInput
from fxport.manifest import Manifest, Signature, TensorSignature
from fxport.serving.signature import model_signature

SAMPLES = "samples.npz"  # the job's sample inputs and expected outputs (keys inputs/<name>, outputs/<name>)
MODEL_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
TRITON_TYPES = {
    "float32": "TYPE_FP32", "float16": "TYPE_FP16", "bfloat16": "TYPE_BF16", "float64": "TYPE_FP64",
    "int64": "TYPE_INT64", "int32": "TYPE_INT32", "int16": "TYPE_INT16", "int8": "TYPE_INT8",
    "uint8": "TYPE_UINT8", "bool": "TYPE_BOOL",
}


class PackageError(InvalidInput):
    """A repository that cannot be written as asked, or a config Triton would refuse."""

    code = "invalid_package"


@dataclass(frozen=True)
class Backend:
    platform: str
    file: str  # its name in the version folder
    kind: str  # instance group kind
    triton_names: bool = False  # pytorch_libtorch: tensors are named <name>__<index>


BACKENDS = {
    "onnx": Backend("onnxruntime_onnx", "model.onnx", "KIND_CPU"),
    "torchscript": Backend("pytorch_libtorch", "model.pt", "KIND_CPU", triton_names=True),
    "tensorrt": Backend("tensorrt_plan", "model.plan", "KIND_GPU"),
}


@dataclass
class TritonModel:
    name: str
    artifact: str  # the artifact's format
    source: str  # its path in the job folder
    sha256: str
    config: str  # config.pbtxt
    max_batch_size: int
    kind: str
    inputs: list[str]  # tensor names as this model serves them
    outputs: list[str]
    recommended: bool = False
    samples: bool = False


@dataclass
class TritonPackage:
    name: str
    models: list[TritonModel] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # artifact format -> why it is not served
    notes: list[str] = field(default_factory=list)  # what could not be decided
    validated_with: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "validated_with": self.validated_with, "notes": self.notes,
                "skipped": self.skipped,
                "models": [{"name": m.name, "artifact": m.artifact, "platform": BACKENDS[m.artifact].platform,
                            "max_batch_size": m.max_batch_size, "kind": m.kind, "recommended": m.recommended,
                            "samples": m.samples, "inputs": m.inputs, "outputs": m.outputs} for m in self.models]}


def read_job(job_dir: Path) -> Manifest:
    """The manifest of a job folder (a convert's --out, a downloaded job), or a PackageError saying what is wrong."""
    path = job_dir / "manifest.json"
    if not path.is_file():
        raise PackageError(f"{job_dir} has no manifest.json: give the folder `fxport convert --out` or "
                           "`fxport jobs download` wrote", field="job_dir")
    try:
        return Manifest.read(path)
    except ValueError as exc:
        raise PackageError(f"{path} is not a readable manifest: {str(exc)[:300]}", field="job_dir") from None


def plan_repository(job_dir: Path, manifest: Manifest, name: str) -> TritonPackage:
    """The repository for `manifest`'s artifacts in `job_dir`, configs checked, nothing written."""
    if not MODEL_NAME_RE.match(name):
        raise PackageError(f"--name {name[:80]!r}: use 1-63 letters, digits, _ . - (starting with a letter or digit)",
                           field="name")
    if manifest.status == "failed":
        raise PackageError("the job failed: only a succeeded job's verified artifacts are packaged",
                           field="job_dir", hint="fix what manifest.json's `error` names and convert again")
    sig = manifest.signature or model_signature(manifest.inputs, manifest.outputs)
    if sig is None:
        raise PackageError("the manifest records no input signature, so no config can name the model's inputs",
                           field="job_dir", hint="convert again with this fxport version")
    package = TritonPackage(name=name)
    package.notes.extend(_batch_notes(sig))
    verdicts = {v.format: v.verdict or ("passed" if v.passed else "failed") for v in manifest.verification}
    pick = manifest.benchmark.recommendation if manifest.benchmark else None
    recommended = pick.artifact if pick else None
    samples = (job_dir / SAMPLES).is_file()
    for art in manifest.artifacts:
        backend = BACKENDS.get(art.format)
        if backend is None or art.format in {m.artifact for m in package.models}:
            continue
        verdict = verdicts.get(art.format)
        if verdict != "passed":
            package.skipped[art.format] = (f"its verification is {verdict}" if verdict else "it was not verified")
            continue
        model = _model(f"{name}_{art.format}", art.format, backend, sig, manifest)
        model.source, model.sha256 = art.path, art.sha256
        model.recommended = recommended == art.format
        model.samples = samples
        package.models.append(model)
    targets = manifest.spec.get("targets") or []
    if "tensorrt" in targets and not any(a.format == "tensorrt" for a in manifest.artifacts):
        package.notes.append("the TensorRT engine is not in this folder yet (a worker builds it on the GPU queue "
                             "after the CPU artifacts): package the downloaded job again once it is there")
    if not package.models:
        why = "; ".join(f"{fmt}: {reason}" for fmt, reason in package.skipped.items()) or "none of its artifacts is"
        raise PackageError(f"nothing to serve: Triton serves onnx, torchscript and tensorrt artifacts whose "
                           f"verification passed ({why})", field="job_dir",
                           hint="convert with --target onnx or --target torchscript")
    if not samples:
        package.notes.append(f"no {SAMPLES} in the job folder (the job was run without `package: [triton]`): "
                             "the repository has no sample requests; the warm-up requests are Triton's own data")
    package.validated_with = validate_all(package)
    return package


def write_triton_repository(job_dir: Path, name: str, out: Path, *, manifest: Manifest | None = None,
                            card: bool = True) -> TritonPackage:
    """Write the repository for the job in `job_dir` into `out` (which must not exist, or be empty).
    Every artifact is checked against the sha256 its manifest recorded before it is copied."""
    manifest = manifest if manifest is not None else read_job(job_dir)
    package = plan_repository(job_dir, manifest, name)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise PackageError(f"{out} exists and is not an empty folder: choose a new --out", field="out")
    sources = {m.name: _checked_source(job_dir, m) for m in package.models}
    out.mkdir(parents=True, exist_ok=True)
    for model in package.models:
        folder = out / model.name
        (folder / "1").mkdir(parents=True)
        (folder / "config.pbtxt").write_text(model.config)
        shutil.copyfile(sources[model.name], folder / "1" / BACKENDS[model.artifact].file)
        if model.samples:
            _write_samples(job_dir / SAMPLES, folder / SAMPLES, model, manifest.signature
                           or model_signature(manifest.inputs, manifest.outputs))
    if card:
        from fxport.serving.model_card import model_card

        (out / "README.md").write_text(model_card(manifest, package))
    return package


# -- configs ------------------------------------------------------------------------------


def _batch_notes(sig: Signature) -> list[str]:
    batch = sig.batch
    if batch.dim is None:
        return [f"{batch.note}: served unbatched (max_batch_size 0, full dims)"]
    if (batch.min or 1) > 1:
        return [f"the batch dim {batch.dim!r} starts at {batch.min}, but Triton sends any batch from 1 up: served "
                "unbatched (max_batch_size 0, full dims)"]
    return []


def _model(model_name: str, fmt: str, backend: Backend, sig: Signature, manifest: Manifest) -> TritonModel:
    batch = sig.batch
    batched = batch.dim is not None and (batch.min or 1) <= 1 and bool(batch.max)
    max_batch = int(batch.max or 0) if batched else 0
    ins = [_triton_name(t, i, backend) for i, t in enumerate(sig.inputs)]
    outs = [_triton_name(t, i, backend) for i, t in enumerate(sig.outputs)]
    if not outs:
        raise PackageError("the manifest records none of the model's outputs, so no config can name them",
                           field="job_dir", hint="convert again with this fxport version")
    lines = ["# Written by fxport: every value below comes from the job's manifest.json.",
             f'name: "{model_name}"', f'platform: "{backend.platform}"']
    if batched:
        lines.insert(1, f"# max_batch_size: the batch dim {batch.dim!r} ranges {batch.min}..{batch.max} "
                        "(dim 0 of every input and output); dims below leave it out.")
    else:
        lines.insert(1, f"# max_batch_size 0: {batch.note or 'no batch axis'}.")
    lines.append(f"max_batch_size: {max_batch}")
    lines += _tensors("input", sig.inputs, ins, batched)
    lines += _tensors("output", sig.outputs, outs, batched)
    if batched:
        preferred = _preferred_batches(manifest, fmt, max_batch)
        if preferred:
            lines.append(f"# preferred_batch_size: the batch with the most throughput in the job's benchmark "
                         f"({fmt})")
            lines.append(f"dynamic_batching {{ preferred_batch_size: [ {', '.join(map(str, preferred))} ] }}")
        else:
            lines.append("dynamic_batching { }")
    lines.append(f"instance_group [ {{ count: 1 kind: {backend.kind} }} ]")
    lines += _warmup(sig, ins, batched, max_batch)
    return TritonModel(name=model_name, artifact=fmt, source="", sha256="", config="\n".join(lines) + "\n",
                       max_batch_size=max_batch, kind=backend.kind, inputs=ins, outputs=outs)


def _triton_name(t: TensorSignature, index: int, backend: Backend) -> str:
    return f"{t.name}__{index}" if backend.triton_names else t.name


def _dims(t: TensorSignature, batched: bool) -> list[int]:
    shape = list(t.shape or [])
    if batched:
        shape = shape[1:]
    return [d if isinstance(d, int) else -1 for d in shape]


def _data_type(t: TensorSignature, what: str) -> str:
    found = TRITON_TYPES.get(t.dtype or "")
    if found is None:
        raise PackageError(f"{what} {t.name!r} has dtype {t.dtype!r}, which Triton has no type for", field="job_dir")
    return found


def _tensors(kind: str, tensors: list[TensorSignature], names: list[str], batched: bool) -> list[str]:
    lines = [f"{kind} ["]
    for k, (t, name) in enumerate(zip(tensors, names)):
        if t.shape is None:
            raise PackageError(f"{kind} {t.name!r} has no recorded shape", field="job_dir")
        comma = "," if k < len(tensors) - 1 else ""
        shape = ", ".join(map(str, t.shape))
        lines += [f"  {{  # {t.name}: [{shape}]", f'    name: "{name}"',
                  f"    data_type: {_data_type(t, kind)}",
                  f"    dims: [ {', '.join(map(str, _dims(t, batched)))} ]", f"  }}{comma}"]
    return [*lines, "]"]


def _preferred_batches(manifest: Manifest, fmt: str, max_batch: int) -> list[int]:
    rows = [r for r in (manifest.benchmark.as_dict()["results"] if manifest.benchmark else [])
            if r.get("artifact") == fmt and r.get("verified") and r.get("throughput_per_s")
            and 1 <= int(r.get("batch", 0)) <= max_batch]
    if not rows:
        return []
    return [int(max(rows, key=lambda r: r["throughput_per_s"])["batch"])]


def _warmup(sig: Signature, names: list[str], batched: bool, max_batch: int) -> list[str]:
    """One warm-up request at the spec's opt shape: random data for float inputs, zeros for the
    others (an integer input is often an index, which random data would push out of range)."""
    opt = {name: rng.get("opt", rng.get("min", 1)) for name, rng in sig.dynamic_dims.items()}
    batch = int(opt.get(sig.batch.dim or "", 1)) if batched else 1
    lines = ["model_warmup [", "  {", '    name: "fxport-opt-shape"', f"    batch_size: {min(batch, max_batch or 1)}"]
    for t, name in zip(sig.inputs, names):
        shape = list(t.shape or [])[1 if batched else 0:]
        dims = ", ".join(str(opt.get(d, 1) if isinstance(d, str) else d) for d in shape)
        data = "random_data: true" if (t.dtype or "").startswith(("float", "bfloat")) else "zero_data: true"
        lines.append(f'    inputs {{ key: "{name}" value: {{ data_type: {_data_type(t, "input")} '
                     f"dims: [ {dims} ] {data} }} }}")
    return [*lines, "  }", "]"]


# -- validation ---------------------------------------------------------------------------


def model_config_class() -> Any:
    """Triton's `inference.ModelConfig`, from its own model_config.proto, in a pool of its own."""
    from google.protobuf import descriptor_pb2, descriptor_pool

    from fxport.serving.triton_model_config import FILE_DESCRIPTOR

    pool = descriptor_pool.DescriptorPool()
    pool.Add(descriptor_pb2.FileDescriptorProto.FromString(FILE_DESCRIPTOR))
    descriptor = pool.FindMessageTypeByName("inference.ModelConfig")
    try:
        from google.protobuf.message_factory import GetMessageClass

        return GetMessageClass(descriptor)
    except ImportError:  # protobuf < 4.22
        from google.protobuf import message_factory

        return message_factory.MessageFactory(pool).GetPrototype(descriptor)


def validate_all(package: TritonPackage) -> str:
    """Parse and check every model's config; returns what they were checked against."""
    from fxport.serving.triton_model_config import SOURCE

    cls = model_config_class()
    for model in package.models:
        check_config(parse_config(model.config, cls, model.name), model.name)
    return f"Triton's ModelConfig ({SOURCE})"


def parse_config(text: str, cls: Any, where: str) -> Any:
    from google.protobuf import text_format

    config = cls()
    try:
        text_format.Parse(text, config)
    except text_format.ParseError as exc:
        raise PackageError(f"{where}/config.pbtxt: Triton's ModelConfig does not parse it: {exc}",
                           field="config.pbtxt") from None
    return config


def check_config(cfg: Any, where: str) -> None:
    """What Triton refuses at model load, of the fields fxport writes (its model_config_utils)."""
    def refuse(path: str, problem: str) -> None:
        raise PackageError(f"{where}/config.pbtxt: {path}: {problem}", field=path)

    if cfg.name != where:
        refuse("name", f"{cfg.name!r} is not the model's folder name {where!r}")
    if cfg.platform not in {b.platform for b in BACKENDS.values()}:
        refuse("platform", f"{cfg.platform!r} is not a platform fxport packages for")
    if cfg.max_batch_size < 0:
        refuse("max_batch_size", "must not be negative")
    type_invalid = type(cfg).DESCRIPTOR.fields_by_name["input"].message_type.fields_by_name["data_type"] \
        .enum_type.values_by_name["TYPE_INVALID"].number
    libtorch = cfg.platform == "pytorch_libtorch"
    for kind in ("input", "output"):
        tensors = getattr(cfg, kind)
        if not tensors:
            refuse(kind, "a model needs at least one")
        seen: set[str] = set()
        for i, t in enumerate(tensors):
            path = f"{kind}[{i}]"
            if not t.name:
                refuse(f"{path}.name", "is empty")
            if t.name in seen:
                refuse(f"{path}.name", f"{t.name!r} appears twice")
            seen.add(t.name)
            if libtorch and not re.match(r"^.+__\d+$", t.name):
                refuse(f"{path}.name", f"{t.name!r}: the PyTorch backend binds tensors named <name>__<index>")
            if t.data_type == type_invalid:
                refuse(f"{path}.data_type", "is TYPE_INVALID")
            if not t.dims and cfg.max_batch_size == 0:
                refuse(f"{path}.dims", "an unbatched model's tensors need at least one dim")
            for j, d in enumerate(t.dims):
                if d == 0 or d < -1:
                    refuse(f"{path}.dims[{j}]", f"{d}: a dim is positive, or -1 for a variable size")
    if cfg.HasField("dynamic_batching"):
        if cfg.max_batch_size == 0:
            refuse("dynamic_batching", "needs max_batch_size > 0")
        for k, size in enumerate(cfg.dynamic_batching.preferred_batch_size):
            if not 1 <= size <= cfg.max_batch_size:
                refuse(f"dynamic_batching.preferred_batch_size[{k}]", f"{size} is not in 1..{cfg.max_batch_size}")
    for k, group in enumerate(cfg.instance_group):
        if group.count < 1:
            refuse(f"instance_group[{k}].count", "must be at least 1")
    inputs = {t.name: t for t in cfg.input}
    for k, warm in enumerate(cfg.model_warmup):
        path = f"model_warmup[{k}]"
        if not 1 <= warm.batch_size <= max(1, cfg.max_batch_size):
            refuse(f"{path}.batch_size", f"{warm.batch_size} is not in 1..{max(1, cfg.max_batch_size)}")
        if set(warm.inputs) != set(inputs):
            refuse(f"{path}.inputs", f"names {sorted(warm.inputs)}, the model's inputs are {sorted(inputs)}")
        for key, value in warm.inputs.items():
            if value.data_type != inputs[key].data_type:
                refuse(f"{path}.inputs[{key}].data_type", "differs from the input's")
            if len(value.dims) != len(inputs[key].dims) or any(d < 1 for d in value.dims):
                refuse(f"{path}.inputs[{key}].dims", "a warm-up shape is the input's dims, each a fixed size")


# -- files --------------------------------------------------------------------------------


def _checked_source(job_dir: Path, model: TritonModel) -> Path:
    path = (job_dir / model.source).resolve()
    if not path.is_relative_to(job_dir.resolve()) or not path.is_file():
        raise PackageError(f"{model.source} is not in {job_dir}: give the folder the job's artifacts were "
                           "downloaded to", field="job_dir")
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    if model.sha256 and digest.hexdigest() != model.sha256:
        raise PackageError(f"{model.source} does not match the sha256 its manifest recorded: it changed since the "
                           "job wrote it", field="job_dir", hint="download the job again")
    return path


def _write_samples(source: Path, dest: Path, model: TritonModel, sig: Signature | None) -> None:
    """The job's samples, each array renamed to the tensor name this model serves it under."""
    assert sig is not None
    names = {f"inputs/{t.name}.npy": f"inputs/{n}.npy" for t, n in zip(sig.inputs, model.inputs)}
    names.update({f"outputs/{t.name}.npy": f"outputs/{n}.npy" for t, n in zip(sig.outputs, model.outputs)})
    with zipfile.ZipFile(source) as src, zipfile.ZipFile(dest, "w") as out:
        for info in src.infolist():
            out.writestr(_entry(names.get(info.filename, info.filename)), src.read(info))


def _entry(name: str) -> zipfile.ZipInfo:
    """A zip entry stamped with a fixed time: the same arrays make the same bytes in every job."""
    info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
    info.compress_type = zipfile.ZIP_DEFLATED
    return info


def write_samples(path: Path, arrays: dict[str, Any]) -> None:
    """An .npz of `arrays` (numpy arrays; np.load reads it), byte for byte the same for the same arrays."""
    import io

    import numpy as np

    with zipfile.ZipFile(path, "w") as out:
        for key, array in arrays.items():
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.ascontiguousarray(array), allow_pickle=False)
            out.writestr(_entry(f"{key}.npy"), buf.getvalue())
