"""NVFP4 and MXFP4 weights (fp4 e2m1 with the formats' block scales): the rounding, the scales, GPTQ against
round-to-nearest, and the export through compressed-tensors' own compressors reloading exactly."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import tiny_recipe
from quantkit import api
from quantkit.algorithms.rtn import FP4_GRID, fp4_round, nvfp4_global_scale, rtn
from quantkit.recipe import parse_recipe
from quantkit.schemes import get_scheme


def test_fp4_rounding_is_nearest_with_ties_to_even_mantissa():
    grid = torch.tensor(FP4_GRID)
    x = torch.linspace(-7, 7, 20001)
    got = fp4_round(x)
    full = torch.cat([-grid.flip(0), grid])
    dist = (x[:, None] - full[None, :]).abs()
    best = dist.min(dim=1).values
    assert torch.equal((got - x).abs(), best), "every value goes to a nearest grid point"
    # ties (the midpoints): to the neighbour whose mantissa bit is 0, as compressed-tensors casts them
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert fp4_round(mids).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert fp4_round(-mids).tolist() == [-0.0, -1.0, -1.0, -2.0, -2.0, -4.0, -4.0]
    from compressed_tensors.quantization.quant_args import FP4_E2M1_DATA

    assert torch.equal(fp4_round(x), FP4_E2M1_DATA.cast_to_fp4(x.clone().clamp(-6, 6)))


@pytest.mark.parametrize("name", ["NVFP4A16", "MXFP4A16"])
def test_scales_and_sqnr_floor(name):
    torch.manual_seed(0)
    w = torch.randn(96, 256) * 0.03
    w[:, 5] *= 8  # an outlier column
    spec = get_scheme(name).weights
    deq, qp = rtn(w, spec)
    g = spec.group_size
    assert qp.scale.shape == (96, 256 // g)
    codes = deq.reshape(96, -1, g) / qp.scale[..., None]
    assert torch.equal(fp4_round(codes), codes), "every weight is a code times its group's scale"
    assert codes.abs().max() <= 6
    if name == "MXFP4A16":  # power-of-two scales, no clipping: absmax / scale in (3, 6]
        assert torch.equal(torch.exp2(torch.log2(qp.scale).round()), qp.scale)
        ratio = w.reshape(96, -1, g).abs().amax(-1) / qp.scale
        assert ratio.max() <= 6 and ratio.min() > 3
        assert qp.global_scale is None
    else:  # fp8 group scales under a power-of-two global scale
        gs = qp.global_scale
        assert gs == nvfp4_global_scale(w) and torch.equal(torch.exp2(torch.log2(gs).round()), gs)
        stored = qp.scale * gs
        assert torch.equal(stored.to(torch.float8_e4m3fn).float(), stored) and stored.max() <= 448
    sqnr = 10 * torch.log10(w.pow(2).sum() / (w - deq).pow(2).sum())
    assert sqnr > 17, f"{name}: {sqnr:.1f} dB"  # measured 20.2 (NVFP4) and 18.6 (MXFP4) on Gaussian weights


def test_fixed_formats_refuse_group_size_overrides():
    with pytest.raises(ValueError, match="fixed format"):
        get_scheme("NVFP4A16").with_overrides(group_size=64)
    with pytest.raises(ValueError, match="fixed format"):
        get_scheme("MXFP4A16").with_overrides(symmetric=False)
    assert get_scheme("MXFP4A16").with_overrides(group_size=32).weights.group_size == 32


@pytest.mark.parametrize("name", ["NVFP4A16", "MXFP4A16"])
def test_gptq_beats_round_to_nearest_on_the_output(name):
    from quantkit.algorithms.gptq import gptq_factor, gptq_solve

    torch.manual_seed(1)
    x = torch.randn(2048, 128) @ (torch.eye(128) + 0.3 * torch.randn(128, 128))  # correlated inputs
    w = torch.randn(64, 128) * 0.05
    H = x.t() @ x / x.shape[0]
    spec = get_scheme(name).weights
    err_rtn = (x @ (w - rtn(w, spec)[0]).t()).pow(2).sum()
    res = gptq_solve(w, gptq_factor(H, 0.01, "static"), spec, 32, "static")
    err_gptq = (x @ (w - res.weight).t()).pow(2).sum()
    assert err_gptq < 0.8 * err_rtn, (float(err_gptq), float(err_rtn))
    if name == "NVFP4A16":
        assert res.qparams.global_scale == nvfp4_global_scale(w)


@pytest.mark.parametrize("stages, calibrated", [
    ([{"method": "rtn", "scheme": "NVFP4A16"}], False),
    ([{"method": "gptq", "scheme": "NVFP4A16", "actorder": "static"}], True),
    ([{"method": "rtn", "scheme": "MXFP4A16"}], False),
    ([{"method": "gptq", "scheme": "MXFP4A16"}], True),
])
def test_export_decompresses_to_the_fake_quantized_weights_exactly(tiny_llama, calib_text, tmp_path, stages,
                                                                   calibrated):
    from safetensors.torch import load_file

    r = parse_recipe(tiny_recipe(tiny_llama, calib_text if calibrated else None, stages))
    cap: dict = {}
    out = api.convert(r, tmp_path / "out", quiet=True, on_weight=cap.__setitem__)
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    fmt = {"NVFP4A16": "nvfp4-pack-quantized", "MXFP4A16": "mxfp4-pack-quantized"}[stages[0]["scheme"]]
    assert cfg["format"] == fmt
    w = cfg["config_groups"]["group_0"]["weights"]
    assert w["type"] == "float" and w["num_bits"] == 4
    assert (w["strategy"], w["group_size"]) == (("tensor_group", 16) if fmt.startswith("nv") else ("group", 32))
    sd = {}
    for f in out.glob("*.safetensors"):
        sd.update(load_file(str(f)))
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    scheme = QuantizationScheme.model_validate(cfg["config_groups"]["group_0"])

    compressor = BaseCompressor.get_value_from_registry(fmt)
    assert cap
    for name, want in cap.items():
        local = {k[len(name) + 1:]: v for k, v in sd.items() if k.startswith(name + ".weight")}
        assert local["weight_packed"].dtype == torch.uint8
        assert local["weight_scale"].dtype == (torch.float8_e4m3fn if fmt.startswith("nv") else torch.uint8)
        got = compressor.decompress(local, scheme)["weight"]
        assert torch.equal(got.float(), want.float()), name  # bit-exact: codes x exact scales
    # and transformers reloads the checkpoint to the same weights
    from quantkit.evaluate.hf_perplexity import load_for_perplexity

    model, _ = load_for_perplexity(out)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))  # compressed-tensors decompresses on the first forward
    for name, want in cap.items():
        assert torch.equal(model.get_submodule(name).weight.float(), want.float()), name


def test_group_actorder_is_refused_for_fp4_formats(tiny_llama, calib_text, tmp_path):
    from quantkit.plan import ConvertError

    r = parse_recipe(tiny_recipe(tiny_llama, calib_text, [{"method": "gptq", "scheme": "MXFP4A16", "actorder": "group"}]))
    with pytest.raises(ConvertError, match="actorder: 'group' needs a g_idx"):
        api.convert(r, tmp_path / "out", quiet=True)
    r = parse_recipe(tiny_recipe(tiny_llama, None, [{"method": "rtn", "scheme": "NVFP4A16", "group_size": 32}]))
    with pytest.raises(ConvertError, match="fixed format"):
        api.convert(r, tmp_path / "out", quiet=True)


def test_capability_refuses_fp4_on_the_cpu():
    from quantkit.engine.capability import recipe_can_run

    r = parse_recipe({"name": "x", "model": {"path": "m"}, "stages": [{"method": "rtn", "scheme": "NVFP4A16"}]})
    ok, why = recipe_can_run(r, "cpu")
    assert not ok and "FP4" in why
    assert recipe_can_run(r, "cuda")[0]


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3", "gemma"])
@pytest.mark.parametrize("scheme", ["NVFP4A16", "MXFP4A16"])
def test_every_architecture_converts_and_reloads_exactly(tmp_path, model_type, scheme):
    from conftest import make_tiny_model
    from quantkit.evaluate.hf_perplexity import load_for_perplexity

    model_dir = make_tiny_model(tmp_path / model_type, model_type)
    r = parse_recipe(tiny_recipe(model_dir, None, [{"method": "rtn", "scheme": scheme}]))
    cap: dict = {}
    out = api.convert(r, tmp_path / "out", quiet=True, on_weight=cap.__setitem__)
    assert len(cap) == 2 * 7  # every decoder Linear of both layers
    model, _ = load_for_perplexity(out)
    for name, want in cap.items():
        assert torch.equal(model.get_submodule(name).weight.float(), want.float()), name
