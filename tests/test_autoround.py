"""Learned rounding (quantkit/algorithms/autoround.py) and the MSE scale search, on real math: a small MLP block
with outlier input channels, GPTQ and RTN as the independent starting points, errors measured directly."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from quantkit.algorithms.autoround import AutoRoundStage, LayerProblem, refine_layer
from quantkit.algorithms.base import ScaleSearchOptions
from quantkit.algorithms.contract import QuantizedWeight, ScaleSearch
from quantkit.algorithms.gptq import gptq_quantize
from quantkit.algorithms.rtn import compute_qparams, fake_quantize, rtn, sqnr_db
from quantkit.schemes import get_scheme


class _Block(nn.Module):
    """A decoder MLP in miniature: down(silu(gate(x)) * up(x)), plus the residual."""

    def __init__(self, d=64, h=128):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(d, h, bias=False), nn.Linear(d, h, bias=False), nn.Linear(h, d, bias=False)

    def forward(self, x):
        return x + self.down(nn.functional.silu(self.gate(x)) * self.up(x))


def _inputs(n=512, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    x[:, :3] *= 20  # outlier channels, as real residual streams have
    return x


def _start(block, x, spec, method):
    """GPTQ (with Hessians of the real inputs, down after gate/up are quantized) or RTN of every Linear."""
    floats = [m.weight.detach().clone() for m in (block.gate, block.up, block.down)]
    starts = []
    for m, inp in ((block.gate, lambda: x), (block.up, lambda: x),
                   (block.down, lambda: nn.functional.silu(block.gate(x)) * block.up(x))):
        with torch.no_grad():
            w = m.weight.detach().float()
            if method == "gptq":
                a = inp()
                r = gptq_quantize(w, 2 * a.t() @ a / a.shape[0], spec, actorder="none")
                q = QuantizedWeight(r.weight, r.qparams.scale, r.qparams.zero_point, r.g_idx)
            else:
                deq, qp = rtn(w, spec)
                q = QuantizedWeight(deq, qp.scale, qp.zero_point)
            m.weight.data = q.weight.clone()
        starts.append(q)
    return floats, starts


def _problem(block, x, ref, floats, starts, spec):
    chunks = list(x.split(128))
    refs = list(ref.split(128))
    return LayerProblem([block.gate, block.up, block.down], floats, starts, spec,
                        lambda i: block(chunks[i]), refs, list(range(len(chunks))))


def _error(block, x, ref):
    with torch.no_grad():
        return float((block(x) - ref).pow(2).mean())


@pytest.mark.parametrize("scheme", ["W4A16", "W4A16_ASYM"])
@pytest.mark.parametrize("init", ["gptq", "rtn"])
def test_learned_rounding_lowers_the_block_error_below_its_start_and_below_gptq(scheme, init):
    torch.manual_seed(0)
    block = _Block()
    x = _inputs()
    with torch.no_grad():
        ref = block(x)
    spec = get_scheme(scheme).with_overrides(group_size=32).weights
    gptq_err = _error(_with(block, x, spec, "gptq"), x, ref)
    floats, starts = _start(block, x, spec, init)
    start_err = _error(block, x, ref)
    stage = AutoRoundStage(method="autoround", scheme=scheme, group_size=32, init=init, steps=200,
                           lr=0.01, learn_clip=True, loss="mse")  # on this block the ranges help from either start;
    # the plain mean squared error, so that the recorded error is the one measured below
    with torch.enable_grad():
        out = refine_layer(_problem(block, x, ref, floats, starts, spec), stage, torch.bfloat16)
    for m, q in zip((block.gate, block.up, block.down), out):
        m.weight.data = q.weight
    err = _error(block, x, ref)
    assert not out[0].stats["autoround_kept_start"]
    assert err < 0.9 * start_err
    assert err < gptq_err
    assert out[0].stats["autoround_error"] == pytest.approx(err, rel=1e-4)
    for q, w in zip(out, floats):  # frozen onto the grid: the codes the export stores give back the weight
        s = q.scale[:, q.columns()]
        z = q.zero_point[:, q.columns()] if q.zero_point is not None else 0.0
        codes = torch.round(q.weight / s) + z
        assert codes.min() >= spec.qmin and codes.max() <= spec.qmax
        assert torch.equal((codes - z) * s, q.weight)
        assert torch.equal(q.scale, q.scale.to(torch.bfloat16).float())


def _with(block, x, spec, method):
    import copy

    b = copy.deepcopy(block)
    _start(b, x, spec, method)
    return b


def test_no_step_that_helps_keeps_the_start():
    torch.manual_seed(1)
    block = _Block()
    x = _inputs()
    with torch.no_grad():
        ref = block(x)
    spec = get_scheme("W4A16").with_overrides(group_size=32).weights
    floats, starts = _start(block, x, spec, "gptq")
    stage = AutoRoundStage(method="autoround", scheme="W4A16", group_size=32, steps=3, lr=0.9)  # wild steps
    with torch.enable_grad():
        out = refine_layer(_problem(block, x, ref, floats, starts, spec), stage, torch.bfloat16)
    if out[0].stats["autoround_kept_start"]:
        assert all(torch.equal(q.weight, s.weight) for q, s in zip(out, starts))
    assert out[0].stats["autoround_error"] <= out[0].stats["autoround_error_start"]


class _LinearBlock(nn.Module):
    """x + down(up(x)): linear, so scaling an input chunk by a power of two scales everything computed from it
    exactly (outputs, losses, gradients), and the signs of the gradients not at all."""

    def __init__(self, d=64, h=128):
        super().__init__()
        self.up, self.down = nn.Linear(d, h, bias=False), nn.Linear(h, d, bias=False)

    def forward(self, x):
        return x + self.down(self.up(x))


def test_which_step_is_kept_does_not_depend_on_how_loud_a_chunk_is():
    """The step kept is the one with the lowest loss relative to the start's on the same chunk: with chunk 0's
    inputs (and so its outputs and loss) 16x quieter, the descent takes the same signed steps and must keep the
    same one. By the raw loss the quiet chunk's steps would always win (this test fails with that rule)."""
    results = []
    for loud in (1.0, 1 / 16):
        torch.manual_seed(4)
        block = _LinearBlock()
        x = _inputs(n=512)
        x[:128] *= loud
        with torch.no_grad():
            ref = block(x)
        spec = get_scheme("W4A16").with_overrides(group_size=32).weights
        floats = [m.weight.detach().clone() for m in (block.up, block.down)]
        starts = []
        for m in (block.up, block.down):
            deq, qp = rtn(m.weight.detach().float(), spec)
            starts.append(QuantizedWeight(deq, qp.scale, qp.zero_point))
            m.weight.data = deq.clone()
        chunks, refs = list(x.split(128)), list(ref.split(128))
        p = LayerProblem([block.up, block.down], floats, starts, spec, lambda i: block(chunks[i]), refs, [0, 1, 2, 3])
        stage = AutoRoundStage(method="autoround", scheme="W4A16", group_size=32, init="rtn", steps=16, lr=0.02,
                               learn_clip=True)
        with torch.enable_grad():
            out = refine_layer(p, stage, torch.float32)
        assert not out[0].stats["autoround_kept_start"]
        results.append([q.weight for q in out])
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_token_relative_loss_serves_the_ordinary_tokens_a_massive_activation_would_drown():
    """One token per chunk 300x louder (a massive activation, as the demo model's first token from layer 11 on):
    the plain mean squared error spends the descent on it; the token-relative loss lowers the other tokens'
    relative error further."""
    errors = {}
    for loss in ("mse", "token_relative"):
        torch.manual_seed(5)
        block = _Block()
        x = _inputs()
        x[::128] *= 300
        with torch.no_grad():
            ref = block(x)
        spec = get_scheme("W4A16").with_overrides(group_size=32).weights
        floats, starts = _start(block, x, spec, "rtn")
        stage = AutoRoundStage(method="autoround", scheme="W4A16", group_size=32, init="rtn", steps=60, lr=0.01,
                               loss=loss)
        with torch.enable_grad():
            out = refine_layer(_problem(block, x, ref, floats, starts, spec), stage, torch.float32)
        for m, q in zip((block.gate, block.up, block.down), out):
            m.weight.data = q.weight
        with torch.no_grad():
            rel = ((block(x) - ref).pow(2).sum(-1) / ref.pow(2).sum(-1))
        ordinary = torch.ones(len(x), dtype=torch.bool)
        ordinary[::128] = False
        errors[loss] = (float(rel[ordinary].mean()), float(rel[~ordinary].mean()))
    assert errors["token_relative"][0] < 0.9 * errors["mse"][0], errors


