"""Range observers for int8 calibration: graph nodes that watch a tensor and pick its clipping range.

An observer chooses `amax`, the magnitude beyond which values are clipped, and records the
signed extremes; the scheme (scheme.py) turns that range into a scale and zero point —
symmetric int8 (scale = amax / 127) or asymmetric uint8 ([max(min, -amax), min(max, amax)]):

- ``minmax``: the largest |x| seen. No clipping; one outlier widens every step.
- ``percentile``: the 99.99th percentile of |x| (TensorRT's default for its percentile
  calibrator). Clips the rare outliers to keep resolution for the bulk.
- ``entropy``: the threshold that minimises the KL divergence between the |x| histogram
  and its 128-level quantized version (TensorRT's entropy calibrator).

Weights are observed per output channel with minmax (`weight_amax`): they are known
exactly, and clipping a weight is rarely worth its error.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from fxport.workers.engine.quantize.scheme import ActivationRange

OBSERVERS = ("minmax", "percentile", "entropy")
HIST_BINS = 2048
PERCENTILE = 99.99
QUANT_LEVELS = 128  # |q| in 0..127 for symmetric int8
ACT_QMIN, ACT_QMAX = -128, 127  # symmetric activations: full int8 range, zero point 0


def exact_int8_dot_products(cpuinfo: str | None = None, machine: str | None = None) -> bool:
    """Whether this CPU's int8 GEMMs add u8×s8 products without saturating.

    On x86 without VNNI (AVX2, AVX-512F) onnxruntime's and fbgemm's int8 kernels multiply with
    vpmaddubsw, which sums each pair of u8×s8 products into an int16 that saturates at 32767:
    full-range weights (±127) against activations up to 255 overflow it, and a ResNet-18's int8
    artifacts fell to cosine 0.81 (measured on an AVX2-only EPYC). 7-bit weights (±63) cannot:
    2 × 255 × 63 < 32767, but cost accuracy everywhere else; fxport keeps 8-bit weights and says so
    when such a CPU fails an int8 verification. VNNI (and AMX) accumulate in int32; other
    architectures are exact."""
    import platform

    if (machine or platform.machine()).lower() not in ("x86_64", "amd64", "i386", "i686"):
        return True
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return True
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), [])
    return bool({"avx512_vnni", "avx_vnni", "amx_int8"} & set(flags))


W_QMIN, W_QMAX = -127, 127  # weights: narrow range, as TensorRT and ONNX Runtime expect for symmetric weights


class ActivationObserver(nn.Module):
    """Identity in the graph; records |x| statistics of every float tensor that passes through."""

    def __init__(self, kind: str = "minmax") -> None:
        super().__init__()
        if kind not in OBSERVERS:
            raise ValueError(f"unknown observer {kind!r}; valid observers: {', '.join(OBSERVERS)}")
        self.kind = kind
        self.absmax = 0.0
        self.lo = 0.0  # signed extremes seen (0 included: it must stay exact)
        self.hi = 0.0
        self.batches = 0
        self.float_tensor = True  # False once something not a float tensor went through
        self.hist: np.ndarray | None = None
        self.hist_max = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            self.float_tensor = False
            return x
        if x.numel() == 0:
            return x
        a = x.detach().abs().float()
        m = float(a.max())
        if not math.isfinite(m):
            a = torch.nan_to_num(a, nan=0.0, posinf=0.0)
            m = float(a.max())
        self.absmax = max(self.absmax, m)
        lo, hi = (float(v) for v in torch.aminmax(x.detach()))
        if not (math.isfinite(lo) and math.isfinite(hi)):
            lo, hi = (float(v) for v in torch.aminmax(x.detach().float().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)))
        self.lo = min(self.lo, lo)
        self.hi = max(self.hi, hi)
        self.batches += 1
        if self.kind != "minmax" and m > 0:
            self._add_histogram(a, m)
        return x

    def _add_histogram(self, a: torch.Tensor, m: float) -> None:
        if self.hist is None or m > self.hist_max:
            new_max = m
            if self.hist is not None:
                self.hist = _rebin(self.hist, self.hist_max, new_max)
            else:
                self.hist = np.zeros(HIST_BINS, dtype=np.float64)
            self.hist_max = new_max
        counts = torch.histc(a, bins=HIST_BINS, min=0.0, max=self.hist_max).double().numpy()
        # zeros (a ReLU's output is half zeros) are exact in any symmetric grid: they must not
        # pull a percentile or the KL search towards a tiny range, so bin 0 does not count them
        counts[0] -= float((a == 0).sum())
        self.hist += counts

    def amax(self) -> float:
        """The magnitude that maps to ±127."""
        if self.kind == "minmax" or self.hist is None or self.hist.sum() == 0:
            return self.absmax
        edges = np.linspace(0.0, self.hist_max, HIST_BINS + 1)
        if self.kind == "percentile":
            cdf = np.cumsum(self.hist) / self.hist.sum()
            idx = int(np.searchsorted(cdf, PERCENTILE / 100.0))
            return float(min(edges[min(idx + 1, HIST_BINS)], self.absmax))
        return float(min(_entropy_threshold(self.hist, edges), self.absmax))

    def scale(self) -> float:
        return activation_scale(self.amax())

    def range(self) -> ActivationRange:
        return ActivationRange(lo=self.lo, hi=self.hi, amax=self.amax())

    def extra_repr(self) -> str:
        return f"kind={self.kind}, absmax={self.absmax:.4g}"


def activation_scale(amax: float) -> float:
    # a tensor that was always zero still needs a positive scale for QuantizeLinear
    return max(float(amax), 1e-8) / ACT_QMAX


def weight_amax(weight: torch.Tensor, axis: int = 0) -> torch.Tensor:
    """Per-channel max |w| along `axis` (the output channels of a Conv or Linear weight)."""
    w = weight.detach().float()
    dims = [d for d in range(w.dim()) if d != axis]
    return w.abs().amax(dim=dims) if dims else w.abs()


def quantize_weight(weight: torch.Tensor, axis: int = 0, qmax: int = W_QMAX) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-channel int8 in [-qmax, qmax]: returns (int8 weight, float32 scales). w ≈ q * scale."""
    amax = weight_amax(weight, axis)
    scale = torch.clamp(amax, min=1e-12) / qmax
    shape = [1] * weight.dim()
    shape[axis] = -1
    q = torch.clamp(torch.round(weight.detach().float() / scale.reshape(shape)), -qmax, qmax).to(torch.int8)
    return q, scale.to(torch.float32)


