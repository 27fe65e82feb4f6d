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
                                    quantize_codes, rows_per_block)
from quantkit.algorithms.contract import Observations, QuantizedWeight, ScaleSearch
from quantkit.schemes import WeightSpec
from quantkit.algorithms.base import QuantizerStage, ScaleSearchOptions


SLAB_ROWS = 512  # rows of H computed per product: the work buffers are SLAB_ROWS x in, not in x in


class HessianAccumulator:
    """H = 2/n sum x x^T over calibration tokens, in fp32, accumulated chunk by chunk.

    H is symmetric, so only its lower triangle is computed, a slab of SLAB_ROWS rows at a time: the block left
    of the diagonal, and the diagonal block (whose upper half is computed and dropped), by one torch product
    each. A chunk's product is added to the sum slab by slab (`add`), so no [in, in] temporary is ever made: for
    Llama-3.1-8B's down_proj that is 822 MB less at the conversion's peak. (Not scipy's `ssyrk`, which did the
    triangle in half the flops: OpenBLAS's threads spin for a while after each call, and on 2 cores the torch
    work that follows then waited ~50 ms a call for a core; on 2 AMX cores torch's slabs of 512 rows took
    9 / 51 / 324 ms per 4096-token chunk where ssyrk took 14 / 59 / 339 for 576 / 1536 / 4096 inputs.)
    Across processes (quantkit/distributed.py) each chunk's whole product is made by its owner (`partial`,
    from the same slab products) and added in chunk order on every rank (`fold`), which gives the sum here
    bit for bit: every element is the same product added to the same running sum. Read `H` for the full
    symmetric matrix.
    """

    def __init__(self, in_features: int, device: torch.device | str = "cpu"):
        self._acc = torch.zeros(in_features, in_features, dtype=torch.float32, device=device)
        self._part: torch.Tensor | None = None  # one chunk's whole product (for another rank), reused
        self.n = 0
        self._final = False  # H has been made (symmetric and scaled); nothing may be added after

    def add(self, x: torch.Tensor) -> None:
        """One chunk's inputs [..., in], added to the sum a slab at a time."""
        self._check_open()
        self.n += _add_lower_gram_(self._acc, x)

    def partial(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        """(X^T X of one chunk, lower triangle only, the rest zero; its token count): the product's buffer is
        reused by the next call. Each element is the product `add` would add (0 + p is p exactly)."""
        if self._part is None:
            self._part = torch.zeros_like(self._acc)
        else:
            self._part.zero_()
        return self._part, _add_lower_gram_(self._part, x)

    def _check_open(self) -> None:
        if self._final:
            raise RuntimeError("HessianAccumulator: a chunk was added after H was read")

    def fold(self, part: torch.Tensor, tokens: int) -> None:
        """Add one chunk's product (from `partial`, here or on another rank) to the sum."""
        self._check_open()
        self._acc.add_(part)
        self.n += tokens

    @property
    def H(self) -> torch.Tensor:
        """The full symmetric 2/n X^T X, made in place from the accumulated lower triangle (the upper one
        holds zeros until then), a slab of rows at a time: no [in, in] temporary."""
        if not self._final:  # first read: finish the sum once
            self._final, self._part = True, None
            _lower_from_upper_(self._acc.t())  # the transposed view's lower triangle is our upper one
            self._acc.mul_(2.0 / max(self.n, 1))
        return self._acc


def _add_lower_gram_(target: torch.Tensor, x: torch.Tensor) -> int:
    """target += the lower triangle of x^T x (x [..., in], made [tokens, in] fp32), by slabs of SLAB_ROWS rows:
    the slab's block left of the diagonal, x[:, r0:r1]^T x[:, :r0], and its diagonal block's lower triangle, each
    a fresh product of at most SLAB_ROWS x in. Returns the token count."""
    x = x.reshape(-1, x.shape[-1]).float().contiguous()  # [tokens, in]
    n = x.shape[1]
    if x.shape[0] == 0:
        return 0
    for r0 in range(0, n, SLAB_ROWS):
        r1 = min(r0 + SLAB_ROWS, n)
        cols = x[:, r0:r1]
        if r0:
            target[r0:r1, :r0].add_(torch.mm(cols.t(), x[:, :r0]))
        target[r0:r1, r0:r1].add_(torch.mm(cols.t(), cols).tril_())
    return x.shape[0]


@dataclass
class GPTQResult:
    weight: torch.Tensor  # [out, in] fp32 dequantized
    qparams: QParams
    g_idx: torch.Tensor | None  # [in] int32 column -> group, only for actorder "group"
    loss: torch.Tensor  # [out] per-row GPTQ objective sum (w - q)^2 / U_ii^2 / 2
    damping: float  # the absolute dampening finally added to diag(H)
    rounded: torch.Tensor | None = None  # [out, in] each column as it was when rounded (error-compensated)
    noise: float | None = None  # tr((W - Q) H (W - Q)^T): the output error over the calibration tokens (see below)


def _inverse_cholesky(A: torch.Tensor, frac: float, max_tries: int = 6) -> tuple[torch.Tensor, float]:
    """L^-1 of J (H + damp I) J = L L^T, from `A` = J H J (H with its rows and columns in REVERSED order): the
    upper Cholesky factor U of (H + damp I)^-1 (U^T U = (H + damp I)^-1) is J L^-1 J, which `Factor` reads
    without making it.

    J (H + d I) J = L L^T gives H + d I = (J L J)(J L J)^T with J L J upper, so its inverse J L^-1 J is U:
    one Cholesky factorisation and one triangular inverse, 2/3 n^3 flops, where inverting H and factorising
    the inverse costs 4/3 n^3. On the CPU both run in place in LAPACK (spotrf, strtri) in A's lower triangle,
    and its strict upper triangle is never written: when a try fails, A is made again from it (and its
    diagonal, kept aside) for the next, larger dampening. So the factor needs no buffer besides A.
    """
    diagonal = torch.diagonal(A).clone()
    damp = frac * torch.mean(diagonal).item()
    for attempt in range(max_tries + 1):
        if attempt:
            damp *= 10.0
            _lower_from_upper_(A)  # what the failed try overwrote
            A.diagonal().copy_(diagonal)
        A.diagonal().add_(damp)  # H + damp I, without an [in, in] identity
        Linv = _lower_cholesky_inverse_(A)
        if Linv is not None and torch.isfinite(Linv.sum()):  # (a NaN or inf anywhere makes the sum one)
            return Linv, damp
        del Linv
    raise FloatingPointError(f"Cholesky factorisation failed even with dampening {damp:.3g}; the calibration "
                             "inputs of this layer are degenerate (too few tokens?)")


def _lower_from_upper_(A: torch.Tensor) -> None:
    """A's strict lower triangle made the mirror of its strict upper one, in place, a slab of rows at a time (no
    [in, in] temporary); the diagonal is left as it is."""
    n = A.shape[0]
    for r0 in range(0, n, SLAB_ROWS):
        r1 = min(r0 + SLAB_ROWS, n)
        A[r0:r1, :r0] = A[:r0, r0:r1].t()
        block = A[r0:r1, r0:r1]
        block.copy_(torch.triu(block) + torch.triu(block, 1).t())


def _lower_cholesky_inverse_(A: torch.Tensor) -> torch.Tensor | None:
    """L^-1 for A = L L^T (lower), in A's own lower triangle on the CPU (its strict upper triangle is not
    touched and is not part of the result); None where A is not positive definite."""
    if A.device.type != "cpu":
        L, info = torch.linalg.cholesky_ex(A)
        if info.item() != 0:
            return None
        eye = torch.eye(A.shape[0], device=A.device, dtype=A.dtype)
        return torch.linalg.solve_triangular(L, eye, upper=False)
    import numpy as np
    from scipy.linalg.lapack import spotrf, strtri
    from threadpoolctl import threadpool_limits

    # the row-major buffer read column-major is A^T = A; its upper factor R (A = R^T R) is, read back
    # row-major, the lower L = R^T; and R^-1 read back is (R^-1)^T = L^-1. scipy's OpenBLAS keeps to torch's
    # thread count: with its own default beside torch's pool on 2 loaded cores it ran 10x slower (measured)
    f = A.numpy().T
    with threadpool_limits(limits=torch.get_num_threads(), user_api="blas"):
        c, info = spotrf(f, lower=0, clean=0, overwrite_a=1)  # clean=0: the other triangle is left as it was
        if info != 0:
            return None
        inv, info = strtri(c, lower=0, overwrite_c=1)
    if info != 0:
        return None
    if not np.shares_memory(inv, f):  # f2py made a copy after all
        f[...] = inv
    return A


@dataclass
class Factor:
    """What GPTQ derives from a Hessian alone, shared by every weight that reads the same input."""

    # [in, in] J U J in its lower triangle: the upper Cholesky factor U of (H + damp)^-1 (in the permuted column
    # order) with its rows and columns reversed, as the factorisation leaves it (above the diagonal: not part of
    # it); `rows` reads U from it a block at a time
    U_rev: torch.Tensor
    perm: torch.Tensor | None  # [in] the activation order (None: columns in order)
    dead: torch.Tensor  # [in] bool, columns whose input is always zero (original order)
    damping: float
    diag: torch.Tensor | None = None  # [in] diag(H) in the original order (the MSE scale search's column weights)

    def rows(self, i1: int, i2: int) -> torch.Tensor:
        """U[i1:i2, i1:] ([b, in - i1], a copy): the block's rows of the factor from its diagonal on (the rest
        of an upper triangular factor's rows is zero)."""
        n = self.U_rev.shape[0]
        # below the block's diagonal: U_rev's upper triangle, which holds what the factorisation left there
        return self.U_rev[n - i2:n - i1, :n - i1].flip(0, 1).triu_()

    @property
    def U(self) -> torch.Tensor:
        """The whole factor (a copy, [in, in]: for checks; the sweep reads it by `rows`)."""
        return self.rows(0, self.U_rev.shape[0])


def gptq_quantize(W: torch.Tensor, H: torch.Tensor, spec: WeightSpec, block_size: int = 128,
                  dampening_frac: float = 0.01, actorder: str = "static",
                  scale_dtype: torch.dtype = torch.bfloat16, search: ScaleSearch | None = None) -> GPTQResult:
    """GPTQ of one weight [out, in] given its input's Hessian [in, in]."""
    return gptq_solve(W, gptq_factor(H, dampening_frac, actorder), spec, block_size, actorder, scale_dtype, search)


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


def gptq_factor(H: torch.Tensor, dampening_frac: float = 0.01, actorder: str = "static",
                consume: bool = False) -> Factor:
    """Dead columns, activation order and the inverse-Hessian Cholesky factor, from H alone. H is not modified,
    unless `consume` (its caller reads it no more): then the factor is made in H's own buffer (an fp32 CPU H),
    which holds it after; for Llama-3.1-8B's down_proj that is 822 MB less at the conversion's peak."""
    H = H.detach()
    in_place = consume and H.dtype == torch.float32 and H.is_contiguous() and H.device.type == "cpu"
    H = H if in_place else H.float()  # [in, in]
    diag = torch.diag(H).clone()
    dead = diag == 0
    diag[dead] = 1.0
    perm = torch.argsort(diag, descending=True) if actorder in ("static", "group") else None
    order = perm if perm is not None else torch.arange(H.shape[0], device=H.device)
    rev = order.flip(0)  # the factorisation wants the (permuted) order reversed
    if in_place:
        A = H
        _permute_columns_(A, rev)
        _permute_rows_(A, rev)
    else:  # a new buffer, filled a slab of rows at a time
        A = torch.empty_like(H)
        for r0 in range(0, H.shape[0], 1024):
            A[r0:r0 + 1024] = H.index_select(0, rev[r0:r0 + 1024]).index_select(1, rev)
    dead_rev = dead[rev]
    A[dead_rev, dead_rev] = 1.0
    U_rev, damp = _inverse_cholesky(A, dampening_frac)
    return Factor(U_rev, perm, dead, damp, diag)


def _permute_rows_(M: torch.Tensor, order: torch.Tensor) -> None:
    """M[:, :] = M[order] in place, one row at a time along each cycle of the permutation (one row aside)."""
    to = order.tolist()
    done = [False] * len(to)
    for i in range(len(to)):
        if done[i] or to[i] == i:
            done[i] = True
            continue
        first, j = M[i].clone(), i
        while True:
            done[j] = True
            k = to[j]
            if k == i:
                M[j] = first
                break
            M[j] = M[k]
            j = k


def gptq_solve(W: torch.Tensor, f: Factor, spec: WeightSpec, block_size: int = 128, actorder: str = "static",
               scale_dtype: torch.dtype = torch.bfloat16, search: ScaleSearch | None = None) -> GPTQResult:
    """The column sweep of one weight [out, in] with a shared factor. Rows are independent, so the result
    for a weight does not depend on which other weights share the factor. `search`: the MSE scale search,
    its errors weighted by diag(H) (the factor's) unless it brings its own column weights."""
    original = W.detach()
    W = original.to(torch.float32, copy=True)  # [out, in], one copy whatever the dtype
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
        _permute_columns_(W, perm)
    Q = torch.zeros_like(W)
    losses = torch.zeros(out_f, dtype=torch.float32, device=W.device)
    n_groups = in_f // g
    asym = not spec.symmetric and spec.type == "int"
    # each permuted column's group: static groups are the original columns' (fixed up front); group act-order's
    # are runs of g permuted columns, whose scales the sweep chooses when it reaches a group's first column
    col_group = (perm if perm is not None and qp_static is not None else torch.arange(in_f, device=W.device)) // g
    group_scale = torch.empty(out_f, n_groups, device=W.device)
    group_zp = torch.empty(out_f, n_groups, device=W.device) if asym else None

    if search is not None and search.column_weight is not None and perm is not None:
        search = ScaleSearch(search.ratios, search.column_weight[perm])  # group act-order works in permuted order
    _column_loop(_Sweep(W, f, Q, losses, col_group, group_scale, group_zp, qp_static, spec, g, scale_dtype,
                        gscale, search), block_size)

    g_idx = None
    if perm is not None:  # back to the original column order
        inv = torch.argsort(perm)
        _permute_columns_(Q, inv)
        _permute_columns_(W, inv)
    if qp_static is not None:
        qparams = qp_static
    else:
        qparams = QParams(group_scale, group_zp, g, gscale)
        g_idx = (inv // g).to(torch.int32)  # original column -> group
    return GPTQResult(Q, qparams, g_idx, losses, f.damping, W, _output_noise(original, Q, losses, f))


def _output_noise(W: torch.Tensor, Q: torch.Tensor, losses: torch.Tensor, f: Factor) -> float:
    """tr(D H D^T) for D = W - Q, from the sweep's own losses: each column's loss is the exact rise of the damped
    objective 1/2 tr(D (H + damp I) D^T) its rounding caused (optimal brain surgeon), so twice their sum is
    that objective, and the dampening's share damp |D|^2 (dead columns, where H is zero and Q too, left out)
    comes off. Equal to the product with H to ~1e-6 relative in fp32 (tests/test_quant_math.py), for none of
    its out x in^2 flops and without H, which the factor may have overwritten."""
    live = ~f.dead
    sq = torch.zeros((), dtype=torch.float64, device=Q.device)
    step = rows_per_block(Q.shape[1])
    for r in range(0, Q.shape[0], step):
        d = (W[r:r + step].float() - Q[r:r + step])[:, live]
        sq += d.pow(2).sum(1).double().sum()
    return float(2 * losses.sum(dtype=torch.float64) - f.damping * sq)


def _permute_columns_(M: torch.Tensor, order: torch.Tensor) -> None:
    """M[:, :] = M[:, order] in place, a block of rows (~16 MB) at a time: no second [out, in] matrix."""
    step = rows_per_block(M.shape[1])
    for r in range(0, M.shape[0], step):
        M[r:r + step] = M[r:r + step].index_select(1, order)


@dataclass
class _Sweep:
    """One GPTQ column sweep over (permuted) columns: the tensors it updates in place and what it quantizes to."""

    W: torch.Tensor  # [out, in] the weight, updated as the error of each quantized column is spread
    factor: Factor  # the upper Cholesky factor of the inverse Hessian, read a block of rows at a time
    Q: torch.Tensor  # [out, in] the dequantized result
    losses: torch.Tensor  # [out]
    col_group: torch.Tensor  # [in] each (permuted) column's group
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
    is one contiguous row: about 2x faster on the CPU than strided column access. The block's column by
    column work runs in one thread (thousands of tiny vector ops: OpenMP's synchronisation costs more than a
    second thread gives), the update of the columns after it (a GEMM) in all.
    """
    W = s.W
    in_f = W.shape[1]
    for i1 in range(0, in_f, block_size):
        i2 = min(i1 + block_size, in_f)
        U_rows = s.factor.rows(i1, i2)  # U[i1:i2, i1:]
        scale, zp = (s.qp_static.scale, s.qp_static.zero_point) if s.qp_static is not None else (s.group_scale, s.group_zp)
        cols = s.col_group[i1:i2]  # group act-order: a group starting inside the block is filled in by the sweep
        b = _Block(W[:, i1:i2].t().contiguous(), U_rows[:, :i2 - i1], scale[:, cols].t().float().contiguous(),
                   zp[:, cols].t().float().contiguous() if zp is not None and s.group_zp is not None else None)
        with _threads(W.device):
            _block_sweep(s, i1, i2, b)
        s.Q[:, i1:i2] = b.Q.t()
        W[:, i1:i2] = b.W.t()  # each column as it was rounded (nothing updates a column after its turn)
        s.losses += b.E.pow(2).sum(0) / 2
        W[:, i2:].addmm_(b.E.t(), U_rows[:, i2 - i1:], alpha=-1)  # -= [out, b] @ [b, in - i2], in place


class _Block:
    """One block of the sweep, transposed ([b, out]): the weights, their results and errors, the block's
    factor, scales and zero points per column."""

    def __init__(self, W: torch.Tensor, U: torch.Tensor, S: torch.Tensor, Z: torch.Tensor | None):
        self.W, self.U, self.S, self.Z = W, U, S, Z
        self.Q, self.E = torch.empty_like(W), torch.empty_like(W)


def _block_sweep(s: _Sweep, i1: int, i2: int, b: _Block) -> None:
    """The columns i1..i2, one at a time: round, then spread the error over the block's later columns."""
    spec, g = s.spec, s.g
    for i in range(i2 - i1):
        col = i1 + i
        if s.qp_static is None and col % g == 0:
            _choose_group(s, b, i, col, i2)
        w, q, err = b.W[i], b.Q[i], b.E[i]  # [out] each; q and err are written in place
        _fake_quantize_into(q, w, b.S[i], b.Z[i] if b.Z is not None else None, spec)
        torch.sub(w, q, out=err).div_(b.U[i, i])
        b.W[i + 1:].addr_(b.U[i, i + 1:], err, alpha=-1)  # [b - i - 1, out] -= U1[i, i+1:] (x) err


def _choose_group(s: _Sweep, b: _Block, i: int, col: int, i2: int) -> None:
    """Group act-order: the scale of the group starting at (permuted) column `col`, from its columns as the
    sweep has updated them so far."""
    g, cw = s.g, s.search.column_weight if s.search is not None else None
    block = torch.cat([b.W[i:].t(), s.W[:, i2:col + g]], dim=1)[:, :g]  # [out, g]
    search = None if s.search is None else ScaleSearch(s.search.ratios, cw[col:col + g] if cw is not None else None)
    qp = compute_qparams(block, _as_channel(s.spec), s.scale_dtype, global_scale=s.global_scale, search=search)
    n_in_block = min(g, i2 - col)
    b.S[i:i + n_in_block] = qp.scale[:, 0]
    s.group_scale[:, col // g] = qp.scale[:, 0]  # the group's later columns, in later blocks, read it there
    if s.group_zp is not None:
        b.Z[i:i + n_in_block] = qp.zero_point[:, 0]
        s.group_zp[:, col // g] = qp.zero_point[:, 0]


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
    if weights:
        f = gptq_factor(obs.hessian, stage.dampening_frac, stage.actorder, consume=obs.consumable)
        for w in weights:
            res = gptq_solve(w, f, spec, stage.block_size, stage.actorder, scale_dtype, stage.scale_search())
            out.append(QuantizedWeight(res.weight, res.qparams.scale, res.qparams.zero_point, res.g_idx,
                                       {"gptq_loss": float(res.loss.sum()), "damping": res.damping},
                                       global_scale=res.qparams.global_scale,
                                       rounded=res.rounded if keep_rounded else None, output_noise=res.noise))
    return out