def test_autoround_refuses_float_grids():
    with pytest.raises(ValueError, match="int grid"):
        AutoRoundStage(method="autoround", scheme="NVFP4A16")


# ------------------------------------------------------------------------------------- MSE scale search
@pytest.mark.parametrize("name", ["W4A16", "W4A16_ASYM", "W8A8", "FP8_DYNAMIC", "NVFP4A16", "MXFP4A16"])
def test_mse_search_never_raises_the_error_it_minimises_and_helps_heavy_tails(name):
    spec = get_scheme(name).with_overrides(group_size=64 if "W4" in name else None).weights
    w = torch.distributions.StudentT(3.0).sample((128, 256)) * 0.02
    cw = torch.rand(256) ** 4  # a skewed diag(H)
    for weight in (None, cw):
        search = ScaleSearch.grid(0.5, 26, weight)
        plain = fake_quantize(w, compute_qparams(w, spec), spec)
        found = fake_quantize(w, compute_qparams(w, spec, search=search), spec)
        k = 1 if weight is None else weight
        g = spec.group_size if spec.strategy == "group" else 256
        per_group = lambda d: (d.pow(2) * k).reshape(128, -1, g).sum(-1)
        assert (per_group(found - w) <= per_group(plain - w) + 1e-12).all()  # group by group
        if weight is None and name in ("W4A16", "W4A16_ASYM"):  # int4 on heavy tails: clipping pays
            assert sqnr_db(w, found) > sqnr_db(w, plain) + 0.1


