"""Round-to-nearest quantization: scales, zero points, quantize / dequantize, SQNR. Pure tensor math.

Method: per output channel, or per group of `group_size` input columns, pick a scale from the
min/max of the weights (symmetric: absmax / qmax; asymmetric: (max - min) / (qmax - qmin) with an
integer zero point) and round each weight to the nearest code. Integer codes use the signed range
[-2^(b-1), 2^(b-1) - 1] for both symmetric and asymmetric schemes, as compressed-tensors and vLLM do.
FP8 (e4m3) weights use absmax / 448 per channel and a cast instead of rounding to integers. FP4 (e2m1)
weights round to the nearest of +-{0, 0.5, 1, 1.5, 2, 3, 4, 6} times their group's scale: NVFP4 keeps
absmax / 6 per group of 16 as fp8 under a power-of-two global scale per tensor, MXFP4 the power of two at
or above absmax / 6 per group of 32, so nothing clips.

Scales are rounded to the dtype they are stored in (bf16 by default) *before* codes are computed, so
the dequantized weight we compute is bit-for-bit what the engine computes from the checkpoint.

Trade-offs: min/max scales waste range on outliers; the MSE scale search (`observer: mse` on a stage:
`ScaleSearch`, a grid of shrink ratios, keeping per group the one with the lowest squared error, weighted
by the input's diag(H) when GPTQ has it) recovers part of it at a few extra passes over the weight, for
every format (int, fp8, fp4). Learned rounding: quantkit/algorithms/autoround.py. Left out: non-uniform
codebooks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from quantkit.algorithms.contract import Observations, QuantizedWeight, ScaleSearch
from quantkit.io import give_back_free_memory
from quantkit.schemes import ActivationSpec, WeightSpec
from quantkit.algorithms.base import QuantizerStage, ScaleSearchOptions

FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448.0
FP4_MAX = 6.0  # e2m1: the representable magnitudes are FP4_GRID
FP4_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


@dataclass
class QParams:
    scale: torch.Tensor  # [out, n_groups] fp32 holding values exactly representable in the storage dtype
    zero_point: torch.Tensor | None  # [out, n_groups] fp32 integer-valued, asymmetric only
    group_size: int  # columns per scale (== in_features for per-channel)
    global_scale: torch.Tensor | None = None  # NVFP4 only: scale * global_scale is the stored fp8 value


def fp4_round(x: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 value (ties to the value with the even mantissa), saturating at +-6. The magnitudes are
    spaced 0.5 below 2, 1 in [2, 4) and 2 in [4, 6], so rounding |x| / spacing half to even and scaling back
    picks the nearest grid value with e2m1's tie rule (the spacings are powers of two: the divisions are exact)."""
    xf = x.float()
    a = xf.abs().clamp_(max=FP4_MAX)
    step = torch.where(a < 2.0, 0.5, torch.where(a < 4.0, 1.0, 2.0))
    return a.div_(step).round_().mul_(step).mul_(torch.sign(xf))


def nvfp4_global_scale(w: torch.Tensor) -> torch.Tensor:
    """The per-tensor global scale of NVFP4: the largest power of two that keeps every group scale
    (absmax / 6 x global) within fp8 e4m3's range; a power of two, so dividing by it is exact."""
    amax = w.float().abs().amax().clamp(min=1e-12)
    return torch.exp2(torch.floor(torch.log2(torch.tensor(FP8_MAX * FP4_MAX, device=w.device) / amax)))


def group_size_for(spec: WeightSpec, in_features: int) -> int:
    if spec.strategy == "group":
        assert spec.group_size is not None
        return spec.group_size
    return in_features


def check_divisible(spec: WeightSpec, in_features: int, name: str) -> None:
    g = group_size_for(spec, in_features)
    if in_features % g:
        ok = [d for d in (256, 128, 64, 32, 16) if in_features % d == 0]
        raise ValueError(f"{name}: in_features {in_features} is not divisible by group_size {g}; "
                         f"use group_size {ok[0] if ok else -1} (or -1 for per-channel)")


