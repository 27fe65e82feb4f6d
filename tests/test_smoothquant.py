"""SmoothQuant: the float model is unchanged by the fold on every architecture spec, W8A8 error drops on
inputs with activation outliers, the guard leaves a mapping alone when smoothing would hurt, and a
SmoothQuant -> RTN W8A8 recipe exports a checkpoint that reloads like quantkit's own quantized model."""

from __future__ import annotations

import json

import pytest
import torch

from _transforms import logits, outlier_inputs, transform_float_model
from conftest import make_tiny_model, tiny_recipe
from quantkit import api
from quantkit.algorithms.smoothing import block_error
from quantkit.algorithms.contract import MappingTargets
from quantkit.algorithms.smoothquant import smoothquant, smoothquant_scales
from quantkit.export.reader import fake_quant_model
from quantkit.recipe import RecipeError, parse_recipe
from quantkit.schemes import get_scheme

W8A8 = get_scheme("W8A8")


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3", "gemma"])
def test_smoothquant_fold_keeps_float_output(tmp_path, calib_text, model_type):
    model_dir = make_tiny_model(tmp_path / model_type, model_type)
    stages = [{"method": "smoothquant", "alpha": 0.5}, {"method": "rtn", "scheme": "W8A8"}]
    ref, got, stats, _ = transform_float_model(model_dir, calib_text, stages)
    assert len(stats) == 2 * 7 and all(s["transform"] == "smoothquant" for s in stats.values())
    assert sum(s["applied"] for s in stats.values()) >= 7
    changed = [n for n, p in got.named_parameters() if not torch.equal(p, ref.get_parameter(n))]
    assert any("layernorm" in n for n in changed)
    a, b = logits(ref), logits(got)
    assert (a - b).abs().max() <= 1e-4 * a.abs().max()


def test_smoothquant_lowers_w8a8_error_on_activation_outliers():
    torch.manual_seed(0)
    w = torch.randn(96, 64) * 0.05
    x, held_out = outlier_inputs(1024, 64, factor=60.0, seed=0), outlier_inputs(1024, 64, factor=60.0, seed=1)
    r = smoothquant(x, x.abs().amax(0), MappingTargets([w], [W8A8.weights], [W8A8.activations], torch.arange(64), 64),
                    alpha=0.5)
    assert r.applied and r.error_after < 0.5 * r.error_before
    before = block_error(held_out, [w], [W8A8.weights], [W8A8.activations], None)
    after = block_error(held_out, [w], [W8A8.weights], [W8A8.activations], r.scales)
    assert after < 0.5 * before


def test_smoothquant_scales_formula_and_guard():
    s = smoothquant_scales(torch.tensor([16.0, 1.0, 0.0]), torch.tensor([1.0, 4.0, 2.0]), alpha=0.5)
    assert torch.allclose(s, torch.tensor([4.0, 0.5, 1.0]))  # sqrt(16)/1, 1/sqrt(4), no signal -> 1
    torch.manual_seed(3)  # smooth inputs, one large weight column: smoothing can only hurt -> left alone
    w = torch.randn(32, 64) * 0.05
    w[:, 5] *= 50
    x = torch.randn(256, 64)
    r = smoothquant(x, x.abs().amax(0), MappingTargets([w], [W8A8.weights], [W8A8.activations], torch.arange(64), 64),
                    alpha=1.0)
    assert not r.applied and torch.equal(r.scales, torch.ones(64)) and r.error_after == r.error_before


def test_smoothquant_then_rtn_exports_and_reloads(tiny_llama, calib_text, tmp_path):
    from transformers import AutoModelForCausalLM

    stages = [{"method": "smoothquant"}, {"method": "rtn", "scheme": "W8A8"}]
    r = parse_recipe(tiny_recipe(tiny_llama, calib_text, stages))
    cap: dict = {}
    out = api.convert(r, tmp_path / "out", quiet=True, on_weight=cap.__setitem__)
    got = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ref = fake_quant_model(tiny_llama, r, cap)
    a, b = logits(ref), logits(got)  # compressed-tensors decompresses the weights on the first forward
    for name, w in cap.items():  # quantized weights and folded norms survive the checkpoint exactly
        t = got.get_parameter(name) if name.endswith(".weight") else got.get_submodule(name).weight
        assert torch.equal(t.to(torch.bfloat16), w.to(torch.bfloat16)), name
    # transformers quantizes activations with absmax / 127.5, quantkit like the engine (absmax / 127)
    assert (a - b).abs().max() <= 0.1 * a.abs().max()
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert cfg["format"] == "int-quantized" and list(cfg["config_groups"]) == ["group_1"]
    man = json.loads((out / "manifest.json").read_text())
    sm = [v["smoothing"] for v in man["layers"].values()]
    assert all(s["transform"] == "smoothquant" and s["alpha"] == 0.5 for s in sm)
    assert all(s["error_after"] <= s["error_before"] for s in sm)


def test_smoothquant_needs_activation_quantization(tmp_path, calib_text):
    with pytest.raises(RecipeError, match=r"stages\[0\].method: 'smoothquant' prepares activation quantization"):
        parse_recipe(tiny_recipe(tmp_path, calib_text, [{"method": "smoothquant"},
                                                        {"method": "gptq", "scheme": "W4A16"}]))
    with pytest.raises(RecipeError, match=r"stages\[0\].alpha: 1.5: Input should be less than or equal to 1"):
        parse_recipe(tiny_recipe(tmp_path, calib_text, [{"method": "smoothquant", "alpha": 1.5},
                                                        {"method": "rtn", "scheme": "W8A8"}]))
    ok = parse_recipe(tiny_recipe(tmp_path, calib_text, [{"method": "smoothquant"},
                                                         {"method": "rtn", "scheme": "FP8_DYNAMIC"}]))
    assert ok.stages[0].alpha == 0.5
