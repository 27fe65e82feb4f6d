"""Numerics on real math: SQNR floors, exact pack/unpack through compressed-tensors, GPTQ vs RTN,
determinism, Cholesky recovery."""

from __future__ import annotations

import json
import math

import pytest
import torch
from compressed_tensors.compressors import BaseCompressor

from quantkit.algorithms import bf16_gemm
from quantkit.algorithms.gptq import HessianAccumulator, gptq_quantize
from quantkit.algorithms.rtn import (check_divisible, compute_qparams, fake_quantize, fake_quantize_activations,
                                     dequantize_codes, output_sqnr_db, quantize_codes, rtn, sqnr_db)
from quantkit.export.compressed_tensors import compress_by_rows, compress_linear
from quantkit.schemes import SCHEMES, get_scheme


def _weight(out=256, inp=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g) * 0.02
    w[:, :4] *= 8  # a few outlier input channels, as trained LLMs have
    return w


def _inputs(n=2048, inp=512, seed=1):
    """Correlated, anisotropic activations: what a real layer sees, not white noise."""
    g = torch.Generator().manual_seed(seed)
    basis = torch.randn(inp, inp, generator=g) / math.sqrt(inp)
    scales = torch.logspace(0, -2, inp)
    return (torch.randn(n, inp, generator=g) * scales) @ basis * 3


# ~6 dB per bit, minus the cost of min/max scaling when 4 of 512 input channels are 8x larger (a whole
# row's or group's step is set by them). Measured: W8 32.5 dB, W4 g64 15.5 dB (asym 18.1), FP8 32.6 dB,
# NVFP4 (groups of 16) 20.3 dB, MXFP4 (groups of 32, power-of-two scales) 17.1 dB.
SQNR_FLOOR = {"W8A8": 31.0, "W8A8_AVX2": 25.0, "W8A16": 31.0, "W4A16": 14.5, "W4A16_ASYM": 17.0, "FP8_DYNAMIC": 31.0,
              "NVFP4A16": 19.5, "MXFP4A16": 16.3}  # W8A8_AVX2: one bit (6 dB) under W8A8


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_rtn_sqnr_floor(name):
    spec = get_scheme(name).with_overrides(group_size=64 if "W4" in name else None).weights
    w = _weight()
    deq, _ = rtn(w, spec)
    assert sqnr_db(w, deq) > SQNR_FLOOR[name]


def test_group_beats_channel_and_clip_search_helps():
    w = _weight()
    ch = get_scheme("W4A16").with_overrides(group_size=-1).weights
    g64 = get_scheme("W4A16").with_overrides(group_size=64).weights
    assert sqnr_db(w, rtn(w, g64)[0]) > sqnr_db(w, rtn(w, ch)[0]) + 3
    plain = sqnr_db(w, rtn(w, g64)[0])
    clipped = sqnr_db(w, rtn(w, g64, clip_search=True)[0])
    assert clipped > plain


def test_codes_in_range_and_scales_exact_in_bf16():
    for name in ("W4A16", "W4A16_ASYM", "W8A8"):
        spec = get_scheme(name).with_overrides(group_size=64 if "W4" in name else None).weights
        qp = compute_qparams(_weight(), spec)
        assert torch.equal(qp.scale, qp.scale.to(torch.bfloat16).float())
        if qp.zero_point is not None:
            assert qp.zero_point.min() >= spec.qmin and qp.zero_point.max() <= spec.qmax
            assert torch.equal(qp.zero_point, qp.zero_point.round())


@pytest.mark.parametrize("name, group", [("W4A16", 64), ("W4A16_ASYM", 32), ("W8A8", None), ("W8A16", None),
                                         ("FP8_DYNAMIC", None), ("W4A16", -1)])