def _rebin(hist: np.ndarray, old_max: float, new_max: float) -> np.ndarray:
    """Spread a histogram over [0, old_max] onto the same number of bins over [0, new_max]."""
    old_edges = np.linspace(0.0, old_max, len(hist) + 1)
    new_edges = np.linspace(0.0, new_max, len(hist) + 1)
    cdf = np.concatenate([[0.0], np.cumsum(hist)])
    return np.diff(np.interp(new_edges, old_edges, cdf, right=cdf[-1]))


def _entropy_threshold(hist: np.ndarray, edges: np.ndarray, stride: int = 8) -> float:
    """TensorRT's KL-divergence calibration on an |x| histogram: the best clipping edge."""
    best_kl, best_i = math.inf, len(hist)
    nbins = len(hist)
    for i in range(QUANT_LEVELS, nbins + 1, stride):
        p = hist[:i].copy()
        p[-1] += hist[i:].sum()  # what is clipped lands in the last kept bin
        nonzero = hist[:i] != 0
        # merge the i kept bins into QUANT_LEVELS groups, then spread each group's mass back
        # evenly over its nonzero bins: the histogram as the quantized tensor would have it
        starts = (np.arange(QUANT_LEVELS) * i) // QUANT_LEVELS
        group_mass = np.add.reduceat(hist[:i], starts)
        group_nonzero = np.add.reduceat(nonzero.astype(np.float64), starts)
        group_of_bin = np.repeat(np.arange(QUANT_LEVELS), np.diff(np.append(starts, i)))
        q = np.where(nonzero, group_mass[group_of_bin] / np.maximum(group_nonzero[group_of_bin], 1), 0.0)
        kl = _kl(p, q)
        if kl < best_kl:
            best_kl, best_i = kl, i
    return float(edges[best_i])


def _kl(p: np.ndarray, q: np.ndarray) -> float:
    mask = p > 0
    q = np.where(q > 0, q, 1e-12)
    ps, qs = p[mask] / p[mask].sum(), q[mask] / q[mask].sum()
    return float(np.sum(ps * np.log(ps / qs)))
