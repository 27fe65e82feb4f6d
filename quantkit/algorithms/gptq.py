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
- Several weights that read the same input (q/k/v, gate/up) share H: it is factored once and each
  weight gets its own sweep (GPTQ treats rows independently), so a weight's result does not depend on
  which others are solved with it, and processes can split a group between them.
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

from quantkit.algorithms.rtn import (QParams, compute_qparams, dequantize_codes, group_size_for, nvfp4_global_scale,
                                    quantize_codes)
from quantkit.algorithms.contract import Observations, QuantizedWeight, ScaleSearch
from quantkit.schemes import WeightSpec
from quantkit.algorithms.base import QuantizerStage, ScaleSearchOptions


SYRK_MAX_BYTES = 2 ** 31  # the largest Hessian buffer the CPU's triangle-only (ssyrk) update is used for


class HessianAccumulator:
    """H = 2/n sum x x^T over calibration tokens, in fp32, folded chunk by chunk: each chunk's product
    X^T X is computed on its own (`partial`) and added to the sum (`fold`), so the sum is the same,
    bit for bit, whether the chunks' products are made here or by other processes
    (quantkit/distributed.py) as long as they are folded in the same order.

    H is symmetric, so on the CPU only one triangle is computed, with BLAS `ssyrk` (scipy): half the flops
    of `X^T X`, which for a 1536-wide input is as much work as the layer's forward. Elsewhere (CUDA) a
    plain `mm` is used. Read `H` for the full symmetric matrix.
    """

    def __init__(self, in_features: int, device: torch.device | str = "cpu"):
        self._acc = torch.zeros(in_features, in_features, dtype=torch.float32, device=device)
        self._part: torch.Tensor | None = None  # one chunk's product, reused
        # scipy's OpenBLAS ssyrk segfaults on a buffer over 2 GiB (measured: in_features 28672, Llama-70B's
        # down_proj; 18944 works): there, the full product (twice the flops, no crash)
        self._triangle = self._acc.device.type == "cpu" and self._acc.numel() * 4 < SYRK_MAX_BYTES
        self.n = 0
        self._final = False  # H has been made (symmetric and scaled); nothing may be added after

    def add(self, x: torch.Tensor) -> None:
        self.fold(*self.partial(x))

    def partial(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        """(X^T X of one chunk, its token count); the product's buffer is reused by the next call."""
        x = x.reshape(-1, x.shape[-1]).float()  # [tokens, in]
        if self._part is None:
            self._part = torch.zeros_like(self._acc)  # zeros: the triangle path never writes the upper half
        if x.shape[0] == 0:
            self._part.zero_()
            return self._part, 0
        if not self._triangle:
            torch.mm(x.t(), x, out=self._part)  # [in, in]
            return self._part, x.shape[0]
        # row-major [tokens, in] is column-major [in, tokens] = A; syrk: C = A A^T, upper triangle of C.
        # C is the transposed (column-major) view of our row-major buffer, so the buffer's lower triangle
        # is filled and its upper one stays zero.
        import numpy as np
        from scipy.linalg.blas import ssyrk

        a = x.contiguous().numpy().T  # [in, tokens], column-major
        c = self._part.numpy().T  # [in, in], column-major view of the buffer
        out = ssyrk(1.0, a, beta=0.0, c=c, trans=0, lower=0, overwrite_c=1)
        if not np.shares_memory(out, c):  # f2py made a copy after all
            c[...] = out
        return self._part, x.shape[0]

    def fold(self, part: torch.Tensor, tokens: int) -> None:
        """Add one chunk's product (from `partial`, here or on another rank) to the sum."""
        if self._final:
            raise RuntimeError("HessianAccumulator: a chunk was added after H was read")
        self._acc.add_(part)
        self.n += tokens

    @property
    def H(self) -> torch.Tensor:
        """The full symmetric 2/n X^T X, made in place from the accumulated lower triangle (the upper one
        holds zeros until then), so it never needs more than one extra [in, in] temporary."""
        if not self._final:  # first read: finish the sum once
            self._final, self._part = True, None
            if self._triangle:
                self._acc.add_(torch.tril(self._acc, -1).t())  # upper (zeros) += lower^T; the rest += 0
            self._acc.mul_(2.0 / max(self.n, 1))
        return self._acc


@dataclass
class GPTQResult:
    weight: torch.Tensor  # [out, in] fp32 dequantized
    qparams: QParams
    g_idx: torch.Tensor | None  # [in] int32 column -> group, only for actorder "group"
    loss: torch.Tensor  # [out] per-row GPTQ objective sum (w - q)^2 / U_ii^2 / 2
    damping: float  # the absolute dampening finally added to diag(H)
    rounded: torch.Tensor | None = None  # [out, in] each column as it was when rounded (error-compensated)


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


@dataclass
class Factor:
    """What GPTQ derives from a Hessian alone, shared by every weight that reads the same input."""

    U: torch.Tensor  # [in, in] upper Cholesky factor of (H + damp)^-1, in the (permuted) column order
    perm: torch.Tensor | None  # [in] the activation order (None: columns in order)
    dead: torch.Tensor  # [in] bool, columns whose input is always zero (original order)
    damping: float
    diag: torch.Tensor | None = None  # [in] diag(H) in the original order (the MSE scale search's column weights)


def gptq_quantize(W: torch.Tensor, H: torch.Tensor, spec: WeightSpec, block_size: int = 128,
                  dampening_frac: float = 0.01, actorder: str = "static",
                  scale_dtype: torch.dtype = torch.bfloat16, search: ScaleSearch | None = None) -> GPTQResult:
    """GPTQ of one weight [out, in] given its input's Hessian [in, in]."""
    with _threads(W.device):
        return gptq_solve(W, gptq_factor(H, dampening_frac, actorder), spec, block_size, actorder, scale_dtype,
                          search)


@contextmanager
def _threads(device: torch.device):
    # On the CPU everything here is either a small factorisation or thousands of tiny vector ops, where
    # OpenMP synchronisation costs more than a second thread gives (measured: 20x slower on a loaded
    # 2-core machine with 2 threads). One thread also makes the result independent of the thread count.
    if device.type != "cpu":
        yield
        return
    with single_thread():
        yield


def gptq_factor(H: torch.Tensor, dampening_frac: float = 0.01, actorder: str = "static") -> Factor:
    """Dead columns, activation order and the inverse-Hessian Cholesky factor, from H alone (H is not
    modified)."""
    H = H.detach().float()  # [in, in]; the caller's: copied (permuted) before anything writes to it
    diag = torch.diag(H).clone()
    dead = diag == 0
    diag[dead] = 1.0
    perm = None
    if actorder in ("static", "group"):
        perm = torch.argsort(diag, descending=True)
        H = H.index_select(0, perm).index_select(1, perm)  # one [in, in] copy at a time
        dead_p = dead[perm]
    else:
        H = H.clone()
        dead_p = dead
    H[dead_p, dead_p] = 1.0
    U, damp = _inverse_cholesky(H, dampening_frac)
    del H
    return Factor(U, perm, dead, damp, diag)


def gptq_solve(W: torch.Tensor, f: Factor, spec: WeightSpec, block_size: int = 128, actorder: str = "static",
               scale_dtype: torch.dtype = torch.bfloat16, search: ScaleSearch | None = None) -> GPTQResult:
    """The column sweep of one weight [out, in] with a shared factor. Rows are independent, so the result
    for a weight does not depend on which other weights share the factor. `search`: the MSE scale search,
    its errors weighted by diag(H) (the factor's) unless it brings its own column weights."""
    W = W.detach().float().clone()  # [out, in]
    out_f, in_f = W.shape
    g = group_size_for(spec, in_f)
    W[:, f.dead] = 0.0

    # NVFP4's per-tensor global scale: from the whole original weight, also when groups are chosen on the way
    gscale = nvfp4_global_scale(W) if spec.scale_format == "fp8" else None
    # static groups (and none): scales from the original weight, fixed up front
    if search is not None and search.column_weight is None and f.diag is not None:
        search = ScaleSearch(search.ratios, f.diag)
    qp_static = (compute_qparams(W, spec, scale_dtype, global_scale=gscale, search=search)
                 if actorder != "group" else None)
    perm = f.perm
    if perm is not None:
        W = W[:, perm]
    U = f.U

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

    if search is not None and search.column_weight is not None and perm is not None:
        search = ScaleSearch(search.ratios, search.column_weight[perm])  # group act-order works in permuted order
    _column_loop(_Sweep(W, U, Q, losses, scale_cols, zp_cols, group_scale, group_zp, qp_static, spec, g, scale_dtype,
                        gscale, search), block_size)

    g_idx = None
    if perm is not None:
        inv = torch.argsort(perm)
        Q, W = Q[:, inv], W[:, inv]
    if qp_static is not None:
        qparams = qp_static
    else:
        qparams = QParams(group_scale, group_zp, g, gscale)
        g_idx = (inv // g).to(torch.int32)  # original column -> group
    return GPTQResult(Q, qparams, g_idx, losses, f.damping, W)


@dataclass
class _Sweep:
    """One GPTQ column sweep over (permuted) columns: the tensors it updates in place and what it quantizes to."""

    W: torch.Tensor  # [out, in] the weight, updated as the error of each quantized column is spread
    U: torch.Tensor  # [in, in] the upper Cholesky factor of the inverse Hessian
    Q: torch.Tensor  # [out, in] the dequantized result
    losses: torch.Tensor  # [out]
    scale_cols: torch.Tensor  # [out, in] the scale of each column
    zp_cols: torch.Tensor | None  # [out, in] its zero point (asymmetric int only)
    group_scale: torch.Tensor  # [out, n_groups]: group actorder chooses them on the way
    group_zp: torch.Tensor | None
    qp_static: QParams | None  # static groups (and none): fixed up front
    spec: WeightSpec
    g: int  # group size
    scale_dtype: torch.dtype
    global_scale: torch.Tensor | None = None  # NVFP4
    search: ScaleSearch | None = None  # group act-order's scales, chosen on the way, by the MSE search


def _column_loop(s: _Sweep, block_size: int) -> None:
    """The GPTQ sweep over (permuted) columns, in blocks of `block_size`; updates W, Q, losses in place.

    Inside a block the weights are held transposed ([b, out]) so that every column the sweep touches
    is one contiguous row: about 2x faster on the CPU than strided column access.
    """
    W, U, Q, losses, spec, g = s.W, s.U, s.Q, s.losses, s.spec, s.g
    scale_cols, zp_cols, group_scale, group_zp, qp_static = s.scale_cols, s.zp_cols, s.group_scale, s.group_zp, s.qp_static
    scale_dtype, global_scale = s.scale_dtype, s.global_scale
    cw = s.search.column_weight if s.search is not None else None
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
                search = None if s.search is None else ScaleSearch(
                    s.search.ratios, cw[col:col + g] if cw is not None else None)
                qp = compute_qparams(block, _as_channel(spec), scale_dtype, global_scale=global_scale, search=search)
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
        W[:, i1:i2] = W1.t()  # each column as it was rounded (nothing updates a column after its turn)
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
class GPTQStage(QuantizerStage, ScaleSearchOptions):
    """GPTQ (Frantar et al. 2022): second-order rounding from calibration Hessians."""

    method: Literal["gptq"]
    block_size: int = Field(128, ge=1)
    dampening_frac: float = Field(0.01, gt=0, lt=1)
    actorder: Literal["none", "static", "group"] = "static"

    @property
    def needs_calibration(self) -> bool:
        return True


def quantize(weights: list[torch.Tensor], obs: Observations, spec: WeightSpec, stage: GPTQStage,
             scale_dtype: torch.dtype, keep_rounded: bool = False) -> list[QuantizedWeight]:
    """The group's weights share an input: one factorisation of its Hessian, then one sweep per weight
    (each weight's result is the same whichever others share the call, which lets ranks split a group)."""
    out = []
    with _threads(weights[0].device if weights else torch.device("cpu")):
        f = gptq_factor(obs.hessian, stage.dampening_frac, stage.actorder)
        for w in weights:
            res = gptq_solve(w, f, spec, stage.block_size, stage.actorder, scale_dtype, stage.scale_search())
            out.append(QuantizedWeight(res.weight, res.qparams.scale, res.qparams.zero_point, res.g_idx,
                                       {"gptq_loss": float(res.loss.sum()), "damping": res.damping},
                                       global_scale=res.qparams.global_scale,
                                       rounded=res.rounded if keep_rounded else None))
    return out