def _minmax_qparams(wmin: torch.Tensor, wmax: torch.Tensor, spec: WeightSpec, scale_dtype: torch.dtype,
                    global_scale: torch.Tensor | None = None, full_range: bool | str = False):
    """Scale/zero point from per-group min and max (any shape), rounded to the storage dtype. `full_range`:
    symmetric int grids take max(max / qmax, min / qmin), or with "signed" the signed scale (ScaleSearch)."""
    if spec.is_fp4:
        absmax = torch.maximum(wmin.abs(), wmax.abs())
        if spec.scale_format == "e8m0":  # the power of two that keeps absmax / scale <= 6 (no clipping)
            return torch.exp2(torch.ceil(torch.log2((absmax / FP4_MAX).clamp(min=2.0 ** -126)))), None
        # fp8 under the global scale: effective scale = fp8(absmax / 6 * g) / g, exact (g a power of two)
        stored = (absmax / FP4_MAX * global_scale).clamp(min=2.0 ** -9, max=FP8_MAX).to(torch.float8_e4m3fn).float()
        return stored / global_scale, None
    if spec.type == "float":
        absmax = torch.maximum(wmin.abs(), wmax.abs())
        scale = (absmax / FP8_MAX).clamp(min=1e-12).to(scale_dtype).float()
        return scale, None
    if spec.symmetric:
        if full_range == "signed" and spec.qmin < 0:
            return signed_scale(wmin, wmax, spec.qmin, scale_dtype), None
        if full_range and spec.qmin < 0:  # each side on its own codes: no value clipped, -8 used at 4 bits
            scale = torch.maximum(wmax.clamp(min=0) / spec.qmax, wmin.clamp(max=0) / spec.qmin)
        else:
            scale = torch.maximum(wmin.abs(), wmax.abs()) / spec.qmax
        return scale.clamp(min=1e-10).to(scale_dtype).float(), None
    wmin = wmin.clamp(max=0)
    wmax = wmax.clamp(min=0)
    scale = ((wmax - wmin) / (spec.qmax - spec.qmin)).clamp(min=1e-10).to(scale_dtype).float()
    zp = torch.round(spec.qmin - wmin / scale).clamp(spec.qmin, spec.qmax)
    return scale, zp


def signed_scale(wmin: torch.Tensor, wmax: torch.Tensor, qmin: int, scale_dtype: torch.dtype) -> torch.Tensor:
    """The symmetric grid's signed scale: e / qmin, e the larger-magnitude of (min, max) with its sign (min on a
    tie), so e lands exactly on qmin (-8 at 4 bits) and all 2^bits codes are spaced absmax / 2^(bits-1); the
    scale is negative where the max is the larger. The other end clips by at most one step. Magnitudes are kept
    >= 1e-10 like the unsigned rules, and rounded to the storage dtype (rounding is symmetric in the sign)."""
    lo, hi = wmin.clamp(max=0), wmax.clamp(min=0)
    scale = torch.where(-lo >= hi, lo, hi) / qmin
    magnitude = scale.abs().clamp(min=1e-10)
    return torch.where(scale < 0, -magnitude, magnitude).to(scale_dtype).float()


