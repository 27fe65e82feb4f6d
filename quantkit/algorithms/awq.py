"""AWQ-style activation-aware scaling (Lin et al. 2023, "AWQ: Activation-aware Weight Quantization").
Pure tensor math; the pipeline captures the inputs and folds the scales (quantkit/transforms.py).

Method: a few input channels carry much larger activations than the rest, and the weights that read
them matter most. Scaling those weight columns up by s (and the activations down by s, folded into the
preceding norm or Linear, see algorithms/smoothing.py) gives them finer quantization steps relative
to their size. Per smoothing mapping:
  s(a) = mean|x|^a / mean|w~|^(1-a)      (duo scaling; w~ = |w| / its group's absmax, mean over rows)
  s(a) = mean|x|^a                        (duo_scaling: false)
normalised so max(s) * min(s) = 1, for a on the grid {0, 1/n, ..., (n-1)/n}. Each candidate is scored
by the mean squared output error of the mapping's Linears after round-to-nearest with the scheme of
the quantizer stage that follows (and per-token activation quantization where that scheme has it) on
up to `max_tokens` calibration tokens. The unscaled block (s = 1: plain RTN) is always a candidate,
so the chosen scales never score worse than RTN on those tokens.

Optional clipping search (`awq_clip`, as AutoAWQ's auto_clip): per output row and weight group, shrink
the range to r * [min, max] for r on a grid from 1 down to 0.5, keep the r with the lowest output
error x_g · (w_g - Q(w_g)) on 512 tokens, and clamp the weights to it so that the quantizer that
follows (RTN or GPTQ) derives its scales from the clipped range. q_proj / k_proj are not clipped (their
errors are amplified by the softmax, and AutoAWQ skips them too). Clipping changes the float weights
by design (only their outliers beyond the chosen range).

Trade-offs: the loss is measured on the mapping's Linear outputs, not on the whole attention / MLP
block output as the paper does (which needs the block's forward with each candidate); scoring uses RTN
even when GPTQ follows (GPTQ then starts from better-conditioned columns). Cost per mapping: grid x
one RTN + one matmul of max_tokens rows, and with clipping 10 x one matmul of 512 rows per Linear.
Left out: searching the scales jointly across mappings, per-head scales for q/k, and caching the
quantized candidates between grid points.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import Field

from quantkit.algorithms.rtn import _minmax_qparams, dequantize_codes, group_size_for, quantize_codes
from quantkit.algorithms.smoothing import block_error, normalize_scales, reduce_to_channels
from quantkit.algorithms.contract import ChannelStats, MappingTargets, TransformScales
from quantkit.schemes import WeightSpec
from quantkit.algorithms.base import TransformStage

NO_CLIP = re.compile(r"(^|\.)(q_proj|k_proj)$")  # their errors are amplified by the softmax

CLIP_GRID = 10  # shrink ratios 1.0, 0.95, ..., 0.55
CLIP_MAX_SHRINK = 0.5
CLIP_TOKENS = 512


@dataclass
class AWQResult:
    scales: torch.Tensor  # [channels] per preceding-op output channel (all ones when nothing helped)
    alpha: float | None  # the chosen exponent; None when s = 1 (plain RTN) scored best
    error_before: float  # block MSE with s = 1
    error_after: float  # block MSE with the chosen scales


def weight_column_means(weights: list[torch.Tensor], specs: list[WeightSpec]) -> torch.Tensor:
    """mean over all target rows of |w| / (its group's absmax), per input column: [in]."""
    rows = []
    for w, spec in zip(weights, specs):
        out_f, in_f = w.shape
        g = group_size_for(spec, in_f)
        wg = w.float().abs().reshape(out_f, in_f // g, g)  # [out, n_groups, g]
        wg = wg / wg.amax(dim=-1, keepdim=True).clamp(min=1e-12)
        rows.append(wg.reshape(out_f, in_f))
    return torch.cat(rows, 0).mean(0)


def awq_search(x: torch.Tensor, x_mean: torch.Tensor, m: MappingTargets, grid: int = 20, duo_scaling: bool = True,
               scale_dtype: torch.dtype = torch.bfloat16) -> AWQResult:
    """Search the scale exponent for one mapping.

    x [tokens, in]: sampled float inputs of the targets; x_mean [in]: mean |x| over all calibration tokens.
    """
    weights, specs, acts, idx, channels = m.weights, m.specs, m.acts, m.idx, m.channels
    x = x.float()
    xm = reduce_to_channels(x_mean.float(), idx, channels, "mean").clamp(min=1e-8)  # [channels]
    wm = reduce_to_channels(weight_column_means(weights, specs), idx, channels, "mean").clamp(min=1e-8)
    refs = [x @ w.float().t() for w in weights]  # [tokens, out_i]: the float outputs, once
    before = block_error(x, weights, specs, acts, None, scale_dtype, refs)
    best = (before, None, torch.ones(channels))
    for i in range(grid):
        a = i / grid
        s = xm.pow(a) / wm.pow(1 - a) if duo_scaling else xm.pow(a)
        s = normalize_scales(s)
        err = block_error(x, weights, specs, acts, s[idx], scale_dtype, refs)
        if err < best[0]:
            best = (err, a, s)
    return AWQResult(scales=best[2], alpha=best[1], error_before=before, error_after=best[0])


def awq_clip(x: torch.Tensor, w: torch.Tensor, spec: WeightSpec, scale_dtype: torch.dtype = torch.bfloat16,
             grid: int = CLIP_GRID, max_shrink: float = CLIP_MAX_SHRINK) -> tuple[torch.Tensor, float]:
    """Clamp w [out, in] per (row, group) to the range that minimises the output error on x [tokens, in].

    Returns the clamped weight and the mean chosen shrink ratio (1.0 = nothing clipped).
    """
    if spec.type != "int":
        return w, 1.0
    x = x.float()[:CLIP_TOKENS]
    out_f, in_f = w.shape
    g = group_size_for(spec, in_f)
    ng = in_f // g
    wg = w.float().reshape(out_f, ng, g)  # [out, n_groups, g]
    xg = x.reshape(-1, ng, g).transpose(0, 1)  # [n_groups, tokens, g]
    wmin, wmax = wg.amin(-1), wg.amax(-1)  # [out, n_groups]
    best_err = torch.full((out_f, ng), float("inf"))
    best_r = torch.ones(out_f, ng)
    for k in range(grid):
        r = 1.0 - k * (max_shrink / grid)
        # exactly what the quantizer that follows will do with the clamped weights: min-max scales
        wc = _clamp(wg, wmin, wmax, torch.full_like(best_r, r), spec)  # [out, n_groups, g]
        scale, zp = _minmax_qparams(wc.amin(-1), wc.amax(-1), spec, scale_dtype)
        s, z = scale.unsqueeze(-1), (zp.unsqueeze(-1) if zp is not None else None)  # [out, n_groups, 1]
        diff = wg - dequantize_codes(quantize_codes(wc, s, z, spec), s, z, spec)  # [out, n_groups, g]
        y = torch.bmm(xg, diff.permute(1, 2, 0))  # [n_groups, tokens, out]
        err = y.pow(2).sum(1).t()  # [out, n_groups]
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_r = torch.where(better, torch.full_like(best_r, r), best_r)
    return _clamp(wg, wmin, wmax, best_r, spec).reshape(out_f, in_f), float(best_r.mean())


def _clamp(wg: torch.Tensor, wmin: torch.Tensor, wmax: torch.Tensor, r: torch.Tensor, spec: WeightSpec):
    """Clamp wg [out, n_groups, g] to r * its group range (symmetric: +-r * absmax)."""
    if spec.symmetric:
        hi = torch.maximum(wmin.abs(), wmax.abs()) * r
        lo = -hi
    else:
        lo, hi = wmin * r, wmax * r
    return torch.maximum(torch.minimum(wg, hi.unsqueeze(-1)), lo.unsqueeze(-1))


# ------------------------------------------------------------------------------ the method contract
class AWQStage(TransformStage):
    """AWQ-style activation-aware scaling (Lin et al. 2023), searched per smoothing mapping."""

    method: Literal["awq"]
    grid: int = Field(20, ge=1, le=100, description="exponents tried: alpha in {0, 1/grid, ..., (grid-1)/grid}")
    duo_scaling: bool = Field(True, description="s = mean|x|^a / mean|w|^(1-a) instead of mean|x|^a")
    clip: bool = Field(True, description="also search a per-group weight clipping range (not for q/k)")
    max_tokens: int = Field(2048, ge=16, description="calibration tokens used in the searches (evenly sampled)")


def choose_scales(stats: ChannelStats, m: MappingTargets, stage: AWQStage, scale_dtype: torch.dtype) -> TransformScales:
    r = awq_search(stats.sample, stats.abs_mean, m, stage.grid, stage.duo_scaling, scale_dtype)
    return TransformScales(r.scales, r.alpha is not None, r.error_before, r.error_after, {"alpha": r.alpha})


def refine(x: torch.Tensor, targets: list[tuple[str, torch.Tensor, WeightSpec]], stage: AWQStage,
           scale_dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], dict]:
    """After the fold: the clipping search on the scaled weights (x [tokens, in] already divided by the
    scales). Returns the clipped weights by module name and the mean shrink ratios for the manifest."""
    if not stage.clip:
        return {}, {}
    new, shrink = {}, {}
    for name, w, spec in targets:
        if NO_CLIP.search(name):
            continue
        new[name], mean_r = awq_clip(x, w, spec, scale_dtype)
        shrink[name.rpartition(".")[2]] = round(mean_r, 4)
    return new, ({"clip_mean_ratio": shrink} if shrink else {})
