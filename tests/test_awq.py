"""AWQ-style scaling: the float model is unchanged by the fold on every architecture spec, the search
lowers the quantized block error against RTN on inputs with outlier channels, and AWQ -> RTN / GPTQ
recipes export checkpoints that reload exactly like quantkit's own quantized model."""

from __future__ import annotations

import json

import pytest
import torch

from _transforms import logits, outlier_inputs, transform_float_model
import conftest
from conftest import make_tiny_model, tiny_recipe
from quantkit import api
from quantkit.algorithms.awq import awq_clip, awq_search
from quantkit.algorithms.contract import MappingTargets
from quantkit.algorithms.rtn import rtn
from quantkit.algorithms.smoothing import block_error, channel_index, reduce_to_channels
from quantkit.export.reader import fake_quant_model
from quantkit.model import ModelError
from quantkit.model.arch import ARCHS
from quantkit.recipe import RecipeError, parse_recipe
from quantkit.schemes import get_scheme

W4G32 = get_scheme("W4A16").with_overrides(group_size=32).weights


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2"])
def test_awq_fold_keeps_float_output(tmp_path, calib_text, model_type, monkeypatch):
    # gemma2 (and gemma3): the MLP reads pre_feedforward_layernorm, not post_attention_layernorm
    monkeypatch.setitem(conftest.TINY_CONFIGS, "gemma2", dict(conftest.TINY_CONFIGS["gemma"]))
    model_dir = make_tiny_model(tmp_path / model_type, model_type)
    stages = [{"method": "awq", "clip": False, "grid": 4}, {"method": "rtn", "scheme": "W4A16", "group_size": 16}]
    ref, got, stats, _ = transform_float_model(model_dir, calib_text, stages)
    mlp_norm = "pre_feedforward_layernorm" if model_type == "gemma2" else "post_attention_layernorm"
    assert len(stats) == 2 * 7 and {s["from"] for s in stats.values()} == {
        "input_layernorm", "self_attn.v_proj", mlp_norm, "mlp.up_proj"}
    assert sum(s["alpha"] is not None for s in stats.values()) >= 7  # most mappings really were rescaled
    changed = [n for n, p in got.named_parameters() if not torch.equal(p, ref.get_parameter(n))]
    assert any("layernorm" in n for n in changed) and any("v_proj" in n for n in changed)
    a, b = logits(ref), logits(got)
    assert (a - b).abs().max() <= 1e-4 * a.abs().max()


def test_awq_lowers_block_error_vs_rtn_on_outlier_inputs():
    torch.manual_seed(0)
    w = torch.randn(96, 64) * 0.05  # [out, in]
    x, held_out = outlier_inputs(2048, 64, seed=0), outlier_inputs(2048, 64, seed=1)
    idx = torch.arange(64)
    r = awq_search(x, x.abs().mean(0), MappingTargets([w], [W4G32], [None], idx, 64), grid=20)
    assert r.alpha is not None and r.error_after < 0.8 * r.error_before
    # the scales generalise to tokens the search did not see
    rtn_err = block_error(held_out, [w], [W4G32], [None], None)
    awq_err = block_error(held_out, [w], [W4G32], [None], r.scales)
    assert awq_err < 0.8 * rtn_err


def test_awq_scales_up_the_known_outlier_channel():
    """An independent expectation: with one input channel carrying far larger activations than the rest,
    AWQ must choose a positive exponent and give that channel the largest scale (its weight column gets
    the finest quantization steps), well above the typical channel."""
    torch.manual_seed(1)
    w = torch.randn(32, 64) * 0.05
    x = torch.randn(1024, 64)
    x[:, 5] *= 30.0
    r = awq_search(x, x.abs().mean(0), MappingTargets([w], [W4G32], [None], torch.arange(64), 64), grid=10)
    assert r.alpha is not None and r.alpha > 0
    assert int(r.scales.argmax()) == 5 and float(r.scales[5]) > 2 * float(r.scales.median())
    assert r.error_after < 0.5 * r.error_before  # and it pays: the block error drops by half or more


def test_awq_clip_lowers_output_error():
    torch.manual_seed(2)
    w = torch.randn(64, 64) * 0.05
    w[torch.arange(64), torch.randint(0, 64, (64,))] *= 8  # one heavy outlier weight per row
    x, held_out = torch.randn(512, 64), torch.randn(512, 64)
    clipped, ratio = awq_clip(x, w, W4G32)
    assert ratio < 1.0

    def err(wc):
        return float((held_out @ w.t() - held_out @ rtn(wc, W4G32)[0].t()).pow(2).mean())
    assert err(clipped) < err(w)


