"""The fold's arithmetic: a layer's weight and bias with an eval batch norm folded in."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class _BnTensors:
    """The tensors of an aten-level batch norm, shaped like nn.BatchNorm's attributes for `_fold`."""

    weight: torch.Tensor | None
    bias: torch.Tensor | None
    running_mean: torch.Tensor
    running_var: torch.Tensor
    eps: float


def _fold(weight: torch.Tensor, bias: torch.Tensor | None, bn, out_axis: int,
          transposed_groups: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights of `bn(layer(x))` as one layer: W·s along the output axis, (b − mean)·s + β.

    A transposed conv's weight is (in, out / groups, *kernel): output channel g·(out/groups) + j
    is column j of group g's rows, so `transposed_groups` scales it group by group on dim 1.
    Computed in float64 and cast back, so the fold adds no rounding beyond the final cast.
    """
    if transposed_groups is not None:
        g = transposed_groups
        rows, per_group, kernel = weight.shape[0], weight.shape[1], weight.shape[2:]
        grouped = weight.reshape(g, rows // g, per_group, *kernel).transpose(0, 1)  # (in/g, g, out/g, *k)
        new_w, new_b = _fold(grouped.reshape(rows // g, g * per_group, *kernel), bias, bn, out_axis=1)
        return new_w.reshape(rows // g, g, per_group, *kernel).transpose(0, 1).reshape(weight.shape), new_b
    dt = torch.float64
    mean, var = bn.running_mean.detach().to(dt), bn.running_var.detach().to(dt)
    gamma = bn.weight.detach().to(dt) if bn.weight is not None else torch.ones_like(mean)
    beta = bn.bias.detach().to(dt) if bn.bias is not None else torch.zeros_like(mean)
    scale = gamma * torch.rsqrt(var + bn.eps)
    shape = [1] * weight.dim()
    shape[out_axis] = -1
    new_w = weight.detach().to(dt) * scale.reshape(shape)
    b = bias.detach().to(dt) if bias is not None else torch.zeros_like(mean)
    new_b = (b - mean) * scale + beta
    bias_dtype = bias.dtype if bias is not None else weight.dtype
    return new_w.to(weight.dtype), new_b.to(bias_dtype)