# ------------------------------------------------------------------------------------- the full signed range
def test_full_range_represents_a_group_that_spans_the_whole_signed_grid_exactly():
    """A group holding -8 and 7 (the int4 grid's ends) and integers between: scale 1 represents it exactly;
    absmax / 7 (scale 8/7) cannot represent 7, nor most of the integers."""
    spec = get_scheme("W4A16").with_overrides(group_size=16).weights
    w = torch.tensor([[-8.0, 7.0, 0.0, 1.0, -1.0, 3.0, -5.0, 6.0, -8.0, 2.0, -3.0, 4.0, -6.0, 5.0, -2.0, -7.0]])
    full = compute_qparams(w, spec, torch.float32, search=ScaleSearch((1.0,), None, True))
    plain = compute_qparams(w, spec, torch.float32)
    assert full.scale.item() == 1.0 and plain.scale.item() == pytest.approx(8 / 7)
    assert torch.equal(fake_quantize(w, full, spec), w)
    assert (fake_quantize(w, plain, spec) - w).abs().max() > 0.4


@pytest.mark.parametrize("name", ["W4A16", "W8A8", "W8A8_AVX2"])
def test_full_range_clips_nothing_and_lowers_the_weight_error(name):
    """Every group's scale is at most absmax / qmax, no code leaves [qmin, qmax] before the clamp (nothing clipped),
    and over many Gaussian groups the squared error is lower: the extra negative code is used."""
    spec = get_scheme(name).with_overrides(group_size=64 if "W4" in name else None).weights
    w = torch.randn(256, 512, generator=torch.Generator().manual_seed(0)) * 0.02
    full = compute_qparams(w, spec, torch.float32, search=ScaleSearch((1.0,), None, True))
    plain = compute_qparams(w, spec, torch.float32)
    assert (full.scale <= plain.scale).all() and (full.scale < plain.scale).any()
    g = spec.group_size if spec.strategy == "group" else 512
    codes = (w.reshape(256, -1, g) / full.scale.unsqueeze(-1)).round()
    assert codes.min() >= spec.qmin and codes.max() <= spec.qmax
    assert codes.min() == spec.qmin  # the extra negative code is reached
    err = lambda qp: (fake_quantize(w, qp, spec) - w).pow(2).sum()  # noqa: E731
    assert err(full) < err(plain)
    assert ScaleSearchOptions().scale_search() is None  # off by default: absmax / qmax, as compressed-tensors


def test_full_range_takes_part_in_the_mse_search():
    """With the MSE search, every ratio's range is split the same way: never worse than full range alone."""
    spec = get_scheme("W4A16").with_overrides(group_size=64).weights
    w = torch.distributions.StudentT(3.0).sample((128, 256)) * 0.02
    alone = compute_qparams(w, spec, search=ScaleSearch((1.0,), None, True))
    searched = compute_qparams(w, spec, search=ScaleSearch.grid(0.5, 26, None, full_range=True))
    per_group = lambda qp: (fake_quantize(w, qp, spec) - w).pow(2).reshape(128, -1, 64).sum(-1)  # noqa: E731
    assert (per_group(searched) <= per_group(alone) + 1e-12).all()
    assert ScaleSearchOptions(full_range=True, observer="mse").scale_search().full_range


