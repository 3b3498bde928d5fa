"""The pass catalog: the ONE registry of graph passes, their names, options, the IR levels each
works on, and where its function lives (a dotted path the workers import; the spec and the API
never import the engine). fxport/spec.py validates a spec's `passes` against it; a new pass is one
PassInfo here plus its function (docs/architecture.md, "Registries").
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from fxport.text import short_repr

IRLevel = Literal["torch", "aten"]


class _Options(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class NoOptions(_Options):
    pass


class FuseConvBnOptions(_Options):
    linear: bool = Field(True, description="Also fold BatchNorm1d that follows a Linear.")


class FoldConstantsOptions(_Options):
    max_elements: int = Field(
        1 << 22, ge=1, description="Skip folding a subgraph whose result has more elements than this."
    )


# The substitute_ops allowlist: swap name → numerics_preserving. "Preserving" means the swap
# computes the same mathematical function, so results differ at most by float rounding (a few
# ULP); a swap that approximates (exact → tanh GELU) is not preserving and runs only with
# allow_numerics_change. The implementations live in the engine, keyed by these names
# (fxport.workers.engine.passes.substitute_ops); a test checks the two key sets are equal.
SUBSTITUTIONS: dict[str, bool] = {
    "relu6_to_hardtanh": True,
    "gelu_to_tanh_gelu": False,
    "silu_to_x_sigmoid": True,
}


class SubstituteOpsOptions(_Options):
    swaps: list[str] = Field(
        default_factory=lambda: ["relu6_to_hardtanh"],
        description="Names from the substitution allowlist, applied in order.",
    )
    allow_numerics_change: bool = Field(
        False, description="Permit swaps flagged as changing numerics (e.g. exact → tanh GELU)."
    )

    @field_validator("swaps")
    @classmethod
    def _known_swaps(cls, v: list[str]) -> list[str]:
        unknown = [name for name in v if name not in SUBSTITUTIONS]
        if unknown:
            raise ValueError(
                f"unknown swap{'s' if len(unknown) > 1 else ''} {', '.join(map(short_repr, unknown[:5]))}; "
                f"valid swaps: {', '.join(SUBSTITUTIONS)}"
            )
        return v


class ProfileNodesOptions(_Options):
    runs: int = Field(5, ge=1, le=100, description="Timed runs per node (after one warm-up).")
    top: int = Field(10, ge=1, le=100, description="How many of the slowest nodes go in the manifest.")


class PassInfo(BaseModel):
    name: str
    summary: str
    options: type[BaseModel]
    levels: tuple[IRLevel, ...]
    function: str  # "module:function", imported only by the engine
    needs_gpu: bool = False


PASS_CATALOG: dict[str, PassInfo] = {
    p.name: p
    for p in [
        PassInfo(
            name="fuse_conv_bn",
            summary="Conv → BatchNorm(eval) ⇒ one Conv (also Linear → BatchNorm1d)",
            options=FuseConvBnOptions,
            levels=("torch", "aten"),
            function="fxport.workers.engine.passes.fuse_conv_bn:fuse_conv_bn",
        ),
        PassInfo(
            name="remove_dropout",
            summary="Dropout (identity in eval) ⇒ removed",
            options=NoOptions,
            levels=("torch", "aten"),
            function="fxport.workers.engine.passes.remove_dropout:remove_dropout",
        ),
        PassInfo(
            name="dead_code_elimination",
            summary="nodes whose results nobody uses ⇒ removed",
            options=NoOptions,
            levels=("torch", "aten"),
            function="fxport.workers.engine.passes.dead_code_elimination:dead_code_elimination",
        ),
        PassInfo(
            name="fold_constants",
            summary="subgraphs that depend only on parameters/constants ⇒ precomputed buffers",
            options=FoldConstantsOptions,
            levels=("torch", "aten"),
            function="fxport.workers.engine.passes.fold_constants:fold_constants",
        ),
        PassInfo(
            name="substitute_ops",
            summary="allowlisted op swaps, each flagged numerics-preserving or not",
            options=SubstituteOpsOptions,
            levels=("torch", "aten"),
            function="fxport.workers.engine.passes.substitute_ops:substitute_ops",
        ),
        PassInfo(
            name="profile_nodes",
            summary="per-node timing through an Interpreter; top nodes into the manifest",
            options=ProfileNodesOptions,
            levels=("torch", "aten"),
            function="fxport.workers.engine.passes.profile_nodes:profile_nodes",
        ),
    ]
}
PASS_NAMES = tuple(PASS_CATALOG)
DEFAULT_PASSES = ("fuse_conv_bn", "remove_dropout", "dead_code_elimination")


