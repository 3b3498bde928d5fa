"""int8 schemes: how activations and weights map to integers, chosen for the runtime an artifact is for.

- ``tensorrt``: activations symmetric int8 per tensor (zero point 0, [-128, 127]), weights
  symmetric int8 per output channel ([-127, 127]). TensorRT's explicit quantization takes only
  zero point 0.
- ``onnxruntime``: activations asymmetric uint8 per tensor ([0, 255], zero point where the
  observed minimum lands), weights symmetric int8 per output channel — onnxruntime's own
  `quantize_static` default, the form its CPU kernels (QLinearConv, MatMulInteger) are fastest
  and most accurate on. With ``reduce_range`` the weights use 7 bits ([-63, 63]).

Why the runtime decides, measured on x86 without VNNI (AVX2/AVX-512F): onnxruntime and fbgemm
multiply u8×s8 with vpmaddubsw, which sums each pair of products into a saturating int16. A
symmetric int8 activation runs there shifted by 128 (every value near the middle of [0, 255]),
so most pairs are large and saturate; an asymmetric uint8 activation after a ReLU is mostly
small. 7-bit weights rule saturation out altogether: 2 × 255 × 63 = 32130 < 32767.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

Runtime = Literal["onnxruntime", "tensorrt"]
RUNTIMES: tuple[Runtime, ...] = ("onnxruntime", "tensorrt")
MIN_SCALE = 1e-8  # a tensor that was always zero still needs a positive scale for QuantizeLinear


@dataclass(frozen=True)
class ActivationRange:
    """What calibration saw of one tensor: its extremes, and the |x| it chose to keep (≤ max |x|)."""

    lo: float
    hi: float
    amax: float


@dataclass(frozen=True)
class Int8Scheme:
    runtime: Runtime
    asymmetric: bool  # uint8 activations with a zero point, else symmetric int8 with zero point 0
    weight_qmax: int  # weights are int8 in [-weight_qmax, weight_qmax]

    @property
    def act_qmin(self) -> int:
        return 0 if self.asymmetric else -128

    @property
    def act_qmax(self) -> int:
        return 255 if self.asymmetric else 127

    @property
    def act_dtype(self) -> torch.dtype:
        return torch.uint8 if self.asymmetric else torch.int8

    @property
    def reduce_range(self) -> bool:
        return self.weight_qmax < 127

    def qparams(self, r: ActivationRange) -> tuple[float, int]:
        """(scale, zero point) for a tensor calibrated to `r`."""
        if not self.asymmetric:
            return max(float(r.amax), MIN_SCALE) / self.act_qmax, 0
        # the kept range, clipped as the observer chose, always holding 0 (exact: padding, ReLU)
        lo = min(0.0, max(float(r.lo), -float(r.amax)))
        hi = max(0.0, min(float(r.hi), float(r.amax)))
        scale = max(hi - lo, MIN_SCALE) / (self.act_qmax - self.act_qmin)
        zero = int(min(max(round(-lo / scale), self.act_qmin), self.act_qmax))
        return scale, zero

    def describe(self) -> dict[str, Any]:
        """The manifest's account of the scheme."""
        activations = ("uint8 asymmetric per tensor, zero point from the calibrated minimum, range [0, 255]"
                       if self.asymmetric else "int8 symmetric per tensor, zero point 0, range [-128, 127]")
        return {
            "runtime": self.runtime,
            "activations": activations,
            "weights": f"int8 symmetric per output channel (axis 0), range [-{self.weight_qmax}, {self.weight_qmax}], "
                       "minmax" + (" (reduce_range: 7-bit, no int16 saturation on CPUs without VNNI)"
                                   if self.reduce_range else ""),
            "reduce_range": self.reduce_range,
            "ops": "torch.ops.quantized_decomposed quantize/dequantize_per_tensor, dequantize_per_channel",
        }


TENSORRT = Int8Scheme("tensorrt", asymmetric=False, weight_qmax=127)


def scheme_for(runtime: Runtime, *, reduce_range: bool = False) -> Int8Scheme:
    if runtime == "tensorrt":
        return TENSORRT
    return Int8Scheme("onnxruntime", asymmetric=True, weight_qmax=63 if reduce_range else 127)


def fake_quantize(x: torch.Tensor, scale: float, zero_point: int, scheme: Int8Scheme) -> torch.Tensor:
    """What a Q/DQ pair of `scheme` does to a tensor, in plain torch."""
    q = torch.clamp(torch.round(x / scale) + zero_point, scheme.act_qmin, scheme.act_qmax)
    return (q - zero_point) * scale