def test_signed_range_represents_a_group_whose_max_is_its_larger_end_exactly():
    """A group holding 8 and -7 and integers between: only a scale of -1 represents it (codes -8..7 negated);
    absmax / 7 and max(max / 7, min / -8) both take 8/7 and miss most of it. With the min the larger end the
    signed scale is positive and the same as the full range's."""
    spec = get_scheme("W4A16").with_overrides(group_size=16).weights
    w = torch.tensor([[8.0, -7.0, 0.0, 1.0, -1.0, 3.0, -5.0, 6.0, 8.0, 2.0, -3.0, 4.0, -6.0, 5.0, -2.0, 7.0]])
    signed = compute_qparams(w, spec, torch.float32, search=ScaleSearch((1.0,), None, "signed"))
    full = compute_qparams(w, spec, torch.float32, search=ScaleSearch((1.0,), None, True))
    assert signed.scale.item() == -1.0 and full.scale.item() == pytest.approx(8 / 7)
    assert torch.equal(fake_quantize(w, signed, spec), w)
    assert (fake_quantize(w, full, spec) - w).abs().max() > 0.4
    flipped = compute_qparams(-w, spec, torch.float32, search=ScaleSearch((1.0,), None, "signed"))
    assert flipped.scale.item() == 1.0 and torch.equal(fake_quantize(-w, flipped, spec), -w)


@pytest.mark.parametrize("name", ["W4A16", "W8A8"])
def test_signed_range_puts_the_larger_end_on_qmin_and_lowers_the_weight_error(name):
    """Over many Gaussian groups: |scale| = absmax / 2^(bits-1) (finer than either unsigned rule), the larger end
    of every group is coded qmin exactly, the other end clips by at most one step, and the squared error is
    below the full range's, itself below absmax / qmax."""
    spec = get_scheme(name).with_overrides(group_size=64 if "W4" in name else None).weights
    w = torch.randn(256, 512, generator=torch.Generator().manual_seed(1)) * 0.02
    g = spec.group_size if spec.strategy == "group" else 512
    wg = w.reshape(256, -1, g)
    signed = compute_qparams(w, spec, torch.float32, search=ScaleSearch((1.0,), None, "signed"))
    full = compute_qparams(w, spec, torch.float32, search=ScaleSearch((1.0,), None, True))
    plain = compute_qparams(w, spec, torch.float32)
    absmax = wg.abs().amax(-1)
    assert torch.allclose(signed.scale.abs(), absmax / -spec.qmin, rtol=1e-6)
    assert (signed.scale < 0).any() and (signed.scale > 0).any()
    larger = torch.where(wg.amax(-1) > -wg.amin(-1), wg.amax(-1), wg.amin(-1))
    assert torch.equal((larger / signed.scale).round(), torch.full_like(larger, float(spec.qmin)))
    codes = (wg / signed.scale.unsqueeze(-1)).round()
    assert codes.min() >= spec.qmin and codes.max() <= spec.qmax + 1
    err = lambda qp: (fake_quantize(w, qp, spec) - w).pow(2).sum()  # noqa: E731
    assert err(signed) < err(full) < err(plain)
    assert ScaleSearchOptions(full_range="signed").scale_search().full_range == "signed"


def test_a_converted_model_records_the_learned_layers_and_resumes_to_the_same_bytes(tiny_llama, calib_text, tmp_path):
    """Through the layer walk: every layer's learned rounding is recorded in the manifest, lowers the layer error
    where it replaces the start, and a second conversion gives the same bytes (deterministic)."""
    import json

    from conftest import tiny_recipe
    from quantkit import api
    from quantkit.recipe import parse_recipe

    stages = [{"method": "autoround", "scheme": "W4A16", "group_size": 16, "init": "rtn", "steps": 15}]
    outs = []
    for k in range(2):
        out = tmp_path / f"out{k}"
        api.convert(parse_recipe(tiny_recipe(tiny_llama, calib_text, stages)), out, quiet=True)
        outs.append(out)
    layers = json.loads((outs[0] / "manifest.json").read_text())["layers"]
    learned = [v for v in layers.values() if "autoround_error" in v]
    assert learned and len(learned) == len(layers)
    assert any(not v["autoround_kept_start"] for v in learned)
    for v in learned:
        assert v["autoround_error"] <= v["autoround_error_start"]
        if not v["autoround_kept_start"]:
            assert v["autoround_error"] < v["autoround_error_start"]
    a = sorted(outs[0].glob("*.safetensors"))
    assert a and all(x.read_bytes() == (outs[1] / x.name).read_bytes() for x in a)


