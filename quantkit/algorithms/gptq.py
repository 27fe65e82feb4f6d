"""GPTQ (Frantar et al. 2022): quantize a weight column by column, pushing each column's rounding
error onto the columns not yet quantized, weighted by the inverse Hessian of the layer loss.

The layer loss is ||X W^T - X Q^T||^2 over calibration inputs X, whose Hessian is H = 2/n X^T X. With
the upper Cholesky factor U of H^-1, quantizing column i and updating the rest by
`W[:, i:] -= (w_i - q_i) / U_ii * U[i, i:]` is the optimal-brain-surgeon update; doing it in blocks of
`block_size` columns with one matrix product per block ("lazy batch updates") keeps it fast.

- Dampening: `dampening_frac x mean(diag H)` is added to the diagonal; if the Cholesky factorisation
  still fails the damping is multiplied by 10 (up to 6 times) and the value used is returned.
- Columns whose input is always zero (diag H == 0) are set to zero and given H_ii = 1.
- Activation order: "none" keeps column order; "static" quantizes columns in order of decreasing
  H_ii but takes every group's scale from the original weight first, so the export needs no g_idx
  (vLLM's fast path); "group" also permutes but fixes each group's scale when its first permuted
  column is reached, which needs `g_idx` in the export.
- Several weights that read the same input (q/k/v, gate/up) share H and are stacked along rows: GPTQ
  treats rows independently, so this is exact and saves the per-column Python loop.
- All math in fp32 (the Hessian, its inverse and the updates); scales are rounded to their storage
  dtype before any code is chosen, as in RTN.

Left out: sparsity (SparseGPT), per-row adaptive group sizes, and Hessians in reduced precision.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from typing import Literal

from pydantic import Field

from quantkit.algorithms.rtn import QParams, compute_qparams, dequantize_codes, group_size_for, quantize_codes
from quantkit.quantize.contract import Observations, QuantizedWeight
from quantkit.schemes import WeightSpec
from quantkit.stages import QuantizerStage


SYRK_MAX_BYTES = 2 ** 31  # the largest Hessian buffer the CPU's triangle-only (ssyrk) update is used for


class HessianAccumulator:
    """Running H = 2/n sum x x^T over calibration tokens, in fp32.

    H is symmetric, so on the CPU only one triangle is accumulated, with BLAS `ssyrk` (scipy): half the
    flops of `X^T X`, which for a 1536-wide input is as much work as the layer's forward. Elsewhere (CUDA)
    a plain `addmm` is used. Read `H` for the full symmetric matrix.
    """

    def __init__(self, in_features: int, device: torch.device | str = "cpu"):
        self._acc = torch.zeros(in_features, in_features, dtype=torch.float32, device=device)
        # scipy's OpenBLAS ssyrk segfaults on a buffer over 2 GiB (measured: in_features 28672, Llama-70B's
        # down_proj; 18944 works): there, the full product with addmm (twice the flops, no crash)
        self._triangle = self._acc.device.type == "cpu" and self._acc.numel() * 4 < SYRK_MAX_BYTES
        self.n = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()  # [tokens, in]
        n_new = x.shape[0]
        if n_new == 0:
            return
        beta = self.n / (self.n + n_new)
        self.n += n_new
        alpha = 2.0 / self.n
        if not self._triangle:
            self._acc.mul_(beta).addmm_(x.t(), x, alpha=alpha)  # [in, in]
            return
        # row-major [tokens, in] is column-major [in, tokens] = A; syrk: C = alpha A A^T + beta C, upper
        # triangle of C. C is the transposed (column-major) view of our row-major buffer, so the buffer's
        # lower triangle is filled.
        import numpy as np
        from scipy.linalg.blas import ssyrk

        a = x.contiguous().numpy().T  # [in, tokens], column-major
        c = self._acc.numpy().T  # [in, in], column-major view of the buffer
        out = ssyrk(alpha, a, beta=beta, c=c, trans=0, lower=0, overwrite_c=1)
        if not np.shares_memory(out, c):  # f2py made a copy after all
            c[...] = out

    @property
    def H(self) -> torch.Tensor:
        """The full symmetric matrix, made in place from the accumulated lower triangle (the upper one holds
        zeros until then), so it never needs more than one extra [in, in] temporary."""
        if self._triangle:
            self._acc.add_(torch.tril(self._acc, -1).t())  # upper (zeros) += lower^T; lower and diagonal += 0
            self._triangle = False  # symmetric from here on
        return self._acc


@dataclass
class GPTQResult:
    weight: torch.Tensor  # [out, in] fp32 dequantized
    qparams: QParams
    g_idx: torch.Tensor | None  # [in] int32 column -> group, only for actorder "group"
    loss: torch.Tensor  # [out] per-row GPTQ objective sum (w - q)^2 / U_ii^2 / 2
    damping: float  # the absolute dampening finally added to diag(H)


def _inverse_cholesky(H: torch.Tensor, frac: float, max_tries: int = 6) -> tuple[torch.Tensor, float]:
    damp = frac * torch.mean(torch.diag(H)).item()
    for _ in range(max_tries + 1):
        A = H.clone()
        A.diagonal().add_(damp)  # H + damp * I, without an [in, in] identity
        L, info = torch.linalg.cholesky_ex(A)
        del A
        if info.item() == 0:
            Hinv = torch.cholesky_inverse(L)
            del L
            U, info2 = torch.linalg.cholesky_ex(Hinv, upper=True)
            del Hinv
            if info2.item() == 0 and torch.isfinite(U).all():
                return U, damp
        damp *= 10.0
    raise FloatingPointError(f"Cholesky factorisation failed even with dampening {damp:.3g}; the calibration "
                             "inputs of this layer are degenerate (too few tokens?)")


def gptq_quantize(W: torch.Tensor, H: torch.Tensor, spec: WeightSpec, block_size: int = 128,
                  dampening_frac: float = 0.01, actorder: str = "static",
                  scale_dtype: torch.dtype = torch.bfloat16) -> GPTQResult:
    if W.device.type != "cpu":
        return _gptq(W, H, spec, block_size, dampening_frac, actorder, scale_dtype)
    # On the CPU everything here is either a small factorisation or thousands of tiny vector ops, where
    # OpenMP synchronisation costs more than a second thread gives (measured: 20x slower on a loaded
    # 2-core machine with 2 threads).
    with single_thread():
        return _gptq(W, H, spec, block_size, dampening_frac, actorder, scale_dtype)


def _gptq(W, H, spec, block_size, dampening_frac, actorder, scale_dtype) -> GPTQResult:
    W = W.detach().float().clone()  # [out, in]
    H = H.detach().float()  # [in, in]; the caller's: copied (permuted) before anything writes to it
    out_f, in_f = W.shape
    g = group_size_for(spec, in_f)

    diag = torch.diag(H).clone()
    dead = diag == 0
    diag[dead] = 1.0
    W[:, dead] = 0.0

    # static groups (and none): scales from the original weight, fixed up front
    qp_static = compute_qparams(W, spec, scale_dtype) if actorder != "group" else None

    perm = None
    if actorder in ("static", "group"):
        perm = torch.argsort(diag, descending=True)
        W = W[:, perm]
        H = H.index_select(0, perm).index_select(1, perm)  # one [in, in] copy at a time
        dead = dead[perm]
    else:
        H = H.clone()
    H[dead, dead] = 1.0

    U, damp = _inverse_cholesky(H, dampening_frac)
    del H

    Q = torch.zeros_like(W)
    losses = torch.zeros(out_f, dtype=torch.float32, device=W.device)
    n_groups = in_f // g
    scale_cols = torch.empty(out_f, in_f, device=W.device)  # per permuted column
    zp_cols = torch.empty(out_f, in_f, device=W.device) if not spec.symmetric and spec.type == "int" else None
    if qp_static is not None:
        col_group = (perm if perm is not None else torch.arange(in_f, device=W.device)) // g
        scale_cols.copy_(qp_static.scale[:, col_group])
        if zp_cols is not None:
            zp_cols.copy_(qp_static.zero_point[:, col_group])
    group_scale = torch.empty(out_f, n_groups, device=W.device)
    group_zp = torch.empty(out_f, n_groups, device=W.device) if zp_cols is not None else None

    _column_loop(W, U, Q, losses, scale_cols, zp_cols, group_scale, group_zp, qp_static, spec, g,
                 block_size, scale_dtype)

    g_idx = None
    if perm is not None:
        inv = torch.argsort(perm)
        Q = Q[:, inv]
    if qp_static is not None:
        qparams = qp_static
    else:
        qparams = QParams(group_scale, group_zp, g)
        g_idx = (inv // g).to(torch.int32)  # original column -> group
    return GPTQResult(Q, qparams, g_idx, losses, damp)


def _column_loop(W, U, Q, losses, scale_cols, zp_cols, group_scale, group_zp, qp_static, spec, g, block_size,
                 scale_dtype) -> None:
    """The GPTQ sweep over (permuted) columns, in blocks of `block_size`; updates W, Q, losses in place.

    Inside a block the weights are held transposed ([b, out]) so that every column the sweep touches
    is one contiguous row: about 2x faster on the CPU than strided column access.
    """
    in_f = W.shape[1]
    for i1 in range(0, in_f, block_size):
        i2 = min(i1 + block_size, in_f)
        W1 = W[:, i1:i2].t().contiguous()  # [b, out]
        Q1 = torch.empty_like(W1)  # [b, out]
        E1 = torch.empty_like(W1)  # [b, out]
        U1 = U[i1:i2, i1:i2]  # [b, b]
        S1 = scale_cols[:, i1:i2].t().contiguous()  # [b, out]
        Z1 = zp_cols[:, i1:i2].t().contiguous() if zp_cols is not None else None
        for i in range(i2 - i1):
            col = i1 + i
            if qp_static is None and col % g == 0:
                # group actorder: this group's scale from its (already updated) permuted columns
                block = torch.cat([W1[i:].t(), W[:, i2:col + g]], dim=1)[:, :g]  # [out, g]
                qp = compute_qparams(block, _as_channel(spec), scale_dtype)
                n_in_block = min(g, i2 - col)
                S1[i:i + n_in_block] = qp.scale[:, 0]
                scale_cols[:, col:col + g] = qp.scale
                group_scale[:, col // g] = qp.scale[:, 0]
                if zp_cols is not None:
                    Z1[i:i + n_in_block] = qp.zero_point[:, 0]
                    zp_cols[:, col:col + g] = qp.zero_point
                    group_zp[:, col // g] = qp.zero_point[:, 0]
            w, q, err = W1[i], Q1[i], E1[i]  # [out] each; q and err are written in place
            _fake_quantize_into(q, w, S1[i], Z1[i] if Z1 is not None else None, spec)
            torch.sub(w, q, out=err).div_(U1[i, i])
            W1[i + 1:].addr_(U1[i, i + 1:], err, alpha=-1)  # [b - i - 1, out] -= U1[i, i+1:] (x) err
        Q[:, i1:i2] = Q1.t()
        losses += E1.pow(2).sum(0) / 2
        W[:, i2:] -= E1.t() @ U[i1:i2, i2:]  # [out, b] @ [b, in - i2]


def _fake_quantize_into(q: torch.Tensor, w: torch.Tensor, s: torch.Tensor, z: torch.Tensor | None,
                        spec: WeightSpec) -> None:
    """q = dequantize(quantize(w)), the same operations as `quantize_codes`/`dequantize_codes` but in place.

    The sweep calls this once per column, so it avoids allocating: about 1.5x faster on the CPU.
    """
    if spec.type == "float":
        q.copy_(dequantize_codes(quantize_codes(w, s, z, spec), s, z, spec))
        return
    torch.div(w, s, out=q).round_()
    if z is not None:
        q.add_(z)
    q.clamp_(spec.qmin, spec.qmax)
    if z is not None:
        q.sub_(z)
    q.mul_(s)


@contextmanager
def single_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _as_channel(spec: WeightSpec) -> WeightSpec:
    from dataclasses import replace

    return replace(spec, strategy="channel", group_size=None)


# ------------------------------------------------------------------------------ the method contract
class GPTQStage(QuantizerStage):
    """GPTQ (Frantar et al. 2022): second-order rounding from calibration Hessians."""

    method: Literal["gptq"]
    block_size: int = Field(128, ge=1)
    dampening_frac: float = Field(0.01, gt=0, lt=1)
    actorder: Literal["none", "static", "group"] = "static"

    @property
    def needs_calibration(self) -> bool:
        return True


def quantize(weights: list[torch.Tensor], obs: Observations, spec: WeightSpec, stage: GPTQStage,
             scale_dtype: torch.dtype) -> list[QuantizedWeight]:
    """The group's weights share an input, so they are stacked along rows into one sweep (exact: GPTQ
    treats rows independently given H), then split back per module."""
    W = torch.cat(weights, dim=0)  # [sum(out), in]
    res = gptq_quantize(W, obs.hessian, spec, block_size=stage.block_size, dampening_frac=stage.dampening_frac,
                        actorder=stage.actorder, scale_dtype=scale_dtype)
    out, row = [], 0
    for w in weights:
        r = slice(row, row + w.shape[0])
        row += w.shape[0]
        zp = res.qparams.zero_point[r] if res.qparams.zero_point is not None else None
        out.append(QuantizedWeight(res.weight[r], res.qparams.scale[r], zp, res.g_idx,
                                   {"gptq_loss": float(res.loss[r].sum()), "damping": res.damping}))
    return out
