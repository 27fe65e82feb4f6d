"""GPTQ's column-by-column work inside a block, compiled (numba), for integer grids on the CPU.

The sweep rounds one column, divides its error by the factor's diagonal and spreads it over the block's later
columns. For a weight of a few hundred rows that is ~10 torch calls a column whose cost is their dispatch
(~20 us a column on this project's 2-core machines, measured), not their arithmetic (~3 us). Here the same
arithmetic runs as one compiled loop per block, a tile of rows at a time: the same operations in the same
order as the torch loop in `gptq._torch_block` (true division, round half to even, clamp, the error over the
diagonal, the update as one fused multiply-add per element, as torch's vectorised `addr_` does it on the
AVX-512 machine it was measured on). Codes and scales are the torch loop's; the error-compensated weights
agree to the last bit where torch's loop stays on its vector path and to rounding where it does not
(tests/test_quant_math.py). Rows are independent in GPTQ: a weight's result does not depend on the rows
stacked with it.

numba is imported when the first sweep needs it (~0.5 s, then cached beside this file). Where it is missing
or a compilation fails, `kernel()` is None and GPTQ runs its torch loop: also on the GPU and for float grids
(FP8, FP4).
"""

from __future__ import annotations

import logging
from typing import Callable

import numpy as np

log = logging.getLogger(__name__)

_KERNEL: Callable | None = None
PARALLEL_ROWS = 512  # rows a thread at least: below, one thread (a handoff costs ~50 us, a column of 512 rows ~3)
_POOL = None
TILE = 64  # rows held transposed at a time: 64 x 128 columns x 4 bytes = 32 KB, within L1 + L2
_TRIED = False


def kernel() -> Callable | None:
    """The compiled block sweep, compiled (or read from numba's cache) on the first call; None where numba is
    unavailable or the compilation failed (said once in the log)."""
    global _KERNEL, _TRIED
    if not _TRIED:
        _TRIED = True
        try:
            _KERNEL = _compile()
        except Exception as e:  # no numba, or no code for this host: the torch loop does the same work
            log.info("GPTQ sweep: compiled kernel unavailable (%s); the torch loop runs instead", e)
            _KERNEL = None
    return _KERNEL


def sweep(compiled: Callable, arrays: tuple, grid: tuple, U: np.ndarray, cols: tuple[int, int, int],
          threads: int, keep_rounded: bool = True) -> None:
    """Columns `cols` = (i1, i_from, i_to) of a block for every row, the rows split into `threads` runs of
    whole tiles swept at once (rows are independent: the result is the same for any split), when there are
    at least PARALLEL_ROWS of them a thread; torch's threads are idle meanwhile. `keep_rounded` False: W and Q
    may be one array (the swept columns end holding Q, not the values they were rounded from)."""
    out = arrays[0].shape[0]
    n = max(1, min(threads, out // PARALLEL_ROWS))
    keep = 1 if keep_rounded else 0
    if n == 1:
        compiled(arrays, grid, U, (*cols, 0, out, keep))
        return
    step = -(-out // n // TILE) * TILE
    runs = [(*cols, r, min(r + step, out), keep) for r in range(0, out, step)]
    for f in [_pool(n).submit(compiled, arrays, grid, U, c) for c in runs]:
        f.result()


def _pool(n: int):
    global _POOL
    if _POOL is None or _POOL._max_workers < n:
        from concurrent.futures import ThreadPoolExecutor

        _POOL = ThreadPoolExecutor(max_workers=n, thread_name_prefix="qk-gptq-sweep")
    return _POOL


def _compile() -> Callable:
    import numba

    @numba.njit(nogil=True, cache=True, fastmath={"contract"})
    def sweep_int(arrays, grid, U, cols):  # pragma: no cover - compiled
        """Columns i1 + i_from .. i1 + i_to of the block starting at column i1, rows r_from .. r_to (`cols` =
        (i1, i_from, i_to, r_from, r_to, keep)). `arrays` = (W, Q, E):
        W [out, in] updated in place (with keep = 1 each swept column keeps the value it was rounded from; with
        keep = 0 it is not written back, so Q may be W itself), Q [out, in] the dequantized codes, E [out, b]
        the errors over the factor's diagonal; `grid` = (S, Z, groups, lo, hi):
        the scales and zero points [out, groups] (Z of shape (0, 0): none), each column's group, the code
        range; U the block's [b, b] factor rows. A tile of TILE rows at a time is held transposed, so that every
        column's rounding and update runs along contiguous memory."""
        W, Q, E = arrays
        S, Z, groups, lo, hi = grid
        i1, i_from, i_to, r_from, r_to, keep = cols
        b = E.shape[1]
        has_z = Z.shape[0] > 0
        flo, fhi = np.float32(lo), np.float32(hi)
        T = np.empty((b, TILE), dtype=np.float32)  # [column, row of the tile]
        err = np.empty(TILE, dtype=np.float32)
        for r0 in range(r_from, r_to, TILE):
            m = min(TILE, r_to - r0)
            for j in range(i_from, b):
                for t in range(m):
                    T[j, t] = W[r0 + t, i1 + j]
            for i in range(i_from, i_to):
                c, d = i1 + i, U[i, i]
                g = groups[c]
                for t in range(m):
                    w, s = T[i, t], S[r0 + t, g]
                    k = np.rint(w / s)
                    if has_z:
                        z = Z[r0 + t, g]
                        q = (min(max(k + z, flo), fhi) - z) * s
                    else:
                        q = min(max(k, flo), fhi) * s
                    Q[r0 + t, c] = q
                    e = (w - q) / d
                    E[r0 + t, i] = e
                    err[t] = e
                for j in range(i + 1, b):  # the block's later columns, as torch's addr_ does it: w + (-u) * err
                    u = -U[i, j]
                    for t in range(m):
                        T[j, t] = T[j, t] + u * err[t]
            for j in range(i_from if keep else i_to, b):
                for t in range(m):
                    W[r0 + t, i1 + j] = T[j, t]

    f32 = np.float32
    probe = np.ones((2, 2), dtype=f32)  # compile now (or load the cache), so a failure shows here
    sweep_int((probe.copy(), probe.copy(), probe.copy()), (probe.copy(), np.zeros((0, 0), f32), np.zeros(2, np.int64),
              -8, 7), np.eye(2, dtype=f32), (0, 0, 2, 0, 2, 1))
    return sweep_int