# ------------------------------------------------------------------------------------- the reference, end to end
@pytest.mark.parametrize("reference", ["float_model", "float_layer"])
def test_each_layer_trains_towards_the_float_models_activations(tmp_path, calib_text, reference):
    """With `reference: float_model` the target each layer's refinement sees is the float model's own hidden
    state after that layer, as transformers computes it on the calibration ids (all but the last layer: its
    hidden state there comes after the final norm); with `float_layer` it is not, from layer 1 on (the quantized
    layer 0 changed layer 1's input), which shows the comparison can tell them apart."""
    from transformers import AutoModelForCausalLM

    from conftest import make_tiny_model, tiny_recipe
    from quantkit import api
    from quantkit.algorithms import autoround
    from quantkit.quantize import walk
    from quantkit.recipe import parse_recipe

    model_dir = make_tiny_model(tmp_path / "m", "llama", layers=3)
    seen: list[torch.Tensor] = []
    ids: list[torch.Tensor] = []
    real_error, real_capture = autoround._layer_error, walk.capture_layer_inputs

    def error(p, *a):  # called twice per layer (the start's error, the result's), with the layer's reference
        seen.append(torch.cat([r.float() for r in p.reference]))
        return real_error(p, *a)

    def capture(model, arch, ckpt, input_ids, *a):
        ids.append(input_ids)
        return real_capture(model, arch, ckpt, input_ids, *a)

    mp = pytest.MonkeyPatch()
    mp.setattr(autoround, "_layer_error", error)
    mp.setattr(walk, "capture_layer_inputs", capture)
    try:
        stage = {"method": "autoround", "scheme": "W4A16", "group_size": 16, "init": "rtn", "steps": 2,
                 "reference": reference}
        api.convert(parse_recipe(tiny_recipe(model_dir, calib_text, [stage])), tmp_path / "out", quiet=True)
    finally:
        mp.undo()
    seen = seen[::2]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        states = model(ids[0], output_hidden_states=True).hidden_states
    assert len(seen) == 3
    for i in (0, 1):
        want = states[i + 1]
        close = torch.allclose(seen[i], want, atol=1e-4 * float(want.abs().max()), rtol=0)
        assert close == (reference == "float_model" or i == 0), (i, float((seen[i] - want).abs().max()))


def _chain_rule_reference(base, V, s, z, qmin, qmax):
    """The learned grid as autograd sees it op by op (the formulation before the fused function): the rounding
    passed straight through as x + (round(x) - x).detach(), then clamp, shift and scale."""
    x = base / s + V
    x = x + (torch.round(x) - x).detach()
    q = torch.clamp(x + (z if z is not None else 0.0), qmin, qmax)
    return (q - (z if z is not None else 0.0)) * s