def test_gqa_channel_index_replicates_kv_channels():
    # 2 kv heads of dim 4 shared by 4 query heads: o column h*4+d reads v channel (h // 2)*4 + d
    idx = channel_index(8, 16, head_dim=4)
    assert idx.tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 4, 5, 6, 7]
    assert channel_index(8, 12, head_dim=None) is None
    v = torch.arange(16.0)
    assert reduce_to_channels(v, idx, 8, "mean").tolist() == [2, 3, 4, 5, 10, 11, 12, 13]
    assert reduce_to_channels(v, idx, 8, "max").tolist() == [4, 5, 6, 7, 12, 13, 14, 15]


def test_wrong_smoothing_mapping_is_refused(tiny_llama, calib_text, monkeypatch):
    """A spec whose norm does not really feed the mapped Linears would change the model: refused."""
    import dataclasses

    wrong = dataclasses.replace(ARCHS["llama"], smoothing=(("input_layernorm", ("mlp.gate_proj", "mlp.up_proj")),))
    monkeypatch.setitem(ARCHS, "llama", wrong)
    with pytest.raises(ModelError, match=r"model.layers.0.input_layernorm: the architecture spec says its output "
                                         r"feeds model.layers.0.mlp.gate_proj, model.layers.0.mlp.up_proj, but"):
        transform_float_model(tiny_llama, calib_text, [{"method": "smoothquant"}, {"method": "rtn", "scheme": "W8A8"}])


@pytest.mark.parametrize("quantizer", ["rtn", "gptq"])
def test_awq_then_quantizer_exports_and_reloads(tiny_llama, calib_text, tmp_path, quantizer):
    from transformers import AutoModelForCausalLM

    stages = [{"method": "awq", "grid": 10}, {"method": quantizer, "scheme": "W4A16", "group_size": 16}]
    r = parse_recipe(tiny_recipe(tiny_llama, calib_text, stages))
    cap: dict = {}
    out = api.convert(r, tmp_path / "out", quiet=True, on_weight=cap.__setitem__)
    got = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ref = fake_quant_model(tiny_llama, r, cap)
    a, b = logits(ref), logits(got)
    assert (a - b).abs().max() <= 1e-5 * a.abs().max()
    norms = [k for k in cap if k.endswith("layernorm.weight")]
    assert len(norms) == 4  # both norms of both layers were rewritten and exported
    for k in norms:
        assert torch.equal(got.get_parameter(k), cap[k])
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    # one config group, named after the quantizer stage (stages[1]); the transform adds none
    assert list(cfg["config_groups"]) == ["group_1"] and cfg["config_groups"]["group_1"]["targets"] == ["Linear"]
    man = json.loads((out / "manifest.json").read_text())
    assert man["quantization"]["modules_quantized"] == 14
    assert man["quantization"]["stages"] == [{"method": "awq", "scheme": None},
                                             {"method": quantizer, "scheme": "W4A16"}]
    sm = [v["smoothing"] for v in man["layers"].values()]
    assert len(sm) == 14 and all(s["error_after"] <= s["error_before"] for s in sm)
    assert all(v["method"] == quantizer for v in man["layers"].values())


@pytest.mark.parametrize("stages, expected", [
    ([{"method": "rtn", "scheme": "W4A16"}, {"method": "awq"}],
     "x.yaml: stages[1].method: 'awq' is a transform and must be followed by the quantizer stages it prepares: "
     "move it above stages[0]"),
    ([{"method": "awq"}], "stages[0].method: 'awq' is a transform and must be followed by the quantizer stages"),
    ([{"method": "awq", "scheme": "W4A16"}, {"method": "rtn", "scheme": "W4A16"}],
     "stages[0].scheme: unknown key 'scheme' (allowed: clip, duo_scaling, grid, ignore, max_tokens, method, targets)"),
    ([{"method": "awq", "grid": 0}, {"method": "rtn", "scheme": "W4A16"}], "stages[0].grid: 0: Input should be"),
])
def test_awq_recipe_errors(tmp_path, calib_text, stages, expected):
    with pytest.raises(RecipeError) as ei:
        parse_recipe(tiny_recipe(tmp_path, calib_text, stages), "x.yaml")
    assert expected in str(ei.value)
    assert not parse_recipe({"name": "n", "model": {"path": "m"}, "stages": [{"method": "rtn", "scheme": "W8A8"}]}) \
        .stages[0].is_transform


def test_awq_needs_calibration(tmp_path):
    with pytest.raises(RecipeError, match=r"stages\[0\] \(awq\) needs calibration data"):
        parse_recipe(tiny_recipe(tmp_path, None, [{"method": "awq"}, {"method": "rtn", "scheme": "W4A16"}]))
