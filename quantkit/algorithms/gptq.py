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
  dtype before any code is chosen, as in RTN. Where the calibration inputs are bf16 the Hessian's products
  run on the CPU's bf16 dot products, which are exact for them, with fp32 sums.

Left out: sparsity (SparseGPT), per-row adaptive group sizes, and Hessians in reduced precision.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from dataclasses import dataclass, replace

import numpy as np
import torch

from typing import Literal

from pydantic import Field

from quantkit.algorithms.rtn import (QParams, compute_qparams, dequantize_codes, group_size_for, nvfp4_global_scale,
                                    quantize_codes, rows_per_block)
from quantkit.algorithms import bf16_gemm, sweep_kernel
from quantkit.io import give_back_free_memory
from quantkit.algorithms.contract import Observations, QuantizedWeight, ScaleSearch
from quantkit.schemes import WeightSpec
from quantkit.algorithms.base import QuantizerStage, ScaleSearchOptions


SLAB_ROWS = 512  # rows of H computed per product: the work buffers are SLAB_ROWS x in, not in x in
# inputs that are not fp32 are made fp32 a band at a time: whole slabs, at most 1/BANDS of the columns, or more
# where that stays within BAND_BYTES (a small model's inputs are converted once, in one band)
BANDS, BAND_BYTES = 4, 32 << 20
# H of up to NARROW_INPUTS inputs by slabs of NARROW_SLAB_ROWS on the torch paths: a slab's diagonal block computes
# its upper half for nothing, and narrow slabs waste less of it. Measured (2-core AVX-512 EPYC, 4,096 tokens per
# chunk, median of 7): fp32 576 / 1536 inputs 14.3 / 78.3 ms at 512 rows, 10.6 / 69.9 ms at 128; bf16 inputs (oneDNN's
# bf16 mode) 6.6 / 32.9 ms -> 4.8 / 29.3 ms; from 4,096 inputs 128-row slabs were slower (bf16 266 vs 222 ms).
NARROW_INPUTS, NARROW_SLAB_ROWS = 2048, 128


class HessianAccumulator:
    """H = 2/n sum x x^T over calibration tokens, in fp32, accumulated chunk by chunk.

    H is symmetric, so only its lower triangle is computed, a slab of rows at a time (SLAB_ROWS, or NARROW_SLAB_ROWS
    up to NARROW_INPUTS inputs): the block left of the diagonal, and the diagonal block (whose upper half is
    computed and dropped), by one torch product each. A chunk's product is added to the sum slab by slab
    (`add`), so no [in, in] temporary is ever made: for Llama-3.1-8B's down_proj that is 822 MB less at the
    conversion's peak. (Not scipy's `ssyrk`, which did the triangle in half the flops: OpenBLAS's threads spin
    for a while after each call, and on 2 cores the torch work that follows then waited ~50 ms a call for a
    core; on 2 AMX cores torch's slabs of 512 rows took 9 / 51 / 324 ms per 4096-token chunk where ssyrk took
    14 / 59 / 339 for 576 / 1536 / 4096 inputs.)
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
    a fresh product of at most SLAB_ROWS x in. Returns the token count.

    Inputs that are bf16 on a CPU with native bf16 dot products are multiplied by them (`_bf16_products`): the
    product of two bf16 numbers is exact in fp32 and oneDNN sums them in fp32, so H stays an fp32 sum of exact
    products (within 1e-5 of a float64 reference, tests/test_quant_math.py) at twice the fp32 rate on AVX-512
    BF16. On AMX MKL's bf16 GEMM makes the same products from the bf16 inputs as they are
    (`_lower_gram_bf16_gemm_`: no fp32 copy of them, ~2x faster again)."""
    exact_bf16 = x.dtype == torch.bfloat16 and x.device.type == "cpu" and _cpu_bf16_dots()
    x = x.reshape(-1, x.shape[-1])  # [tokens, in]
    if x.shape[0] == 0:
        return 0
    if exact_bf16 and _mkl_bf16_gemm():
        _lower_gram_bf16_gemm_(target, x.contiguous())
        return x.shape[0]
    # (never above SLAB_ROWS: the work buffers' bound, which the tests also lower to cut small H into slabs)
    slab = min(SLAB_ROWS, NARROW_SLAB_ROWS) if x.shape[1] <= NARROW_INPUTS else SLAB_ROWS
    with _bf16_products(exact_bf16):
        if x.dtype == torch.float32:
            _lower_gram_band_(target, x.contiguous(), 0, slab)
        else:
            _lower_gram_bands_(target, x, slab)
    return x.shape[0]