@pytest.mark.parametrize("asym", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["groups", "g_idx"])
def test_the_fused_grid_matches_autograds_chain_rule(asym, dtype, layout):
    from quantkit.algorithms.autoround import _FakeQuant

    g = torch.Generator().manual_seed(3)
    out_f, groups, size = 48, 6, 16
    base = torch.randn(out_f, groups, size, generator=g) * 2
    base[0, 0, :4] = torch.tensor([30.0, -30.0, 0.0, 5.0])  # codes past both ends of the grid: clamped
    s0 = base.abs().amax(-1, keepdim=True) / 7
    factor = (0.7 + 0.3 * torch.rand(out_f, groups, 1, generator=g)).requires_grad_()
    V = (torch.rand(out_f, groups, size, generator=g) - 0.5).requires_grad_()
    z = torch.randint(-2, 3, (out_f, groups, 1), generator=g).float() if asym else None
    upstream = torch.randn(out_f, groups, size, generator=g).to(dtype)
    if layout == "g_idx":  # the scale gathered per column, as with GPTQ's activation order
        cols = torch.randperm(groups * size, generator=g) // size
        flat = lambda t: t.reshape(out_f, groups * size)  # noqa: E731
        base, V_in, upstream = flat(base), V.reshape(out_f, -1), flat(upstream)
        scale = lambda: (s0 * factor).squeeze(-1)[:, cols]  # noqa: E731
        z = z.squeeze(-1)[:, cols] if z is not None else None
    else:
        V_in, scale = V, (lambda: s0 * factor)
    results = []
    for fused in (False, True):
        w = (_FakeQuant.apply(base, V_in, scale(), z, -8, 7, dtype) if fused
             else _chain_rule_reference(base, V_in, scale(), z, -8, 7).to(dtype))
        (w.float() * upstream.float()).sum().backward()
        results.append((w.detach(), V.grad.clone(), factor.grad.clone()))
        V.grad, factor.grad = None, None
    (w_ref, gv_ref, gf_ref), (w_fused, gv_fused, gf_fused) = results
    assert w_fused.dtype == dtype and torch.equal(w_fused, w_ref)  # the same codes and values, bit for bit
    assert torch.equal(gv_fused, gv_ref)  # dw/dV = s inside the grid, 0 where clamped
    assert (gv_ref == 0).any() and (gv_ref != 0).any()
    assert torch.allclose(gf_fused, gf_ref, rtol=1e-5, atol=1e-6 * gf_ref.abs().max())


def test_reusing_freed_memory_spares_the_page_faults_of_a_repeated_allocation():
    import resource

    from quantkit.io import _libc, keep_large_allocations_off_the_heap, reusing_freed_memory

    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        pytest.skip("not glibc: the mmap threshold is glibc's")

    def faults_of_a_loop() -> int:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(20):
            torch.ones(2 << 20)  # 8 MB, written through, freed at once
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    keep_large_allocations_off_the_heap()  # the walk's 1 MB threshold: each 8 MB tensor is a fresh mapping
    outside = faults_of_a_loop()
    with reusing_freed_memory():
        inside = faults_of_a_loop()
    assert outside >= 20 * 2048 * 0.9  # a page fault per 4 KB page of every tensor (THP may merge a few)
    assert inside < outside / 4


def test_giving_back_freed_memory_returns_the_freed_heap_between_a_loops_blocks():
    """Inside reusing_freed_memory freed blocks stay resident for reuse; inside giving_back_freed_memory a loop's
    give_back_free_memory() returns them (the heap's resident pages drop by what was freed), and outside it
    the call does nothing. Measured in a fresh process: the heap of a long test session holds other tests'
    leftovers, which move its resident pages in ways this test does not control."""
    import json
    import subprocess
    import sys

    from quantkit.io import _libc

    libc = _libc()
    if libc is None or not hasattr(libc, "malloc_trim") or not os.path.exists("/proc/self/smaps"):
        pytest.skip("not glibc on Linux: the heap and its trim are glibc's")
    code = """
import json, torch
from quantkit.io import give_back_free_memory, giving_back_freed_memory, reusing_freed_memory

def heap_mb():
    kb, here = 0, False
    for line in open("/proc/self/smaps"):
        head = line.split()
        if head and "-" in head[0] and not head[0].endswith(":"):
            here = len(head) > 5 and head[5] == "[heap]"
        elif here and head[0] == "Rss:":
            kb += int(head[1])
    return kb / 1024

def freed_blocks():
    # 80 x 4 MB written through, then every other one freed: each freed block lies between two live ones, so
    # none is at the heap's top (where free() itself gives back what passes the trim threshold); 160 MB free
    blocks = [torch.ones(1 << 20) for _ in range(80)]
    del blocks[::2]
    return blocks

with reusing_freed_memory():
    live = [freed_blocks()]
    before = heap_mb()
    give_back_free_memory()  # outside giving_back_freed_memory: nothing
    kept = heap_mb()
    with giving_back_freed_memory():
        live.append(freed_blocks())
        full = heap_mb()
        give_back_free_memory()
        returned = heap_mb()
print(json.dumps([before, kept, full, returned]))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    before, kept, full, returned = json.loads(done.stdout.strip().splitlines()[-1])
    assert before >= 300 and kept >= before - 10  # the 160 MB freed stayed resident beside the 160 MB alive
    assert full >= before + 140 and returned <= full - 140
