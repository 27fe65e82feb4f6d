"""quantkit.diagnostics.numerics.int8_gemm_int16_pairs: the emulation of oneDNN's s8s8 GEMM on a CPU without VNNI,
which tests/test_engine_numerics.py holds vLLM's output to there. Expectations are worked out by hand."""

from __future__ import annotations

import torch

from quantkit.diagnostics.numerics import int8_gemm_int16_pairs


def _i8(rows):
    return torch.tensor(rows, dtype=torch.int8)


def test_a_saturating_pair_is_clipped_to_int16_then_the_shift_is_undone():
    # codes 127, 127 -> unsigned 255, 255; with weights 127, 127 the pair is 2 * 255 * 127 = 64770 -> 32767;
    # undoing the shift takes 128 * 254 = 32512: 255, where the exact product is 2 * 127 * 127 = 32258
    assert int8_gemm_int16_pairs(_i8([[127, 127]]), _i8([[127, 127]])).tolist() == [[255]]
    # weights -128, -128: 2 * 255 * -128 = -65280 -> -32768; + 128 * 256 = 0 (exact: -32512)
    assert int8_gemm_int16_pairs(_i8([[127, 127]]), _i8([[-128, -128]])).tolist() == [[0]]
    # codes -128 -> unsigned 0: nothing saturates, the exact -2 * 128 * 127 = -32512
    assert int8_gemm_int16_pairs(_i8([[-128, -128]]), _i8([[127, 127]])).tolist() == [[-32512]]


def test_pairs_are_adjacent_k_and_only_the_saturating_one_is_off():
    a = _i8([[127, 127, 1, 2]])
    # pair (k0, k1): 64770 -> 32767; pair (k2, k3): 129 * 3 + 130 * 4 = 907; shift: 128 * (127 + 127 + 3 + 4) = 33408
    assert int8_gemm_int16_pairs(a, _i8([[127, 127, 3, 4]])).tolist() == [[32767 + 907 - 33408]]
    # the two large products in different pairs, each beside a zero: 255 * 127 + 128 * 0 = 32385 fits, so the
    # result is exact, 2 * 127 * 127 = 32258 (which k are paired decides what saturates)
    assert int8_gemm_int16_pairs(_i8([[127, 0, 127, 0]]), _i8([[127, 0, 127, 0]])).tolist() == [[32258]]


def test_odd_k_and_small_codes_give_the_exact_product():
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-20, 21, (5, 7), generator=g, dtype=torch.int8)  # |pair| <= 2 * 148 * 20: no saturation
    b = torch.randint(-20, 21, (3, 7), generator=g, dtype=torch.int8)
    exact = a.to(torch.int64) @ b.to(torch.int64).t()
    assert torch.equal(int8_gemm_int16_pairs(a, b, rows=2), exact)


def test_w8a8_avx2_weights_never_saturate_a_pair_where_w8a8_weights_do():
    """W8A8_AVX2 keeps weight codes in -64..63, so |a1 w1 + a2 w2| <= 255 x 128 < 32767 for any activation codes:
    the emulated non-VNNI GEMM is exact. Plain W8A8 codes reach +-127 and the same activations saturate."""
    from quantkit.algorithms.rtn import rtn
    from quantkit.schemes import get_scheme

    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 256, generator=g) * 0.05
    w[:, :8] *= 6  # outlier columns: each row's absmax sits in a pair with another large weight
    # worst case activations: every code at an extreme, plus random ones
    a = torch.cat([torch.full((1, 256), 127), torch.full((1, 256), -128),
                   torch.randint(-128, 128, (30, 256), generator=g)]).to(torch.int8)
    saturated = {}
    for name in ("W8A8_AVX2", "W8A8"):
        deq, qp = rtn(w, get_scheme(name).weights)
        codes = torch.round(deq / qp.scale).to(torch.int8)
        assert torch.equal(codes.float() * qp.scale, deq), "the weights are codes times their channel scale"
        exact = a.to(torch.int64) @ codes.to(torch.int64).t()
        saturated[name] = int((int8_gemm_int16_pairs(a, codes) != exact).sum())
        if name == "W8A8_AVX2":
            assert int(codes.min()) >= -64 and int(codes.max()) <= 63
            assert int(codes.abs().amax(dim=1).min()) >= 63, "every row still uses the narrowed range in full"
    assert saturated["W8A8_AVX2"] == 0
    assert saturated["W8A8"] > 0, saturated