def _lower_gram_band_(target: torch.Tensor, band: torch.Tensor, b0: int,
                      slab: int, left: tuple[int, torch.Tensor] | None = None, own: bool = True) -> None:
    """Into target's rows b0.. (the band's columns), a slab of `slab` rows at a time: with `left` (l0, the
    fp32 columns l0.. of an earlier band), the band against them; with `own`, the lower triangle of the band
    against itself (`band` then fp32). A slab that is not fp32 is converted alone."""
    n = band.shape[1]
    for r0 in range(0, n, slab):
        r1 = min(r0 + slab, n)
        cols = band[:, r0:r1].float()  # (no copy where fp32)
        rows = target[b0 + r0:b0 + r1]
        if left is not None:
            l0, lcols = left
            rows[:, l0:l0 + lcols.shape[1]].add_(torch.mm(cols.t(), lcols))
        if own:
            if r0:
                rows[:, b0:b0 + r0].add_(torch.mm(cols.t(), band[:, :r0]))
            rows[:, b0 + r0:b0 + r1].add_(torch.mm(cols.t(), cols).tril_())


def _lower_gram_bands_(target: torch.Tensor, x: torch.Tensor, slab: int) -> None:
    """The same products for inputs that are not fp32 (bf16 compute), a band of them in fp32 at a time: the
    columns cut into bands of whole slabs, a quarter of them (BANDS) or what fits in BAND_BYTES; each band in
    turn is made fp32 for its own triangle, then the later bands' slabs, each converted alone, are multiplied
    against it. Every element of H still gets one dot product over every token; the inputs are converted up to
    (BANDS + 1) / 2 times instead of once, and the peak holds a band of them in fp32 (an 8B down_proj's 4,096
    tokens: 59 MB instead of 235 MB beside its 822 MB Hessian, where the conversion's peak sits)."""
    n = x.shape[1]
    quarter = -(-n // (BANDS * slab)) * slab  # n / BANDS, rounded up to whole slabs
    small = BAND_BYTES // (4 * x.shape[0]) // slab * slab  # whole slabs within BAND_BYTES of fp32
    width = max(quarter, small, slab)
    starts = range(0, n, width)
    for b0 in starts:
        band = x[:, b0:b0 + width].float()
        _lower_gram_band_(target, band, b0, slab)
        for c0 in starts:
            if c0 > b0:
                _lower_gram_band_(target, x[:, c0:c0 + width], c0, slab, left=(b0, band), own=False)
        del band


def _lower_gram_bf16_gemm_(target: torch.Tensor, x: torch.Tensor) -> None:
    """The same slabs for bf16 inputs by MKL's bf16 x bf16 -> fp32 GEMM (quantkit/algorithms/bf16_gemm.py),
    straight from the inputs: no fp32 copy of them, no band. Each slab's product [SLAB_ROWS, r1] (its block
    left of the diagonal and the diagonal block, made lower) lands in one reused fp32 buffer and is added to
    the sum, so every element is still one product added to the running sum (`fold` gives the same bits)."""
    n = x.shape[1]
    buf = torch.empty(min(SLAB_ROWS, n) * n, dtype=torch.float32)
    for r0 in range(0, n, SLAB_ROWS):
        r1 = min(r0 + SLAB_ROWS, n)
        prod = bf16_gemm.gemm_tn(x[:, r0:r1], x[:, :r1], buf[:(r1 - r0) * r1].view(r1 - r0, r1))
        rows = target[r0:r1]
        if r0:
            rows[:, :r0].add_(prod[:, :r0])
        rows[:, r0:r1].add_(prod[:, r0:r1].tril_())


@functools.cache
def _mkl_bf16_gemm() -> bool:
    """bf16 Hessian inputs go to MKL's bf16 GEMM (not oneDNN's bf16 mode) on AMX CPUs, where it was measured:
    a 4,096-token x 14,336-input Hessian 2.5x faster (2 AMX cores). Without AMX the oneDNN path stays: MKL's
    bf16 GEMM was not measured there (on a non-Intel CPU MKL may not pick its AVX-512 kernels)."""
    from quantkit.hardware import cpu_kind

    return cpu_kind() == "amx" and bf16_gemm.available()


@functools.cache
def _cpu_bf16_dots() -> bool:
    """This CPU multiplies bf16 natively (avx512_bf16 or AMX) and torch's oneDNN can use it for fp32 products."""
    from quantkit.hardware import native_bf16

    return native_bf16() and torch.backends.mkldnn.is_available()


@contextmanager
def _bf16_products(on: bool):
    """fp32 products on the CPU computed from bf16-rounded inputs with fp32 sums while inside (exact for inputs
    that were bf16 already); the previous setting comes back after."""
    if not on:
        yield
        return
    was = torch.backends.mkldnn.matmul.fp32_precision
    torch.backends.mkldnn.matmul.fp32_precision = "bf16"
    try:
        yield
    finally:
        torch.backends.mkldnn.matmul.fp32_precision = was


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
    # row-major, the lower L = R^T; and R^-1 read back is (R^-1)^T = L^-1
    f = A.numpy().T
    with threadpool_limits(limits=lapack_threads(A.shape[0]), user_api="blas"):
        c, info = spotrf(f, lower=0, clean=0, overwrite_a=1)  # clean=0: the other triangle is left as it was
        if info != 0:
            return None
        inv, info = strtri(c, lower=0, overwrite_c=1)
    if info != 0:
        return None
    if not np.shares_memory(inv, f):  # f2py made a copy after all
        f[...] = inv
    return A


LAPACK_THREADED_FROM = 4096  # inputs from which the factorisation runs in torch's thread count, below in one


def lapack_threads(n: int) -> int:
    """Threads for scipy's OpenBLAS factorising an [n, n] Hessian. Its worker threads keep spinning for a while
    after each call (OpenBLAS's default thread timeout, ~0.1 s), and on 2 cores the torch work that follows
    then waits for a core: on the demo model (every input < 4096) the GPTQ conversion took 30.5 s with the
    factorisations on 2 threads and 20.0 s on one, though one thread factorises a 1536 x 1536 Hessian in
    28 ms where two take 16. From 4096 inputs on two threads save more than the spin costs (4096: 361 vs
    170 ms, 8192: 2.6 vs 1.2 s). Never more than torch's own count (beside torch's pool, OpenBLAS's default
    count ran 10x slower on 2 loaded cores)."""
    return torch.get_num_threads() if n >= LAPACK_THREADED_FROM else 1


@dataclass
class Factor:
    """What GPTQ derives from a Hessian alone, shared by every weight that reads the same input."""

    # [in, in] the upper Cholesky factor U of (H + damp)^-1, in the permuted column order, zero below its
    # diagonal: made in place from what the factorisation leaves (`_upper_from_reversed_`); `rows` reads it
    upper: torch.Tensor
    perm: torch.Tensor | None  # [in] the activation order (None: columns in order)
    dead: torch.Tensor  # [in] bool, columns whose input is always zero (original order)
    damping: float
    diag: torch.Tensor | None = None  # [in] diag(H) in the original order (the MSE scale search's column weights)

    def rows(self, i1: int, i2: int) -> torch.Tensor:
        """U[i1:i2, i1:] ([b, in - i1], a view: read only): the block's rows of the factor from its diagonal on
        (the rest of an upper triangular factor's rows is zero)."""
        return self.upper[i1:i2, i1:]

    @property
    def U(self) -> torch.Tensor:
        """The whole factor (a copy, [in, in]: for checks; the sweep reads it by `rows`)."""
        return self.upper.clone()


def _upper_from_reversed_(A: torch.Tensor) -> torch.Tensor:
    """U in place from J U J in A's lower triangle (what the factorisation leaves; its strict upper triangle holds
    what the factorisation did not touch): rows and columns reversed together (A[i, j] <- A[n-1-i, n-1-j]), a
    slab of rows against its mirror slab at a time, then zeros below the diagonal. Once per factor, so the
    sweep reads each block's rows as a view: before, each block copied its rows reversed (an 8B down_proj's
    411 MB of copies per sweep)."""
    n = A.shape[0]
    for a in range(0, n // 2, SLAB_ROWS):
        b = min(a + SLAB_ROWS, n // 2)
        top = A[a:b].flip(0, 1)  # a copy (torch has no reversed views)
        A[a:b] = A[n - b:n - a].flip(0, 1)
        A[n - b:n - a] = top
    if n % 2:
        A[n // 2] = A[n // 2].flip(0)
    for r0 in range(0, n, SLAB_ROWS):
        r1 = min(r0 + SLAB_ROWS, n)
        A[r0:r1, :r0] = 0.0
        A[r0:r1, r0:r1].triu_()
    return A


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
    return Factor(_upper_from_reversed_(U_rev), perm, dead, damp, diag)


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
    return gptq_solve_stacked([W], f, spec, block_size, actorder, scale_dtype, search)[0]


GIVE_BACK_EVERY = 8  # blocks of the sweep between two returns of the freed heap, where the caller asks for them
SPAN_BLOCKS = 8  # blocks whose errors the columns after them take in one product (static groups: `_column_loop`)
SPAN_FROM = 4096  # inputs from which the sweep goes by spans (measured at 4,096 and 14,336; below, one block)
STACK_WEIGHTS = 16 << 20  # weights swept together at most: fp32 copies of W and Q of 128 MB


def stackable(rows: list[int], actorder: str) -> bool:
    """Whether weights with these row counts can be swept as one: every member but the last a whole number of
    64-row runs, so that each member's rows meet the vector loops of every per-column operation at the
    positions they meet them alone (bit-identical results, tests/test_quant_math.py); static groups only (group
    act-order chooses NVFP4 scales under each weight's own global scale on the way)."""
    return actorder != "group" and all(r % 64 == 0 for r in rows[:-1])


def gptq_solve_stacked(weights: list[torch.Tensor], f: Factor, spec: WeightSpec, block_size: int = 128,
                       actorder: str = "static", scale_dtype: torch.dtype = torch.bfloat16,
                       search: ScaleSearch | None = None, keep_rounded: bool = True) -> list[GPTQResult]:
    """One column sweep for several weights [out_k, in] that share a factor, their rows stacked: GPTQ's rows are
    independent, so each weight's result is bit for bit the one it gets alone (where `stackable`), and the
    sweep's per-column work (a dozen small tensor operations, whose cost on the CPU is their dispatch, not their
    arithmetic) is paid once per column of the group instead of once per column of each weight.
    `keep_rounded` False: no `rounded` in the results, and the sweep writes each column's result over the
    column it rounded, in the one fp32 copy of the weights (one [out, in] fp32 buffer less: 235 MB for an 8B
    down_proj); every other figure is bit for bit the same (tests/test_quant_math.py)."""
    rows = [w.shape[0] for w in weights]
    if len(weights) > 1 and not stackable(rows, actorder):
        return [gptq_solve_stacked([w], f, spec, block_size, actorder, scale_dtype, search, keep_rounded)[0]
                for w in weights]
    originals = [w.detach() for w in weights]
    W, bounds = _fp32_stack(originals)
    in_f = W.shape[1]
    g = group_size_for(spec, in_f)
    W[:, f.dead] = 0.0

    # NVFP4's per-tensor global scale: from the whole original weight, also when groups are chosen on the way
    # (static groups: compute_qparams takes it from each weight's own rows)
    gscale = nvfp4_global_scale(W) if spec.scale_format == "fp8" and actorder == "group" else None
    if search is not None and search.column_weight is None and f.diag is not None:
        search = replace(search, column_weight=f.diag)
    # static groups (and none): scales from each original weight, fixed up front
    qps = ([compute_qparams(W[r0:r1], spec, scale_dtype, global_scale=gscale, search=search) for r0, r1 in bounds]
           if actorder != "group" else None)
    qp_static = None if qps is None else _stacked(qps)
    perm = f.perm
    if perm is not None:
        _permute_columns_(W, perm)
    Q = torch.zeros_like(W) if keep_rounded else W
    losses = torch.zeros(W.shape[0], dtype=torch.float32, device=W.device)
    n_groups = in_f // g
    asym = not spec.symmetric and spec.type == "int"
    # each permuted column's group: static groups are the original columns' (fixed up front); group act-order's
    # are runs of g permuted columns, whose scales the sweep chooses when it reaches a group's first column
    col_group = (perm if perm is not None and qp_static is not None else torch.arange(in_f, device=W.device)) // g
    group_scale = torch.empty(W.shape[0], n_groups, device=W.device)
    group_zp = torch.empty(W.shape[0], n_groups, device=W.device) if asym else None

    if search is not None and search.column_weight is not None and perm is not None:
        search = replace(search, column_weight=search.column_weight[perm])  # group act-order: permuted order
    _column_loop(_Sweep(W, f, Q, losses, col_group, group_scale, group_zp, qp_static, spec, g, scale_dtype,
                        gscale, search, bounds), block_size)

    g_idx = None
    if perm is not None:  # back to the original column order
        inv = torch.argsort(perm)
        _permute_columns_(Q, inv)
        if keep_rounded:
            _permute_columns_(W, inv)
    if qps is None:
        qps = [QParams(group_scale, group_zp, g, gscale)]
        g_idx = (inv // g).to(torch.int32)  # original column -> group
    return [GPTQResult(Q[r0:r1], qp, g_idx, losses[r0:r1], f.damping, W[r0:r1] if keep_rounded else None,
                       _output_noise(w, Q[r0:r1], losses[r0:r1], f))
            for (r0, r1), qp, w in zip(bounds, qps, originals)]


def _fp32_stack(weights: list[torch.Tensor]) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """One fp32 copy of the weights' rows, stacked, and each weight's (first, end) rows in it."""
    rows = [w.shape[0] for w in weights]
    bounds = [(r0, r0 + r) for r0, r in zip([sum(rows[:k]) for k in range(len(rows))], rows)]
    W = torch.empty(sum(rows), weights[0].shape[1], dtype=torch.float32, device=weights[0].device)
    for (r0, r1), w in zip(bounds, weights):
        W[r0:r1].copy_(w)
    return W, bounds


def _stacked(qps: list[QParams]) -> QParams:
    """The members' static scales (and zero points) as one [sum out, n_groups] set, for the sweep to read."""
    if len(qps) == 1:
        return qps[0]
    zp = None if qps[0].zero_point is None else torch.cat([qp.zero_point for qp in qps])
    return QParams(torch.cat([qp.scale for qp in qps]), zp, qps[0].group_size)


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
    Q: torch.Tensor  # [out, in] the dequantized result (W itself where the rounded values are not kept)
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
    bounds: list[tuple[int, int]] | None = None  # each stacked weight's rows (None: one weight)


def _column_loop(s: _Sweep, block_size: int) -> None:
    """The GPTQ sweep over (permuted) columns, in blocks of `block_size`; updates W, Q, losses in place. Each
    block's column by column work (`_compiled_block` or `_torch_block`) gives the block's errors [out, b]; the
    columns after the block then take them in products per stacked weight (GEMMs, in all threads).

    Where the scales are fixed up front (static groups, or none), the blocks are swept SPAN_BLOCKS at a time:
    a block's errors go at once only to the rest of its span, and the columns after the span take the whole
    span's errors in one product of depth SPAN_BLOCKS x block_size. The same updates in exact arithmetic (each
    column still has every earlier column's error when it is rounded; in fp32 0.12% of an 8B down_proj's codes
    land on the other side of a rounding edge, its loss the same to 4e-6); each pass over the trailing columns
    then carries 8x the work. On 2 AMX cores (`python benchmarks/gptq_sweep.py`) an 8B down_proj's whole sweep
    took 4.8-5.2 s instead of 5.3-5.5 s, gate_proj's 2.1-2.2 s instead of 2.2-2.3 s; an earlier window with an
    ad-hoc script, 4.7-4.8 s instead of 5.9-6.4 s (4 blocks a span: 5.2-5.4 s, 16: 4.6-4.8 s). Below SPAN_FROM
    inputs the sweep keeps one block at a time, where the trailing products are small and spans were not
    measured faster: another order of sums is another draw of the codes on rounding edges (the demo model's
    GPTQ in bf16 gave held-out perplexity 37.74 / 38.25 / 38.48 with spans of 2 / 4 / 8 blocks against 38.05
    with one), which is no gain where nothing is faster. Group act-order keeps one block at a time: it
    chooses a group's scales from columns that may lie past the span."""
    W = s.W
    in_f = W.shape[1]
    compiled = sweep_kernel.kernel() if s.spec.type == "int" and W.device.type == "cpu" else None
    span = block_size * (SPAN_BLOCKS if s.qp_static is not None and in_f >= SPAN_FROM else 1)
    for o1 in range(0, in_f, span):
        o2 = min(o1 + span, in_f)
        errors = []
        for i1 in range(o1, o2, block_size):
            i2 = min(i1 + block_size, o2)
            E = _sweep_block(s, i1, i2, compiled)
            if i2 < o2:  # the rest of the span: -= [out, b] @ U[i1:i2, i2:o2], in place
                _trailing_update(s, E, s.factor.upper[i1:i2, i2:o2], i2, o2)
            errors.append(E)
            if i1 // block_size % GIVE_BACK_EVERY == GIVE_BACK_EVERY - 1:
                give_back_free_memory()  # (a large group's solve: quantkit.io.giving_back_freed_memory)
        if o2 < in_f:  # the columns after the span take all of its errors at once
            E = errors[0] if len(errors) == 1 else torch.cat(errors, dim=1)
            del errors
            _trailing_update(s, E, s.factor.upper[o1:o2, o2:], o2, in_f)
        del E


def _sweep_block(s: _Sweep, i1: int, i2: int, compiled) -> torch.Tensor:
    """Columns i1..i2 rounded one by one (W, Q and the losses updated in place); their errors [out, b]."""
    U = s.factor.rows(i1, i2)[:, :i2 - i1]  # the block's diagonal block of the factor
    if compiled is not None:  # (torch's thread count untouched: changing it costs ~1.5 ms a block)
        E = _compiled_block(s, i1, i2, U.contiguous(), compiled)
    else:
        with _threads(s.W.device):
            E = _torch_block(s, i1, i2, U)
    s.losses += E.pow(2).sum(1) / 2
    return E


def _trailing_update(s: _Sweep, E: torch.Tensor, U: torch.Tensor, c1: int, c2: int) -> None:
    """W[:, c1:c2] -= E @ U, in place: one product per stacked weight, as each has alone."""
    for r0, r1 in s.bounds or [(0, s.W.shape[0])]:
        s.W[r0:r1, c1:c2].addmm_(E[r0:r1], U, alpha=-1)


def _compiled_block(s: _Sweep, i1: int, i2: int, U: torch.Tensor, compiled) -> torch.Tensor:
    """The block's columns by the compiled loop (quantkit/algorithms/sweep_kernel.py), on W and Q in place,
    each row's block of columns in turn; group act-order's scales chosen at each group's first column.
    Returns the block's errors [out, b]."""
    E = torch.empty(s.W.shape[0], i2 - i1, dtype=torch.float32)
    scale, zp = (s.qp_static.scale, s.qp_static.zero_point) if s.qp_static is not None else (s.group_scale, s.group_zp)
    # static scales are only read (a contiguous copy will do); group act-order's are filled in place as it goes
    S = scale.float().contiguous().numpy()
    Z = zp.float().contiguous().numpy() if zp is not None else np.zeros((0, 0), dtype=np.float32)
    groups = s.col_group.numpy()
    starts = {i for i in range(i2 - i1) if s.qp_static is None and (i1 + i) % s.g == 0}
    edges = sorted(starts | {0, i2 - i1})
    for a, e in zip(edges, edges[1:]):
        if a in starts:
            _choose_group(s, i1 + a, s.W[:, i1 + a:i1 + a + s.g])
        sweep_kernel.sweep(compiled, (s.W.numpy(), s.Q.numpy(), E.numpy()), (S, Z, groups, s.spec.qmin, s.spec.qmax),
                           U.numpy(), (i1, a, e), torch.get_num_threads(), keep_rounded=s.Q is not s.W)
    return E


def _torch_block(s: _Sweep, i1: int, i2: int, U: torch.Tensor) -> torch.Tensor:
    """The block's columns by torch calls, on the block held transposed ([b, out]: every column the sweep
    touches one contiguous row, ~2x faster than strided columns). Every per-column view and constant is taken
    once per block: the loop body is the arithmetic's few calls. Returns the block's errors [out, b]."""
    spec, g, n, W = s.spec, s.g, i2 - i1, s.W
    scale, zp = (s.qp_static.scale, s.qp_static.zero_point) if s.qp_static is not None else (s.group_scale, s.group_zp)
    cols = s.col_group[i1:i2]  # group act-order: a group starting inside the block is filled in by the sweep
    bW, S = W[:, i1:i2].t().contiguous(), scale[:, cols].t().float().contiguous()
    Z = zp[:, cols].t().float().contiguous() if zp is not None else None
    bQ, bE = torch.empty_like(bW), torch.empty_like(bW)
    Ws, Qs, Es, Ss = bW.unbind(0), bQ.unbind(0), bE.unbind(0), S.unbind(0)  # [out] views, per column
    Zs = Z.unbind(0) if Z is not None else [None] * n
    d = U.diagonal().tolist()  # exact: fp32 values as Python floats, divided by as fp32
    integer, lo, hi = spec.type == "int", spec.qmin, spec.qmax
    for i in range(n):
        if s.qp_static is None and (i1 + i) % g == 0:
            current = torch.cat([bW[i:].t(), W[:, i2:i1 + i + g]], dim=1)[:, :g]  # [out, g] as updated so far
            qp = _choose_group(s, i1 + i, current)
            S[i:i + g] = qp.scale[:, 0]
            if Z is not None:
                Z[i:i + g] = qp.zero_point[:, 0]
        w, q, err, sc, z = Ws[i], Qs[i], Es[i], Ss[i], Zs[i]  # q and err are written in place
        if not integer:
            q.copy_(dequantize_codes(quantize_codes(w, sc, z, spec), sc, z, spec))
        elif z is None:  # q = dequantize(quantize(w)), as quantize_codes and dequantize_codes do it, in place
            torch.div(w, sc, out=q).round_().clamp_(lo, hi).mul_(sc)
        else:
            torch.div(w, sc, out=q).round_().add_(z).clamp_(lo, hi).sub_(z).mul_(sc)
        torch.sub(w, q, out=err).div_(d[i])
        if i + 1 < n:
            bW[i + 1:].addr_(U[i, i + 1:], err, alpha=-1)  # [b - i - 1, out] -= U1[i, i+1:] (x) err
    if s.Q is not W:
        W[:, i1:i2] = bW.t()  # each column as it was rounded (nothing updates a column after its turn)
    s.Q[:, i1:i2] = bQ.t()
    return bE.t()


def _choose_group(s: _Sweep, col: int, current: torch.Tensor) -> QParams:
    """Group act-order: the scale (and zero point) of the group starting at (permuted) column `col`, from its
    columns as the sweep has updated them so far (`current`, [out, g]); kept in the sweep's group scales."""
    g, cw = s.g, s.search.column_weight if s.search is not None else None
    search = None if s.search is None else replace(s.search, column_weight=cw[col:col + g] if cw is not None else None)
    qp = compute_qparams(current, _as_channel(s.spec), s.scale_dtype, global_scale=s.global_scale, search=search)
    s.group_scale[:, col // g] = qp.scale[:, 0]  # the group's later columns, in later blocks, read it there
    if s.group_zp is not None:
        s.group_zp[:, col // g] = qp.zero_point[:, 0]
    return qp


@contextmanager
def single_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _as_channel(spec: WeightSpec) -> WeightSpec:
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
    """The group's weights share an input: one factorisation of its Hessian, then their sweeps, stacked up to
    STACK_WEIGHTS weights at a time (each weight's result is the same whichever others share the call, which
    lets ranks split a group)."""
    out = []
    if weights:
        f = gptq_factor(obs.hessian, stage.dampening_frac, stage.actorder, consume=obs.consumable)
        give_back_free_memory()  # the factorisation's freed blocks, before the sweeps' fp32 copies
        for batch in _stacks(weights):
            for res in gptq_solve_stacked(batch, f, spec, stage.block_size, stage.actorder, scale_dtype,
                                          stage.scale_search(), keep_rounded):
                out.append(QuantizedWeight(res.weight, res.qparams.scale, res.qparams.zero_point, res.g_idx,
                                           {"gptq_loss": float(res.loss.sum()), "damping": res.damping},
                                           global_scale=res.qparams.global_scale,
                                           rounded=res.rounded, output_noise=res.noise))
    return out


def _stacks(weights: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The weights in order, in runs of at most STACK_WEIGHTS weights (a larger one alone)."""
    runs: list[list[torch.Tensor]] = []
    for w in weights:
        if runs and sum(x.numel() for x in runs[-1]) + w.numel() <= STACK_WEIGHTS:
            runs[-1].append(w)
        else:
            runs.append([w])
    return runs
