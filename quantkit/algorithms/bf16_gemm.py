"""bf16 x bf16 -> fp32 matrix products on the CPU, by the GEMM that torch's own library carries.

torch has no such product on the CPU (in 2.13 `mm`'s `out_dtype` form is CUDA-only and a bf16 `mm` rounds its
output to bf16), and oneDNN's bf16 mode for fp32 matmuls converts both fp32 operands to bf16 on every call,
which on 2 AMX cores held a Hessian's products to ~370 GFLOP/s (21% of the bf16 peak). torch's x86 CPU build
links Intel MKL and exports its `cblas_gemm_bf16bf16f32` (bf16 operands, fp32 sums and output), which reads
bf16 inputs as they are: a 4,096-token x 14,336-input Gram matrix ran at 830-1,060 GFLOP/s there, and within
4e-7 relative of a float64 product (fp32's own `mm` of the same inputs: 6e-7).

Only the product is ours to call; `available()` says whether this torch build has it (a CUDA, ARM or
non-MKL build may not), and the caller decides where it is worth using (quantkit/algorithms/gptq.py).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112  # CBLAS enum values
_INT_MAX = 2 ** 31 - 1  # MKL's LP64 interface: 32-bit sizes and strides


@functools.cache
def _gemm():
    """The C function, or None where torch's CPU library does not export it."""
    lib = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    try:
        fn = ctypes.CDLL(str(lib)).cblas_gemm_bf16bf16f32
    except (OSError, AttributeError):
        return None
    fn.restype = None
    fn.argtypes = ([ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                                         ctypes.c_float, ctypes.c_void_p, ctypes.c_int])
    return fn


def available() -> bool:
    """Whether torch's CPU library exports MKL's bf16 GEMM."""
    return _gemm() is not None


def _rows(t: torch.Tensor, dtype: torch.dtype, name: str) -> int:
    """t's row stride, after checking what the GEMM reads: a 2-D CPU tensor of `dtype` with unit column stride."""
    if t.dim() != 2 or t.dtype != dtype or t.device.type != "cpu" or (t.shape[1] > 1 and t.stride(1) != 1):
        raise ValueError(f"bf16_gemm: {name} must be a 2-D {dtype} CPU tensor with unit column stride, "
                         f"got {tuple(t.shape)} {t.dtype} strides {t.stride()} on {t.device}")
    stride = max(t.stride(0), t.shape[1], 1)
    if max(stride, *t.shape) > _INT_MAX:
        raise ValueError(f"bf16_gemm: {name} {tuple(t.shape)} exceeds the 32-bit sizes of MKL's LP64 interface")
    return stride


def gemm_tn(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = a^T b for a [k, m] and b [k, n] in bf16 (any row stride, unit column stride) into out [m, n] fp32
    (a view is fine: its rows may be those of a larger matrix). Every product of two bf16 numbers is exact in
    fp32; the sums are fp32. Raises where `available()` is False."""
    fn = _gemm()
    if fn is None:
        raise RuntimeError("bf16_gemm: this torch build exports no cblas_gemm_bf16bf16f32 (check available())")
    k, m = a.shape
    if b.shape[0] != k or tuple(out.shape) != (m, b.shape[1]):
        raise ValueError(f"bf16_gemm: shapes {tuple(a.shape)}^T x {tuple(b.shape)} -> {tuple(out.shape)} do not match")
    lda, ldb, ldc = _rows(a, torch.bfloat16, "a"), _rows(b, torch.bfloat16, "b"), _rows(out, torch.float32, "out")
    if k == 0:
        return out.zero_()
    if m and b.shape[1]:
        fn(_ROW_MAJOR, _TRANS, _NO_TRANS, m, b.shape[1], k, 1.0, a.data_ptr(), lda, b.data_ptr(), ldb, 0.0,
           out.data_ptr(), ldc)
    return out