def compute_qparams(w: torch.Tensor, spec: WeightSpec, scale_dtype: torch.dtype = torch.bfloat16,
                    clip_search: bool = False, global_scale: torch.Tensor | None = None,
                    search: ScaleSearch | None = None) -> QParams:
    """Scales for a [out, in] weight. `search`: the MSE scale search (ScaleSearch); `clip_search`: its small
    default grid (1.0 .. 0.75 by 0.05) on the plain weight error. NVFP4's global scale comes from `w` unless
    given (GPTQ's group act-order passes the whole weight's)."""
    out_f, in_f = w.shape
    g = group_size_for(spec, in_f)
    wg = w.float().reshape(out_f, in_f // g, g)  # [out, n_groups, g]
    wmin, wmax = wg.amin(dim=-1), wg.amax(dim=-1)  # [out, n_groups]
    if spec.scale_format == "fp8" and global_scale is None:
        global_scale = nvfp4_global_scale(w)
    full = search.full_range if search is not None and spec.type == "int" else False
    scale, zp = _minmax_qparams(wmin, wmax, spec, scale_dtype, global_scale, full)
    if search is None and clip_search:
        search = ScaleSearch((1.0, 0.95, 0.9, 0.85, 0.8, 0.75))
    if search is not None and any(r != 1.0 for r in search.ratios):
        cw = None if search.column_weight is None else search.column_weight.float().reshape(1, in_f // g, g)
        best_err = _group_error(wg, scale, zp, spec, cw)
        for ratio in search.ratios:
            if ratio == 1.0:
                continue
            s2, z2 = _minmax_qparams(wmin * ratio, wmax * ratio, spec, scale_dtype, global_scale, full)
            err = _group_error(wg, s2, z2, spec, cw)
            better = err < best_err
            scale = torch.where(better, s2, scale)
            if zp is not None:
                zp = torch.where(better, z2, zp)
            best_err = torch.where(better, err, best_err)
    return QParams(scale, zp, g, global_scale if spec.scale_format == "fp8" else None)


def _group_error(wg: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor | None, spec: WeightSpec,
                 column_weight: torch.Tensor | None = None) -> torch.Tensor:
    s = scale.unsqueeze(-1)  # [out, n_groups, 1]
    z = zp.unsqueeze(-1) if zp is not None else None
    err = (dequantize_codes(quantize_codes(wg, s, z, spec), s, z, spec) - wg).pow(2)  # [out, n_groups, g]
    return (err if column_weight is None else err * column_weight).sum(-1)  # [out, n_groups]


def quantize_codes(w: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor | None, spec: WeightSpec) -> torch.Tensor:
    """Codes (as fp32 values) for `w` with broadcastable scale/zero point."""
    if spec.is_fp4:
        return fp4_round(w / scale)
    if spec.type == "float":
        return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    q = (w / scale).round_()  # a new tensor of the broadcast shape, updated in place from here on
    if zp is not None:
        q.add_(zp)
    return q.clamp_(spec.qmin, spec.qmax)


def dequantize_codes(q: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor | None, spec: WeightSpec) -> torch.Tensor:
    if zp is not None:
        q = q - zp
    return q * scale


def expand(qp: QParams, in_features: int, g_idx: torch.Tensor | None = None):
    """Per-column scale/zero point, [out, in], following `g_idx` (column -> group) when given."""
    if g_idx is None:
        g_idx = torch.arange(in_features, device=qp.scale.device) // qp.group_size
    s = qp.scale[:, g_idx]
    z = qp.zero_point[:, g_idx] if qp.zero_point is not None else None
    return s, z


def fake_quantize(w: torch.Tensor, qp: QParams, spec: WeightSpec, g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """Quantize then dequantize a [out, in] weight (fp32 result). Groups in column order broadcast their scale
    over a [out, groups, size] view (no [out, in] copy of the scales), and the codes become the result in
    place: the same operations on the same values as `expand` + quantize_codes + dequantize_codes."""
    if g_idx is not None:
        s, z = expand(qp, w.shape[1], g_idx)
        return dequantize_codes(quantize_codes(w.float(), s, z, spec), s, z, spec)
    out_f, in_f = w.shape
    shape = (out_f, in_f // qp.group_size, 1)
    s = qp.scale.reshape(shape)
    z = qp.zero_point.reshape(shape) if qp.zero_point is not None else None
    q = quantize_codes(w.float().reshape(out_f, shape[1], qp.group_size), s, z, spec)
    if z is not None:
        q.sub_(z)
    return q.mul_(s).reshape(out_f, in_f)


def rtn(w: torch.Tensor, spec: WeightSpec, scale_dtype: torch.dtype = torch.bfloat16,
        clip_search: bool = False, search: ScaleSearch | None = None) -> tuple[torch.Tensor, QParams]:
    qp = compute_qparams(w, spec, scale_dtype, clip_search, search=search)
    return fake_quantize(w, qp, spec), qp


def fake_quantize_activations(x: torch.Tensor, spec: ActivationSpec) -> torch.Tensor:
    """Dynamic per-token symmetric quantize-dequantize of activations [..., features]."""
    xf = x.float()
    absmax = xf.abs().amax(dim=-1, keepdim=True)
    if spec.type == "float":
        scale = (absmax / FP8_MAX).clamp(min=1e-12)
        q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    else:
        qmax = 2 ** (spec.num_bits - 1) - 1
        scale = (absmax / qmax).clamp(min=1e-10)
        q = torch.round(xf / scale).clamp(-qmax - 1, qmax)
    return (q * scale).to(x.dtype)


def activation_pre_hook(spec: ActivationSpec):
    """A forward pre-hook that quantizes a Linear's input as the engine does at run time (dynamic per token)."""
    return lambda _m, args: (fake_quantize_activations(args[0], spec),) + tuple(args[1:])


SQNR_SLAB = 2048  # rows of H per product in hessian_energy


def rows_per_block(width: int) -> int:
    """Rows of a [rows, width] tensor per block when it is worked through a block at a time: about 4M
    elements (16 MB of fp32), so the block's temporaries stay small whatever the tensor's size."""
    return max(1, (1 << 22) // max(width, 1))


def output_sqnr_db(w: torch.Tensor, deq: torch.Tensor, H: torch.Tensor, dtype: torch.dtype = torch.float32) -> float:
    """SQNR of a Linear's output over every calibration token, from the Hessian H ~ X^T X alone.

    |X W^T|^2 = sum_r w_r^T (X^T X) w_r, and likewise for the error W - Q, so with H already accumulated
    this costs out x in^2 instead of tokens x in x out (and H's scale cancels in the ratio). As many flops as
    a GPTQ solve: `dtype` bfloat16 runs the two products in bf16 (sums in fp32) where it is native, ~6x the
    fp32 rate on AMX, for a figure within a few hundredths of a dB (tests/test_quant_math.py).
    """
    return energy_ratio_db(hessian_energy(w, H, dtype), hessian_energy(w, H, dtype, minus=deq))


def energy_ratio_db(signal: float, noise: float) -> float:
    """10 log10(signal / noise); inf for no noise."""
    return float("inf") if noise <= 0 else 10 * math.log10(signal / noise)


def hessian_energy(x: torch.Tensor, H: torch.Tensor, dtype: torch.dtype = torch.float32,
                   minus: torch.Tensor | None = None) -> float:
    """tr(v H v^T) for v = x (or x - minus), [out, in]: with H ~ X^T X, the squared output of a Linear with weight
    v over the tokens H came from. The products run in `dtype` (their sums in fp32, the total in fp64), H read
    a slab of SQNR_SLAB rows at a time (symmetric: a slab of rows is a slab of columns), so besides v in
    `dtype` the work memory is [out, slab] products, never a copy of H (for Llama-3.1-8B's down_proj: 411 MB
    of bf16 H and ~1 GB of fp32/fp64 temporaries less than the whole products)."""
    out_f, in_f = x.shape
    same = minus is None and x.dtype == dtype and x.is_contiguous()
    vc = x if same else torch.empty(out_f, in_f, dtype=dtype, device=x.device)
    step = rows_per_block(in_f)
    if not same:
        for r in range(0, out_f, step):
            vc[r:r + step] = x[r:r + step].float() - (minus[r:r + step].float() if minus is not None else 0.0)
    total = torch.zeros((), dtype=torch.float64, device=x.device)
    for c in range(0, in_f, SQNR_SLAB):
        Hs = H[c:c + SQNR_SLAB].to(dtype)  # [slab, in] = H[:, slab]^T
        v = x[:, c:c + SQNR_SLAB].float() - (minus[:, c:c + SQNR_SLAB].float() if minus is not None else 0.0)
        total += ((vc @ Hs.t()).float() * v).sum(1).double().sum()  # fp32 within a row's slab, fp64 across
        del Hs, v
        give_back_free_memory()  # (a large group's: quantkit.io.giving_back_freed_memory)
    return float(total)


def sqnr_db(ref: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: 10 log10(|ref|^2 / |ref - approx|^2). A block of rows (about
    4M elements) at a time: each row's norm in the inputs' precision (fp32, or fp64 if either is), summed
    across rows in float64; no float64 copy of the tensor. Within ~1e-5 dB of an all-float64 sum, and 3x faster
    than norms accumulated in float64 element by element (0.09 vs 0.30 s for an 8B MLP weight: the model-free
    path's per-weight diagnostic, benchmarks/modelfree.py)."""
    signal = noise = 0.0
    rows = ref.reshape(ref.shape[0], -1) if ref.dim() > 1 else ref.reshape(1, -1)
    other = approx.reshape(rows.shape)
    step = rows_per_block(rows.shape[1])
    wide = torch.float64 if torch.float64 in (rows.dtype, other.dtype) else torch.float32
    for i in range(0, rows.shape[0], step):
        r = rows[i:i + step].to(wide)
        d = other[i:i + step].to(wide) - r
        signal += float(torch.linalg.vector_norm(r, dim=1).double().pow(2).sum())
        noise += float(torch.linalg.vector_norm(d, dim=1).double().pow(2).sum())
    if noise == 0:
        return float("inf")
    return float(10 * math.log10(signal / noise)) if signal > 0 else float("-inf")


# ------------------------------------------------------------------------------ the method contract
class RTNStage(QuantizerStage, ScaleSearchOptions):
    """Round-to-nearest: min-max (or MSE-searched) scales, no calibration data needed."""

    method: Literal["rtn"]


def quantize(weights: list[torch.Tensor], obs: Observations, spec: WeightSpec, stage: RTNStage,
             scale_dtype: torch.dtype) -> list[QuantizedWeight]:
    """Each [out, in] weight on its own; the observations are not needed (RTN uses no data)."""
    search = stage.scale_search() if isinstance(stage, ScaleSearchOptions) else None  # QAT's start: min/max
    out = []
    for w in weights:
        deq, qp = rtn(w.float(), spec, scale_dtype, search=search)
        out.append(QuantizedWeight(deq, qp.scale, qp.zero_point, global_scale=qp.global_scale))
    return out