def test_pack_unpack_is_exact(name, group):
    """What compressed-tensors decompresses from the packed checkpoint tensors is our dequantized weight
    (in the storage dtype: codes x bf16 scale is exact in fp32 and rounds the same way in both)."""
    scheme = get_scheme(name).with_overrides(group_size=group)
    w = _weight(128, 256)
    deq, qp = rtn(w, scheme.weights)
    ct = scheme.to_compressed_tensors(["Linear"])
    packed = compress_linear("m", deq, qp.scale, qp.zero_point, None, ct, torch.bfloat16)
    local = {k[2:]: v for k, v in packed.items()}
    if scheme.format == "pack-quantized":
        assert local["weight_packed"].dtype == torch.int32
        assert local["weight_packed"].shape == (128, 256 * scheme.weights.num_bits // 32)
    restored = BaseCompressor.get_value_from_registry(scheme.format).decompress(local, ct)["weight"]
    assert restored.dtype == torch.bfloat16
    assert torch.equal(restored, deq.to(torch.bfloat16))


@pytest.mark.parametrize("name, with_g_idx", [(n, False) for n in sorted(SCHEMES)] +
                         [(n, True) for n in sorted(SCHEMES) if SCHEMES[n].weights.strategy == "group"])
def test_compressing_by_row_blocks_gives_the_whole_weights_tensors(name, with_g_idx):
    """The export compresses a block of rows at a time: every tensor is bit for bit what one call on the whole
    weight gives, in every scheme, with blocks of 64 rows over 200 (the last one short, its zero points a
    partly filled int32), and with a g_idx (group act-order: columns in permuted groups)."""
    scheme = get_scheme(name)
    spec = scheme.weights
    w = _weight(200, 256)
    deq, qp = rtn(w, spec)
    g_idx = None
    if with_g_idx:  # scales of groups of permuted columns, each column dequantized with its group's
        g_idx = (torch.randperm(256, generator=torch.Generator().manual_seed(1)) // qp.group_size).to(torch.int32)
        s_cols = qp.scale[:, g_idx.long()]
        z_cols = qp.zero_point[:, g_idx.long()] if qp.zero_point is not None else None
        deq = dequantize_codes(quantize_codes(w, s_cols, z_cols, spec), s_cols, z_cols, spec)
    ct = scheme.to_compressed_tensors(["Linear"])
    whole = compress_linear("m", deq, qp.scale, qp.zero_point, g_idx, ct, torch.bfloat16, qp.global_scale)
    zp = qp.zero_point
    blocks = compress_by_rows("m", (200, 256), lambda r: (deq[r], qp.scale[r], zp[r] if zp is not None else None),
                              g_idx, ct, torch.bfloat16, qp.global_scale, block_rows=64)
    assert whole.keys() == blocks.keys()
    for k in whole:
        assert whole[k].dtype == blocks[k].dtype and torch.equal(whole[k], blocks[k]), k


def test_group_size_must_divide():
    spec = get_scheme("W4A16").weights  # group 128
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.q_proj: in_features 576 is not divisible by "
                                         r"group_size 128; use group_size 64"):
        check_divisible(spec, 576, "model.layers.0.self_attn.q_proj")


def test_activation_fake_quant_per_token():
    x = torch.randn(3, 5, 64)
    x[0, 0, 0] = 50.0  # an outlier only affects its own token
    spec = get_scheme("W8A8").activations
    y = fake_quantize_activations(x, spec)
    assert sqnr_db(x[1:], y[1:]) > 35
    tok = x[0, 0]
    step = tok.abs().max() / 127
    assert (y[0, 0] - tok).abs().max() <= step / 2 + 1e-6


def _layer_loss(X, W, Q):
    return float(((X @ W.t() - X @ Q.t()) ** 2).mean())


@pytest.mark.parametrize("actorder", ["none", "static", "group"])
@pytest.mark.parametrize("name", ["W4A16", "W4A16_ASYM", "W8A8"])
def test_gptq_beats_rtn_on_layer_loss(actorder, name):
    spec = get_scheme(name).with_overrides(group_size=64 if "W4" in name else None).weights
    W, X = _weight(), _inputs()
    acc = HessianAccumulator(W.shape[1])
    for chunk in X.split(500):
        acc.add(chunk)
    assert torch.allclose(acc.H, 2 * X.t() @ X / X.shape[0], rtol=1e-4, atol=1e-5)
    res = gptq_quantize(W, acc.H, spec, block_size=128, actorder=actorder)
    rtn_q, _ = rtn(W, spec)
    assert _layer_loss(X, W, res.weight) < 0.8 * _layer_loss(X, W, rtn_q)
    # the result is on the quantization grid its own parameters describe
    assert torch.equal(fake_quantize(res.weight, res.qparams, spec, res.g_idx), res.weight)
    assert (res.g_idx is not None) == (actorder == "group")


@pytest.mark.parametrize("span", [1, 3])  # one block at a time; spans of 3 blocks, the last span ragged
def test_gptq_sweep_by_spans_of_blocks_is_the_same_update(monkeypatch, span):
    """Sweeping static groups a span of blocks at a time (the columns after a span take its errors in one
    product) is GPTQ's update in another order of fp32 sums: against one block at a time in float64 arithmetic
    (the same factor, made float64, and the weight swept in float64 by the torch loop) the loss agrees within
    1e-5 and fewer than 1% of the codes sit on the other side of a rounding edge."""
    import dataclasses

    from quantkit.algorithms import gptq

    spec = get_scheme("W4A16").with_overrides(group_size=32).weights
    W, X = _weight(128, 320), _inputs(1200, 320)  # 320 inputs: blocks of 64 make 5, spans of 3 make 2
    f = gptq.gptq_factor(2 * X.t() @ X / X.shape[0])
    monkeypatch.setattr(gptq, "SPAN_BLOCKS", span)
    monkeypatch.setattr(gptq, "SPAN_FROM", 256)  # (spans from 4,096 inputs in the pipeline)
    res = gptq.gptq_solve(W, f, spec, block_size=64)
    monkeypatch.setattr(gptq, "SPAN_BLOCKS", 1)
    monkeypatch.setattr(gptq.sweep_kernel, "kernel", lambda: None)  # the torch loop, which runs in float64 too
    monkeypatch.setattr(gptq, "_fp32_stack", lambda ws: (torch.cat([w.double() for w in ws]),
                                                        [(0, w.shape[0]) for w in ws]))
    exact = gptq.gptq_solve(W.double(), dataclasses.replace(f, upper=f.upper.double()), spec, block_size=64)
    assert exact.weight.dtype == torch.float64
    assert float(res.loss.sum()) == pytest.approx(float(exact.loss.sum()), rel=1e-5)
    assert (res.weight.double() != exact.weight).double().mean() < 0.01


@pytest.mark.parametrize("slab", [2048, 100])  # H in one slab; in five, the last one ragged
def test_output_sqnr_from_hessian_equals_the_direct_one(monkeypatch, slab):
    """The manifest's output SQNR comes from H; it must equal the SQNR of X W^T vs X Q^T over the same X."""
    from quantkit.algorithms import rtn as rtn_module

    monkeypatch.setattr(rtn_module, "SQNR_SLAB", slab)
    W, X = _weight(), _inputs()
    spec = get_scheme("W4A16").with_overrides(group_size=64).weights
    Q, _ = rtn(W, spec)
    acc = HessianAccumulator(W.shape[1])
    acc.add(X)
    direct = sqnr_db(X @ W.t(), X @ Q.t())
    assert output_sqnr_db(W, Q, acc.H) == pytest.approx(direct, abs=0.01)
    assert output_sqnr_db(W, Q, acc.H, torch.bfloat16) == pytest.approx(direct, abs=0.05)  # the bf16 products
    assert output_sqnr_db(W, W, acc.H) == float("inf")


@pytest.mark.parametrize("actorder", ["none", "static"])
def test_gptq_factor_is_the_inverse_hessians_cholesky_factor(actorder):
    """U (in the activation order) is the upper triangular, positive-diagonal factor with U^T U = (H + d I)^-1,
    checked against float64 inverse and Cholesky; and the sweep's loss is the output error it claims: with W - Q = E U,
    (W - Q)(H + d I)(W - Q)^T = E E^T, so 2 x the summed loss equals the damped output error exactly."""
    from quantkit.algorithms.gptq import gptq_factor

    W, X = _weight(), _inputs()
    H = 2 * X.t() @ X / X.shape[0]
    f = gptq_factor(H, 0.01, actorder)
    p = f.perm if f.perm is not None else torch.arange(H.shape[0])
    Hd = H.double()[p][:, p] + f.damping * torch.eye(H.shape[0], dtype=torch.float64)
    U = f.U.double()
    assert torch.equal(torch.triu(f.U), f.U) and bool((torch.diagonal(f.U) > 0).all())
    want = torch.linalg.cholesky(torch.linalg.inv(Hd), upper=True)  # unique: the float64 reference
    assert float((U - want).abs().max()) < 1e-4 * float(want.abs().max())  # fp32 here, condition number ~1e3
    spec = get_scheme("W4A16").with_overrides(group_size=64).weights
    res = gptq_quantize(W, H, spec, actorder=actorder)
    D = (W - res.weight).double()[:, p]
    assert 2 * float(res.loss.double().sum()) == pytest.approx(float(((D @ Hd) * D).sum()), rel=1e-3)


def test_gptq_is_deterministic():
    W, X = _weight(), _inputs()
    H = 2 * X.t() @ X / X.shape[0]
    spec = get_scheme("W4A16").with_overrides(group_size=64).weights
    a = gptq_quantize(W, H, spec, actorder="group")
    b = gptq_quantize(W, H, spec, actorder="group")
    assert torch.equal(a.weight, b.weight) and torch.equal(a.qparams.scale, b.qparams.scale)


def test_gptq_recovers_from_cholesky_failure():
    """Rank-deficient H (fewer tokens than features) with a tiny damping factor fails Cholesky at first."""
    W = _weight(64, 256)
    X = _inputs(n=16, inp=256)
    H = 2 * X.t() @ X / X.shape[0]
    H[10, :] = 0
    H[:, 10] = 0  # a dead input channel
    spec = get_scheme("W4A16").with_overrides(group_size=64).weights
    res = gptq_quantize(W, H, spec, dampening_frac=1e-9)
    base = 1e-9 * float(torch.diag(H).mean())
    assert res.damping > base * 5  # raised at least once, and recorded
    assert torch.isfinite(res.weight).all()
    assert torch.all(res.weight[:, 10] == 0)  # dead column zeroed


@pytest.mark.parametrize("name, group, actorder", [("W4A16", 64, None), ("W4A16_ASYM", 32, None), ("W8A8", None, None),
                                                   ("FP8_DYNAMIC", None, None), ("W4A16", 32, "group")])
def test_typed_result_round_trips_through_the_work_folder_form(name, group, actorder, tmp_path):
    """The work folder stores codes (1 byte each), scales, zero points and g_idx; decoding gives back the
    exact dequantized weight and parameters, and a weight off its own grid is refused."""
    from safetensors.torch import load_file

    from quantkit.algorithms.registry import QUANTIZERS
    from quantkit.plan import ConvertError, LayerPlan, PlanStage, Target
    from quantkit.algorithms.contract import ModuleResult, QuantizedWeight
    from quantkit.quantize.workdir import decode_layer, save_typed

    scheme = get_scheme(name).with_overrides(group_size=group)
    w = _weight(64, 128)
    if actorder:  # GPTQ's act-order result carries a permuted g_idx
        X = _inputs(512, 128)
        res = gptq_quantize(w, X.t() @ X, scheme.weights, actorder=actorder)
        q = QuantizedWeight(res.weight, res.qparams.scale, res.qparams.zero_point, res.g_idx)
        assert q.g_idx is not None and not torch.equal(q.columns(), torch.arange(128) // group)
    else:
        deq, qp = rtn(w, scheme.weights)
        q = QuantizedWeight(deq, qp.scale, qp.zero_point)
    norm = torch.rand(128).to(torch.bfloat16)
    rtn_entry = QUANTIZERS["rtn"]
    t = Target("m.proj", PlanStage(0, None, rtn_entry, scheme), rtn_entry)
    path = tmp_path / "00000.safetensors"
    save_typed(path, [ModuleResult("m.proj", {}, q, scheme.weights, {"m.norm.weight": norm})])
    stored = load_file(str(path))
    assert stored["m.proj.codes"].dtype == (torch.float8_e4m3fn if scheme.weights.type == "float" else torch.int8)
    assert stored["m.proj.codes"].shape == (64, 128)
    weights, rewritten = decode_layer(stored, LayerPlan(0, "m.", groups=[[t]]))
    back = weights["m.proj"]
    assert torch.equal(back.weight, q.weight) and torch.equal(back.scale, q.scale.float())
    assert (back.zero_point is None) == (q.zero_point is None)
    if q.zero_point is not None:
        assert torch.equal(back.zero_point, q.zero_point.float())
    assert (back.g_idx is None) == (q.g_idx is None) and torch.equal(back.columns(), q.columns())
    assert rewritten.keys() == {"m.norm.weight"} and torch.equal(rewritten["m.norm.weight"], norm)

    off = QuantizedWeight(q.weight + 0.3 * q.scale.float()[:, q.columns()], q.scale, q.zero_point, q.g_idx)
    with pytest.raises(ConvertError, match="m.proj: the quantized weight is not on its own grid"):
        save_typed(tmp_path / "00001.safetensors", [ModuleResult("m.proj", {}, off, scheme.weights)])


@pytest.mark.parametrize("slab", [1024, 32, 40])  # one slab; slabs dividing in (96); a ragged last slab
def test_hessian_by_slabs_is_the_symmetric_gram_matrix(monkeypatch, slab):
    """However H's rows are cut into slabs, the accumulator gives 2/n X^T X (against float64), exactly
    symmetric; adding chunks here and folding the partials another process would send agree bit for bit."""
    from quantkit.algorithms import gptq

    monkeypatch.setattr(gptq, "SLAB_ROWS", slab)
    X = _inputs(700, 96)
    ref = 2 * X.double().t() @ X.double() / X.shape[0]
    here, elsewhere, folded = HessianAccumulator(96), HessianAccumulator(96), HessianAccumulator(96)
    for chunk in X.split(256):
        here.add(chunk)
        part, n = elsewhere.partial(chunk)
        folded.fold(part.clone(), n)
    H = here.H
    assert torch.equal(H, H.t()) and torch.equal(H, folded.H)
    assert torch.allclose(H.double(), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_narrow_hessians_take_narrow_slabs(monkeypatch, dtype):
    """Up to NARROW_INPUTS inputs H is made by slabs of NARROW_SLAB_ROWS rows (less of each diagonal block
    computed for nothing), wider ones by SLAB_ROWS; either way H is 2/n X^T X against float64."""
    from quantkit.algorithms import gptq

    monkeypatch.setattr(gptq, "_mkl_bf16_gemm", lambda: False)  # the torch paths (AMX CPUs take MKL's GEMM)
    rows = []
    real_mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b: (rows.append(a.shape[0]), real_mm(a, b))[1])
    for n, slab in ((gptq.NARROW_INPUTS, gptq.NARROW_SLAB_ROWS), (gptq.NARROW_INPUTS + 64, gptq.SLAB_ROWS)):
        rows.clear()
        X = (torch.randn(16, n, generator=torch.Generator().manual_seed(n)) * 2).to(dtype)
        acc = HessianAccumulator(n)
        acc.add(X)
        assert max(rows) == slab and len(rows) >= n // slab  # slabs of that height, every one of them
        ref = 2 * X.double().t() @ X.double() / X.shape[0]
        assert torch.allclose(acc.H.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


@pytest.mark.parametrize("n", [256, 190])  # bands of two slabs: 4 x 64, and 64 + 64 + 62 with a ragged last slab
def test_bf16_inputs_hessian_holds_a_quarter_of_them_in_fp32(monkeypatch, n):
    """Inputs that are not fp32 are made fp32 a band of at most a quarter of their columns (whole slabs) at a
    time: no product reads more than one band's columns, and H is still 2/n X^T X against float64, exactly
    symmetric, and the same bit for bit whether the chunks are added here or folded from partials."""
    from quantkit.algorithms import gptq

    monkeypatch.setattr(gptq, "SLAB_ROWS", 32)
    monkeypatch.setattr(gptq, "BAND_BYTES", 0)  # (a band may be wider where it stays within BAND_BYTES)
    monkeypatch.setattr(gptq, "_mkl_bf16_gemm", lambda: False)  # the torch path (AMX CPUs take MKL's GEMM)
    widths = []
    real_mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b: (widths.append(b.shape[1]), real_mm(a, b))[1])
    X = (_inputs(600, n) * 3).to(torch.bfloat16)
    ref = 2 * X.double().t() @ X.double() / X.shape[0]
    here, elsewhere, folded = HessianAccumulator(n), HessianAccumulator(n), HessianAccumulator(n)
    for chunk in X.split(256):
        here.add(chunk)
        part, k = elsewhere.partial(chunk)
        folded.fold(part.clone(), k)
    assert widths and max(widths) == 64  # one band: whole 32-row slabs covering a quarter of n (64 or 47.5)
    H = here.H
    assert torch.equal(H, H.t()) and torch.equal(H, folded.H)
    assert torch.allclose(H.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_bf16_inputs_hessian_runs_on_bf16_products_with_fp32_sums(monkeypatch, dtype):
    """bf16 calibration inputs (bf16 compute) have their Hessian products made on bf16 dot products (oneDNN's
    bf16 mode for fp32 matmuls), fp32 inputs never; either way H is 2/n X^T X within 1e-5 of a float64 sum of
    the same inputs (bf16 products are exact in fp32, only the sums round), and the mode is put back after.
    The path is forced here so it is checked on a CPU without native bf16 too (oneDNN then computes in fp32)."""
    from quantkit.algorithms import gptq

    monkeypatch.setattr(gptq, "_cpu_bf16_dots", lambda: True)
    monkeypatch.setattr(gptq, "_mkl_bf16_gemm", lambda: False)  # the oneDNN path (AMX CPUs take MKL's GEMM)
    modes = []
    real_mm = torch.mm

    def spy(a, b):
        modes.append(torch.backends.mkldnn.matmul.fp32_precision)
        return real_mm(a, b)

    monkeypatch.setattr(torch, "mm", spy)
    before = torch.backends.mkldnn.matmul.fp32_precision
    X = (_inputs(1500, 640) * 3).to(dtype)  # 640 inputs: two slabs, one ragged
    acc = HessianAccumulator(640)
    for chunk in X.split(512):
        acc.add(chunk)
    ref = 2 * X.double().t() @ X.double() / X.shape[0]
    assert modes and set(modes) == {"bf16" if dtype == torch.bfloat16 else before}
    assert torch.backends.mkldnn.matmul.fp32_precision == before
    err = ((acc.H.double() - ref).abs().max() / ref.abs().max()).item()
    assert err < 1e-5, err


@pytest.mark.skipif(not bf16_gemm.available(), reason="this torch build exports no MKL bf16 GEMM")
@pytest.mark.parametrize("n", [640, 96])  # two slabs, the second ragged; one slab
def test_bf16_hessian_by_mkls_bf16_gemm(monkeypatch, n):
    """The AMX path for bf16 inputs (forced here, so it runs on any CPU: MKL computes the same products without
    AMX, only slower): H is 2/n X^T X within 1e-5 of a float64 sum, exactly symmetric, the same bits whether
    chunks are added here or folded from partials, and the same as oneDNN's bf16 path would give within fp32
    rounding; no fp32 copy of the inputs is made (no torch product runs at all)."""
    from quantkit.algorithms import gptq

    monkeypatch.setattr(gptq, "_cpu_bf16_dots", lambda: True)
    monkeypatch.setattr(gptq, "_mkl_bf16_gemm", lambda: True)
    real_mm = torch.mm
    calls = []
    monkeypatch.setattr(torch, "mm", lambda a, b: (calls.append(a.dtype), real_mm(a, b))[1])
    X = (_inputs(1500, n) * 3).to(torch.bfloat16)
    here, elsewhere, folded = HessianAccumulator(n), HessianAccumulator(n), HessianAccumulator(n)
    for chunk in X.split(512):
        here.add(chunk)
        part, k = elsewhere.partial(chunk)
        assert torch.equal(part.triu(1), torch.zeros_like(part))  # a partial is its lower triangle, the rest 0
        folded.fold(part.clone(), k)
    assert not calls
    ref = 2 * X.double().t() @ X.double() / X.shape[0]
    H = here.H
    assert torch.equal(H, H.t()) and torch.equal(H, folded.H)
    err = ((H.double() - ref).abs().max() / ref.abs().max()).item()
    assert err < 1e-5, err


@pytest.mark.skipif(not bf16_gemm.available(), reason="this torch build exports no MKL bf16 GEMM")
def test_bf16_gemm_writes_a_view_of_a_larger_matrix_with_fp32_sums():
    """gemm_tn: a^T b from strided bf16 column blocks into a block of a larger fp32 matrix, against float64 (bf16
    products are exact in fp32; only the sums round), leaving the rest of that matrix untouched; shapes and
    dtypes it cannot read are refused by name."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(300, 200, generator=g) * 4).to(torch.bfloat16)
    big = torch.full((150, 260), 7.0)
    out = bf16_gemm.gemm_tn(x[:, 10:60], x[:, 20:200], big[40:90, 5:185])
    ref = x[:, 10:60].double().t() @ x[:, 20:200].double()
    assert out.data_ptr() == big[40:90, 5:185].data_ptr()
    err = ((big[40:90, 5:185].double() - ref).abs().max() / ref.abs().max()).item()
    assert err < 1e-6, err
    rest = big.clone()
    rest[40:90, 5:185] = 7.0
    assert torch.equal(rest, torch.full((150, 260), 7.0))
    assert torch.equal(bf16_gemm.gemm_tn(x[:0, :3], x[:0, :4], torch.ones(3, 4)), torch.zeros(3, 4))
    with pytest.raises(ValueError, match="a must be a 2-D torch.bfloat16"):
        bf16_gemm.gemm_tn(x.float(), x, torch.empty(200, 200))
    with pytest.raises(ValueError, match="out must be a 2-D torch.float32"):
        bf16_gemm.gemm_tn(x, x, torch.empty(200, 200, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="do not match"):
        bf16_gemm.gemm_tn(x, x[:10], torch.empty(200, 200))


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_a_schemes_stored_bytes_are_what_its_export_writes(name, tmp_path, tiny_llama):
    """WeightSpec.stored_bytes (what sensitivity's size budget counts) against the bytes the export really
    writes for one Linear: every tensor of that module in the safetensors file."""
    from safetensors import safe_open

    from conftest import tiny_recipe, write_recipe
    from quantkit import api
    from quantkit.recipe import load_recipe

    scheme = get_scheme(name)
    stage = {"method": "rtn", "scheme": name}
    if scheme.weights.strategy == "group" and scheme.weights.scale_format == "model":
        stage["group_size"] = 32
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", tiny_recipe(tiny_llama, None, [stage])), [])
    out = api.convert(recipe, tmp_path / "out", quiet=True)
    prefix = "model.layers.0.mlp.down_proj."
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        # the weight's tensors; weight_shape is bookkeeping compressed-tensors adds (two int64s), not weight data
        names = [k for k in f.keys() if k.startswith(prefix) and "input" not in k and not k.endswith("weight_shape")]
        written = sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in names)
    cfg = json.loads((tiny_llama / "config.json").read_text())
    spec = scheme.with_overrides(group_size=stage.get("group_size")).weights
    assert spec.stored_bytes(cfg["hidden_size"], cfg["intermediate_size"], 2) == written, names


@pytest.mark.parametrize("actorder", ["none", "static", "group"])
def test_gptq_output_noise_is_the_hessian_weighted_error(actorder):
    """GPTQ's reported output noise (from its own losses) against tr(D H D^T) computed in float64 from the
    inputs, D = W - Q: equal to 1e-5 relative, a dead input column included (H zero there)."""
    X = _inputs(3000, 192)
    X[:, 5] = 0.0
    W = _weight(128, 192)
    H = 2 * X.t() @ X / X.shape[0]
    spec = get_scheme("W4A16").with_overrides(group_size=64).weights
    res = gptq_quantize(W, H, spec, actorder=actorder)
    D = (W - res.weight).double()
    expected = float(((X.double() @ D.t()) ** 2).sum() * 2 / X.shape[0])
    assert res.noise == pytest.approx(expected, rel=1e-5)  # 1e-5 of the noise: 4e-5 dB of SQNR


def test_gptq_factor_made_in_the_hessians_buffer_is_the_same_factor():
    """consume=True: the factor lives in H's own storage afterwards, and it and the sweep's result are bit for bit
    those made from a copy; also where the first dampening fails and the buffer is made again from what the
    factorisation left untouched (a rank-deficient H: 40 tokens for 96 inputs, a tiny dampening)."""
    from quantkit.algorithms.gptq import gptq_factor, gptq_solve

    spec = get_scheme("W4A16").with_overrides(group_size=32).weights
    for X, frac in ((_inputs(2000, 96), 0.01), (_inputs(40, 96), 1e-9)):
        H = 2 * X.t() @ X / X.shape[0]
        kept = H.clone()
        copy = gptq_factor(H, frac, "static")
        assert torch.equal(H, kept)  # not consumed: untouched
        inplace = gptq_factor(H, frac, "static", consume=True)
        assert inplace.upper.data_ptr() == H.data_ptr()
        assert torch.equal(inplace.U, copy.U) and inplace.damping == copy.damping
        assert torch.equal(inplace.U, torch.triu(inplace.U))
        W = _weight(64, 96)
        assert torch.equal(gptq_solve(W, inplace, spec).weight, gptq_solve(W, copy, spec).weight)
    assert copy.damping > 1e-9 * torch.diagonal(kept).mean().item() * 5  # the rank-deficient case did retry


def _sweep_cases():
    """(spec, actorder) pairs the compiled sweep runs: int4 groups (symmetric, asymmetric), int8 channels, and
    group act-order, whose scales are chosen on the way."""
    from quantkit.schemes import WeightSpec

    g4 = WeightSpec(4, "int", True, "group", 64)
    return [(g4, "static"), (WeightSpec(4, "int", False, "group", 64), "none"),
            (WeightSpec(8, "int", True, "channel"), "static"), (g4, "group")]


@pytest.mark.parametrize("case", range(4))
def test_compiled_sweep_makes_the_torch_loops_codes(monkeypatch, case):
    """The compiled column sweep (sweep_kernel) against GPTQ's torch loop on the same weight and Hessian:
    every code the same, the error-compensated weights within 1e-6 relative (the update's rounding may differ
    where torch's loop leaves its vector path), and both below round-to-nearest's output error."""
    from quantkit.algorithms import gptq, sweep_kernel

    if sweep_kernel.kernel() is None:
        pytest.skip("numba is not installed here: GPTQ runs its torch loop only")
    spec, actorder = _sweep_cases()[case]
    W, X = _weight(200, 256), _inputs(1024, 256)  # 200 rows: torch's vector loop has a scalar tail
    H = 2 * X.t() @ X / X.shape[0]
    compiled = gptq.gptq_solve(W, gptq.gptq_factor(H, actorder=actorder), spec, 64, actorder)
    monkeypatch.setattr(sweep_kernel, "kernel", lambda: None)
    looped = gptq.gptq_solve(W, gptq.gptq_factor(H, actorder=actorder), spec, 64, actorder)
    assert torch.equal(compiled.weight, looped.weight)
    assert torch.equal(compiled.qparams.scale, looped.qparams.scale)
    assert torch.allclose(compiled.rounded, looped.rounded, rtol=1e-6, atol=1e-6 * W.abs().max().item())
    assert compiled.noise == pytest.approx(looped.noise, rel=1e-5)
    D = W - rtn(W, spec)[0]
    assert compiled.noise < torch.trace(D @ H @ D.t()).item()


@pytest.mark.parametrize("rows", [[128, 64, 192], [100, 37]])  # stackable; not (a member off the 64-row grid)
@pytest.mark.parametrize("compiled", [True, False])
def test_weights_swept_together_get_what_each_gets_alone(monkeypatch, rows, compiled):
    """GPTQ's rows are independent: weights sharing a factor and swept as one stack (q/k/v, gate/up) get, bit
    for bit, the codes, scales, error-compensated weights and losses each gets alone, whichever loop runs
    (processes split a group's weights between them and must agree with one process)."""
    from quantkit.algorithms import gptq, sweep_kernel
    from quantkit.schemes import WeightSpec

    if not compiled:
        monkeypatch.setattr(sweep_kernel, "kernel", lambda: None)
    spec = WeightSpec(4, "int", True, "group", 64)
    X = _inputs(1024, 192)
    f = gptq.gptq_factor(2 * X.t() @ X / X.shape[0])
    weights = [_weight(r, 192, seed=k).to(torch.bfloat16) for k, r in enumerate(rows)]
    together = gptq.gptq_solve_stacked(weights, f, spec, 64)
    for w, t in zip(weights, together):
        alone = gptq.gptq_solve(w, f, spec, 64)
        assert t.weight.shape == w.shape
        for a, b in [(t.weight, alone.weight), (t.rounded, alone.rounded), (t.loss, alone.loss),
                     (t.qparams.scale, alone.qparams.scale)]:
            assert torch.equal(a, b)
        assert t.noise == alone.noise


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("case", range(4))
def test_a_sweep_that_keeps_no_rounded_copy_gets_the_same_result(monkeypatch, case, compiled):
    """keep_rounded=False (the pipeline's GPTQ: the result written over the weight's fp32 copy, no second
    [out, in] buffer) against the sweep that keeps both: codes, scales, losses and output noise bit for bit the
    same, for every act-order, a stack of weights and a member off the 64-row grid, whichever loop runs."""
    from quantkit.algorithms import gptq, sweep_kernel

    if compiled and sweep_kernel.kernel() is None:
        pytest.skip("numba is not installed here: GPTQ runs its torch loop only")
    if not compiled:
        monkeypatch.setattr(sweep_kernel, "kernel", lambda: None)
    spec, actorder = _sweep_cases()[case]
    X = _inputs(1024, 256)
    weights = [_weight(r, 256, seed=k).to(torch.bfloat16) for k, r in enumerate([128, 72])]
    results = {}
    for keep in (True, False):
        f = gptq.gptq_factor(2 * X.t() @ X / X.shape[0], actorder=actorder)
        results[keep] = gptq.gptq_solve_stacked(weights, f, spec, 64, actorder, keep_rounded=keep)
    for kept, lean, w in zip(results[True], results[False], weights):
        assert lean.rounded is None and kept.rounded is not None and lean.weight.shape == w.shape
        # the two differ, so a lean sweep that wrote the rounded values back would show below
        assert not torch.equal(kept.rounded, kept.weight)
        for a, b in [(kept.weight, lean.weight), (kept.qparams.scale, lean.qparams.scale), (kept.loss, lean.loss)]:
            assert torch.equal(a, b)
        assert (kept.g_idx is None) == (lean.g_idx is None)
        if kept.g_idx is not None:
            assert torch.equal(kept.g_idx, lean.g_idx)
        assert kept.noise == lean.noise


def test_compiled_sweep_split_across_threads_is_the_same_sweep(monkeypatch):
    """The compiled sweep's rows dealt to threads (whole tiles each, a ragged last one) give the bits one
    thread gives: GPTQ's rows are independent, and no thread writes another's rows."""
    import numpy as np

    from quantkit.algorithms import sweep_kernel

    compiled = sweep_kernel.kernel()
    if compiled is None:
        pytest.skip("numba is not installed here: GPTQ runs its torch loop only")
    monkeypatch.setattr(sweep_kernel, "PARALLEL_ROWS", 64)
    g = torch.Generator().manual_seed(3)
    out, width, b = 300, 256, 128
    U = (torch.randn(b, b, generator=g) * 0.1).triu_() + torch.eye(b) * 2
    S = torch.rand(out, width // 64, generator=g) * 0.05 + 0.01
    groups = (torch.arange(width) // 64).numpy()
    results = []
    for threads in (1, 3):
        W = torch.randn(out, width, generator=torch.Generator().manual_seed(4))
        Q, E = torch.zeros_like(W), torch.empty(out, b)
        sweep_kernel.sweep(compiled, (W.numpy(), Q.numpy(), E.numpy()),
                           (S.numpy(), np.zeros((0, 0), np.float32), groups, -8, 7), U.numpy(), (64, 0, b), threads)
        results.append((W, Q, E))
    (W1, Q1, E1), (W3, Q3, E3) = results
    assert torch.equal(W1, W3) and torch.equal(Q1, Q3) and torch.equal(E1, E3)
    assert Q1[:, 64:192].abs().gt(0).any() and not Q1[:, :64].any()  # the block's columns were swept, no others


@pytest.mark.parametrize("shape", [(300, 1000), (3000, 1500), (7,)])  # one block, several blocks (ragged), a vector
def test_weight_sqnr_matches_a_float64_sum(shape):
    """sqnr_db (row norms in fp32, summed in float64) against the whole sum taken in float64: within 1e-4 dB,
    for a bf16 reference against its fp32 approximation and for float64 inputs."""
    g = torch.Generator().manual_seed(5)
    ref = (torch.randn(*shape, generator=g) * 3).to(torch.bfloat16)
    approx = ref.float() + torch.randn(*shape, generator=g) * 0.02
    exact = 10 * math.log10((ref.double() ** 2).sum().item() / ((ref.double() - approx.double()) ** 2).sum().item())
    assert sqnr_db(ref, approx) == pytest.approx(exact, abs=1e-4)
    assert sqnr_db(ref.double(), approx.double()) == pytest.approx(exact, abs=1e-9)
    assert sqnr_db(ref, ref.float()) == float("inf")


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-3)])
def test_output_energies_from_the_inputs_are_the_hessians(dtype, tol):
    """GroupInputs measures each member's output energy |X W^T|^2 chunk by chunk where there are no more tokens
    than inputs; at H's scale (2/n) it is tr(W H W^T), against float64 from the same inputs and weights (bf16:
    the products' outputs are rounded to bf16 before they are squared), and summed over chunks in fp64."""
    from quantkit.distributed import ChunkLayout
    from quantkit.quantize.layers import GroupInputs

    g = torch.Generator().manual_seed(5)
    X = (_inputs(3 * 40, 160) * 2).to(dtype)  # 120 tokens in 3 chunks of 40, 160 inputs
    mods = [torch.nn.Linear(160, out, bias=False).to(dtype) for out in (48, 200)]
    for m in mods:
        m.weight.data = (torch.randn(m.weight.shape, generator=g) * 0.05).to(dtype)
    gi = GroupInputs(True, ChunkLayout.of(3, 1, 40), signal_of=[("a", mods[0]), ("b", mods[1])])
    for chunk in X.split(40):
        gi.add(chunk, gi.energies(chunk))
    obs = gi.observations()
    assert obs.signals.keys() == {"a", "b"}
    for name, m in zip("ab", mods):
        ref = float((X.double() @ m.weight.detach().double().t()).pow(2).sum()) * 2 / X.shape[0]
        assert obs.signals[name] == pytest.approx(ref, rel=tol), name
    many = GroupInputs(True, ChunkLayout.of(3, 1, 80), signal_of=[("a", mods[0])])  # 240 tokens > 160 inputs
    assert many.energies(X[:80]) is None  # then they come from H (hessian_energy)
