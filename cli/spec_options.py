"""The job spec's command-line flags, declared once: `fxport convert` and `fxport submit` take the same ones.

A command declares one parameter `flags: SpecFlags`; `with_spec_flags` puts every flag of SpecFlags
in its place (typer reads the command's signature) and calls the command with the parsed flags in one
SpecFlags. `SpecFlags.to_spec()` lays them over the --spec file: the mapping `parse_spec` validates.
A flag added here is a flag of both commands (tests/client/test_spec_options.py holds them to it).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, get_args, get_type_hints

import typer

from fxport.errors import InvalidInput
from fxport.spec import TARGETS, JobSpec, load_spec_file, spec_from_flags

# the spec's own choices, so a flag's help and check cannot fall behind the spec
CAPTURE_METHODS: tuple[str, ...] = get_args(JobSpec.model_fields["capture"].annotation)
PRECISIONS: tuple[str, ...] = get_args(JobSpec.model_fields["precision"].annotation)


def _flag(*names: str, help: str, default: Any = None) -> Any:
    """A dataclass field carrying its typer option: the one place a spec flag is declared."""
    return field(default=default, metadata={"option": typer.Option(default, *names, help=help)})


@dataclass(frozen=True)
class SpecFlags:
    """The spec flags of one command line as typer parsed them (None or False: not given)."""

    spec: Path | None = _flag("--spec", help="Job spec file (YAML or JSON); the flags below override its keys.")
    target: list[str] | None = _flag("--target", "-t", help=f"Artifact to produce (repeatable): "
                                     f"{', '.join(TARGETS)}.")
    input_: list[str] | None = _flag("--input", help="Input NAME:DIMS[:DTYPE], e.g. x:batch,3,224,224 "
                                     "(repeatable, in forward()'s order).")
    dynamic_batch: str | None = _flag("--dynamic-batch", help="Range of the 'batch' dim, MIN:OPT:MAX.")
    dynamic_dim: list[str] | None = _flag("--dynamic-dim", help="Range of any dynamic dim an --input names, "
                                          "NAME=MIN:OPT:MAX (repeatable), e.g. seq=1:128:512.")
    capture: str | None = _flag("--capture", help=f"How the model becomes a graph: {' | '.join(CAPTURE_METHODS)}. "
                                "auto tries torch.fx.symbolic_trace, then torch.export; fx and export use "
                                "only that one (default: the spec file's, else auto).")
    pass_: list[str] | None = _flag("--pass", help="Graph pass to run, in order (repeatable).")
    precision: str | None = _flag("--precision", help=f"{' | '.join(PRECISIONS)}.")
    output: list[str] | None = _flag("--output", help="Name of the model's next output, in flattened order "
                                     "(repeatable; ONNX and TensorRT; default output_0, ...).")
    benchmark: bool = _flag("--benchmark", default=False, help="Also measure every artifact's latency, throughput "
                            "and memory per batch size where the job runs, and recommend one.")
    package: list[str] | None = _flag("--package", help="Also write a deployment package beside the artifacts "
                                      "(repeatable): triton = a Triton model repository, checked against Triton's "
                                      "ModelConfig, with sample requests and a model card.")
    label: list[str] | None = _flag("--label", help="KEY=VALUE label on the job (repeatable).")
    allow_partial: bool = _flag("--allow-partial", default=False, help="Accept a job some of whose targets could not "
                                "be built: keep the verified artifacts of the others and succeed, the rest listed as "
                                "failed targets with why (spec key allow_partial: true). Without it such a job fails "
                                "(exit 1) and keeps no model file.")

    def to_spec(self) -> dict[str, Any]:
        """The spec mapping: the --spec file's, with every flag given laid over it (flags win).
        Raises InvalidInput naming the flag for a value no spec could take."""
        if self.capture is not None and self.capture not in CAPTURE_METHODS:
            raise InvalidInput(f"--capture {self.capture!r}: choose one of {', '.join(CAPTURE_METHODS)}",
                               field="capture", hint="auto (the default) tries each in turn")
        base = load_spec_file(self.spec) if self.spec else {}
        data = spec_from_flags(base, targets=self.target, inputs=self.input_, dynamic_batch=self.dynamic_batch,
                               dynamic_dims=self.dynamic_dim,
                               passes=self.pass_, precision=self.precision, benchmark=self.benchmark,
                               outputs=self.output, package=self.package)
        if self.capture is not None:
            data["capture"] = self.capture
        if self.allow_partial:
            data["allow_partial"] = True
        if self.label:
            data["labels"] = {**(data.get("labels") or {}), **parse_labels(self.label)}
        return data


NO_FLAGS = SpecFlags()


def parse_labels(values: list[str] | None) -> dict[str, str]:
    """`--label KEY=VALUE` flags as a mapping (also `jobs list --label`'s filters)."""
    out = {}
    for item in values or ():
        if "=" not in item:
            raise InvalidInput(f"--label {item!r}: expected KEY=VALUE", field="labels")
        key, value = item.split("=", 1)
        out[key] = value
    return out


def spec_parameters() -> list[inspect.Parameter]:
    """Every spec flag as a parameter of a typer command, in SpecFlags' order."""
    hints = get_type_hints(SpecFlags)
    return [inspect.Parameter(f.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=f.metadata["option"],
                              annotation=hints[f.name]) for f in fields(SpecFlags)]


def with_spec_flags(command: Callable[..., Any]) -> Callable[..., Any]:
    """`command`, taking every spec flag on its command line in place of its `flags: SpecFlags` parameter."""
    signature = inspect.signature(command)
    own = list(signature.parameters.values())
    at = [p.name for p in own].index("flags")
    flags = spec_parameters()

    @functools.wraps(command)
    def with_flags(**kwargs: Any) -> Any:
        given = SpecFlags(**{p.name: kwargs.pop(p.name) for p in flags})
        return command(flags=given, **kwargs)

    # typer reads the parameters from __signature__ and their types from __annotations__
    with_flags.__signature__ = signature.replace(parameters=[*own[:at], *flags, *own[at + 1:]])  # type: ignore[attr-defined]
    with_flags.__annotations__ = {**{k: v for k, v in command.__annotations__.items() if k != "flags"},
                                  **{p.name: p.annotation for p in flags}}
    return with_flags
