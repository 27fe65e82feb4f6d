"""Folding per-channel smoothing scales into a layer without changing what it computes. Pure tensor math.

A smoothing mapping is (preceding op P, Linears T1..Tk that read P's output). For a positive scale s
per P output channel, dividing P's output channel j by s_j and multiplying column j of every Ti by
s_j leaves each Ti's output unchanged in exact arithmetic:  Ti(P(x) / s) with Wi·diag(s) = Ti(P(x)).
P may be
  - an RMSNorm: weight w (or, for Gemma, the applied factor 1 + w) divided by s;
  - a Linear whose output feeds the targets through an op that is linear per channel:
    v_proj -> attention -> o_proj (softmax(qk) mixes tokens, never channels), and
    up_proj -> act(gate) * up -> down_proj. Its weight rows (and bias) are divided by s.
With grouped-query attention o_proj has more input columns than v_proj has outputs: o column
h*head_dim + d reads v channel (h // groups)*head_dim + d, so a scale per v channel is replicated to the
query heads that share it (`channel_index`).

The folded norm weight is stored in the checkpoint's dtype (bf16): rounding it would change the float
model by up to 2^-9 per channel, so the columns are scaled by the *effective* scale the rounded weight
realises (old / new), which keeps the float output unchanged to fp32 precision.

AWQ and SmoothQuant differ only in how they choose s; both measure the block error with
`block_error`: the targets' outputs with fake-quantized (RTN) transformed weights and, for W8A8/FP8,
per-token fake-quantized transformed inputs, against the float outputs.
"""

from __future__ import annotations

import torch

from quantkit.algorithms.rtn import fake_quantize_activations, rtn
from quantkit.schemes import ActivationSpec, WeightSpec


def channel_index(prev_channels: int, target_in: int, head_dim: int | None) -> torch.Tensor | None:
    """Target input column -> preceding op output channel, or None when the shapes cannot be matched."""
    if prev_channels == target_in:
        return torch.arange(target_in)
    if head_dim and target_in % prev_channels == 0 and prev_channels % head_dim == 0:
        groups = target_in // prev_channels  # query heads per kv head
        col = torch.arange(target_in)
        head, d = col // head_dim, col % head_dim  # o column = head * head_dim + d
        return (head // groups) * head_dim + d
    return None


def reduce_to_channels(v: torch.Tensor, idx: torch.Tensor, channels: int, how: str) -> torch.Tensor:
    """Per-target-column statistic [in] -> per preceding channel [channels] (mean or amax over its copies)."""
    if idx.numel() == channels and torch.equal(idx, torch.arange(channels, device=idx.device)):
        return v
    idx = idx.to(v.device)
    if how == "max":
        return torch.zeros(channels, dtype=v.dtype, device=v.device).scatter_reduce(0, idx, v, "amax",
                                                                                  include_self=False)
    total = torch.zeros(channels, dtype=v.dtype, device=v.device).index_add_(0, idx, v)
    count = torch.zeros(channels, dtype=v.dtype, device=v.device).index_add_(0, idx, torch.ones_like(v))
    return total / count.clamp(min=1)


def normalize_scales(s: torch.Tensor, lo: float = 1e-4, hi: float = 1e4) -> torch.Tensor:
    """Centre the scales geometrically (max * min = 1) and keep them in a safe range."""
    s = s.float().clamp(min=lo)
    s = s / (s.max() * s.min()).sqrt()
    return s.clamp(lo, hi)


def fold_into_norm(weight: torch.Tensor, s: torch.Tensor, offset: float,
                   storage_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """New norm weight (fp32 holding a `storage_dtype` value) and the effective scale it realises.

    The norm multiplies by (offset + weight): offset 0 for Llama-style RMSNorm, 1 for Gemma.
    """
    base = weight.float() + offset  # [channels]: the factor the norm applies
    new = ((base / s) - offset).to(storage_dtype).float()
    new_base = new + offset
    ok = (new_base != 0) & (base != 0)
    s_eff = torch.where(ok, base / torch.where(ok, new_base, torch.ones_like(new_base)), s)
    return new, s_eff


def fold_into_linear_rows(weight: torch.Tensor, bias: torch.Tensor | None,
                          s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Divide a preceding Linear's output rows (weight [out, in], bias [out]) by s [out]."""
    w = weight.float() / s[:, None]
    b = bias.float() / s if bias is not None else None
    return w, b


def scale_columns(weight: torch.Tensor, s_cols: torch.Tensor) -> torch.Tensor:
    """Multiply a following Linear's input columns (weight [out, in]) by s_cols [in]."""
    return weight.float() * s_cols[None, :]


def block_error(x: torch.Tensor, weights: list[torch.Tensor], specs: list[WeightSpec],
                acts: list[ActivationSpec | None], s_cols: torch.Tensor | None,
                scale_dtype: torch.dtype = torch.bfloat16, refs: list[torch.Tensor] | None = None) -> float:
    """Mean squared output error of the targets quantized after scaling by s_cols (None = unscaled).

    x [tokens, in] is the float input the targets see; weights are their float weights [out_i, in];
    refs, when given, their float outputs x @ w.T (computed once for a whole search).
    """
    err = 0.0
    n_out = 0
    for i, (w, spec, act) in enumerate(zip(weights, specs, acts)):
        w = w.float()
        ref = refs[i] if refs is not None else x @ w.t()  # [tokens, out]
        ws = w if s_cols is None else scale_columns(w, s_cols)
        xs = x if s_cols is None else x / s_cols[None, :]
        if act is not None:
            xs = fake_quantize_activations(xs, act)
        wq, _ = rtn(ws, spec, scale_dtype)
        err += float((ref - xs @ wq.t()).pow(2).sum())
        n_out += w.shape[0]
    return err / max(1, x.shape[0] * n_out)
