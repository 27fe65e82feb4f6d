"""SmoothQuant (Xiao et al. 2022, "SmoothQuant: Accurate and Efficient Post-Training Quantization for
Large Language Models"). Pure tensor math; the pipeline captures the inputs and folds the scales
(quantkit/transforms.py, algorithms/smoothing.py).

Method: int8 per-token activation quantization suffers from a few channels whose activations are
orders of magnitude larger than the rest (one outlier channel sets every token's step size). Per
smoothing mapping, with max|x_j| over all calibration tokens and max|w_j| over all target rows,
  s_j = max|x_j|^alpha / max|w_j|^(1 - alpha)
divides the activations and multiplies the weight columns, migrating part of the range from the
activations (hard to quantize) into the weights (easy: per-channel int8). alpha = 0.5 is the paper's
default; larger alpha moves more of the difficulty into the weights.

Guard: the W8A8 output error of the mapping's Linears (per-token int8 activations, RTN weights with
the following stage's scheme) is measured with and without the scales on up to `max_tokens` tokens;
when smoothing would make it worse the mapping is left unscaled and the manifest says so.

Trade-offs: one fixed alpha for every layer (no search; that is what AWQ does); max statistics are
sensitive to a single extreme token. Left out: static (per-tensor) activation scales, alpha search,
and smoothing of q/k for int8 attention (vLLM keeps attention in 16 bits).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import Field

from quantkit.algorithms.smoothing import block_error, reduce_to_channels
from quantkit.algorithms.contract import ChannelStats, MappingTargets, TransformScales
from quantkit.algorithms.base import TransformStage


@dataclass
class SmoothQuantResult:
    scales: torch.Tensor  # [channels]; all ones when the guard rejected smoothing
    applied: bool
    error_before: float
    error_after: float


def smoothquant_scales(x_absmax: torch.Tensor, w_absmax: torch.Tensor, alpha: float) -> torch.Tensor:
    """s = max|x|^alpha / max|w|^(1-alpha) per channel; channels with no signal keep s = 1."""
    x_absmax, w_absmax = x_absmax.float(), w_absmax.float()
    ok = (x_absmax > 0) & (w_absmax > 0)
    s = x_absmax.clamp(min=1e-8).pow(alpha) / w_absmax.clamp(min=1e-8).pow(1 - alpha)
    return torch.where(ok, s, torch.ones_like(s)).clamp(1e-5, 1e5)


def smoothquant(x: torch.Tensor, x_absmax: torch.Tensor, m: MappingTargets, alpha: float = 0.5,
                scale_dtype: torch.dtype = torch.bfloat16) -> SmoothQuantResult:
    """Scales for one mapping. x [tokens, in]: sampled inputs; x_absmax [in]: over all calibration tokens."""
    weights, specs, acts, idx, channels = m.weights, m.specs, m.acts, m.idx, m.channels
    w_absmax = torch.cat([w.float().abs() for w in weights], 0).amax(0)  # [in]
    s = smoothquant_scales(reduce_to_channels(x_absmax.float(), idx, channels, "max"),
                           reduce_to_channels(w_absmax, idx, channels, "max"), alpha)
    x = x.float()
    before = block_error(x, weights, specs, acts, None, scale_dtype)
    after = block_error(x, weights, specs, acts, s[idx], scale_dtype)
    if after >= before:
        return SmoothQuantResult(torch.ones(channels), False, before, before)
    return SmoothQuantResult(s, True, before, after)


# ------------------------------------------------------------------------------ the method contract
class SmoothQuantStage(TransformStage):
    """SmoothQuant (Xiao et al. 2022): migrate activation outliers into the weights, for W8A8."""

    method: Literal["smoothquant"]
    alpha: float = Field(0.5, ge=0, le=1, description="migration strength: s = max|x|^a / max|w|^(1-a)")
    max_tokens: int = Field(4096, ge=16, description="tokens used to check the W8A8 error before/after")


def choose_scales(stats: ChannelStats, m: MappingTargets, stage: SmoothQuantStage,
                  scale_dtype: torch.dtype) -> TransformScales:
    r = smoothquant(stats.sample, stats.abs_max, m, stage.alpha, scale_dtype)
    return TransformScales(r.scales, r.applied, r.error_before, r.error_after,
                           {"alpha": stage.alpha, "applied": r.applied})
