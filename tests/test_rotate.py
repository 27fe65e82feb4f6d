"""Offline rotations: the Hadamard constructions are Hadamard (H H^T = n I, checked directly); the rotated model,
read through quantkit/model/rotated.py and loaded by transformers, computes the float model's logits on every
architecture spec that can be rotated (tolerance 1e-4 of the logits' range, fp32 storage; 1e-2 for the bf16
export); architectures that cannot be are refused with the reason; rotation lowers W4 and W8 weight error on
outlier channels; a rotated recipe converts, unties the embeddings and reloads exactly."""

from __future__ import annotations

import json

import pytest
import torch

import conftest
from _transforms import logits
from conftest import make_tiny_model, tiny_recipe
from quantkit.algorithms.hadamard import hadamard, hadamard_order_kind, rotation
from quantkit.algorithms.rotate import RotateStage
from quantkit.algorithms.rtn import rtn
from quantkit.model import ModelError
from quantkit.model.arch import arch_for
from quantkit.model.checkpoint import LazyCheckpoint
from quantkit.model.rotated import RotatedCheckpoint
from quantkit.recipe import RecipeError, parse_recipe
from quantkit.schemes import get_scheme


@pytest.mark.parametrize("n", [1, 2, 4, 12, 20, 28, 36, 64, 72, 576, 3584])
def test_hadamard_orders_are_hadamard(n):
    h = hadamard(n)
    assert h.shape == (n, n) and set(h.unique().tolist()) <= {-1.0, 1.0}
    assert torch.equal(h @ h.t(), n * torch.eye(n, dtype=torch.float64))


def test_orders_without_a_construction_fall_back_to_a_random_orthogonal_matrix():
    assert hadamard_order_kind(6) is None and hadamard_order_kind(576) == (72, "paley1")
    q, kind = rotation(6, seed=3)
    assert kind == "random orthogonal"
    assert torch.allclose(q @ q.t(), torch.eye(6, dtype=torch.float64), atol=1e-12)
    r1, k1 = rotation(64, seed=1)
    r2, _ = rotation(64, seed=2)
    assert k1 == "randomized hadamard" and not torch.equal(r1, r2)  # the seed draws the signs
    assert torch.allclose(r1 @ r1.t(), torch.eye(64, dtype=torch.float64), atol=1e-12)


def _rotated_model(model_dir, stage: RotateStage):
    """The model as transformers builds it from the rotated tensors (fp32)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    view = RotatedCheckpoint(LazyCheckpoint(model_dir), config, arch_for(config), stage)
    for k, v in view.config_overrides.items():
        setattr(config, k, v)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    state = {k: v.float() for k, v in view.get_many(view.keys()).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()  # attention-only keeps them tied
    assert not unexpected and set(missing) <= tied, (missing, unexpected)
    return model, view


def _float32_copy(src, dest):
    """The tiny model stored in float32 (rotation checked without the bf16 rounding of its storage), its norms'
    weights drawn at random."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():  # trained norms are not all ones: give them real per-channel factors to fold
        for name, p in model.named_parameters():
            if p.ndim == 1 and "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(dest, safe_serialization=True)
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            (dest / f.name).write_bytes(f.read_bytes())
    return dest


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3", "gemma"])
def test_rotation_keeps_the_float_logits(tmp_path, model_type):
    from transformers import AutoModelForCausalLM

    model_dir = _float32_copy(make_tiny_model(tmp_path / "bf16", model_type), tmp_path / "f32")
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    got, view = _rotated_model(model_dir, RotateStage(method="rotate"))
    q_name = "model.layers.0.self_attn.q_proj.weight"
    # the weights really moved: each q_proj column mixes every input channel now
    assert (got.get_parameter(q_name) - ref.get_parameter(q_name)).abs().max() > 0.05
    assert view.config_overrides == ({"tie_word_embeddings": False} if ref.config.tie_word_embeddings else {})
    a, b = logits(ref), logits(got)
    assert (a - b).abs().max() <= 1e-4 * (a.max() - a.min())
    # and the check can fail: the residual rotation without the attention one is a different, equally exact
    # model, but dropping the o_proj half of R2 is not
    view2 = RotatedCheckpoint(LazyCheckpoint(model_dir), got.config, arch_for(got.config), RotateStage(method="rotate"))
    broken = view2._rules["model.layers.0.self_attn.o_proj.weight"]
    view2._rules["model.layers.0.self_attn.o_proj.weight"] = (broken[0].replace("+heads_columns", ""), None)
    got.load_state_dict({k: v.float() for k, v in view2.get_many(view2.keys()).items()}, strict=False)
    assert (logits(got) - a).abs().max() > 1e-2 * (a.max() - a.min())


def test_gemma2_rotates_attention_only_and_moe_is_refused(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.setitem(conftest.TINY_CONFIGS, "gemma2", dict(conftest.TINY_CONFIGS["gemma"]))
    model_dir = _float32_copy(make_tiny_model(tmp_path / "g2", "gemma2"), tmp_path / "g2f32")
    with pytest.raises(ModelError, match="normalise the attention and MLP outputs"):
        _rotated_model(model_dir, RotateStage(method="rotate"))
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    got, _ = _rotated_model(model_dir, RotateStage(method="rotate", residual=False))
    a = logits(ref)
    assert (a - logits(got)).abs().max() <= 1e-4 * (a.max() - a.min())
    moe = make_tiny_model(tmp_path / "moe", "mixtral")
    with pytest.raises(ModelError, match="mixture-of-experts"):
        _rotated_model(moe, RotateStage(method="rotate"))


def test_rotation_spreads_outlier_channels_so_weights_quantize_better():
    # a Linear whose input columns include a few 20x channels (what norms fold into q/k/v): the rotated weight
    # has no column that dominates its group, so RTN's error (measured back in the original basis) drops
    g = torch.Generator().manual_seed(0)
    w = torch.randn(128, 576, generator=g, dtype=torch.float64) * 0.02
    w[:, [5, 100, 333]] *= 20
    q, _ = rotation(576, seed=0)
    for scheme in ("W4A16", "W8A8"):
        spec = get_scheme(scheme).with_overrides(group_size=64 if scheme == "W4A16" else None).weights
        plain = (rtn(w.float(), spec, torch.float32)[0].double() - w).pow(2).mean()
        rotated = ((rtn((w @ q).float(), spec, torch.float32)[0].double() @ q.t()) - w).pow(2).mean()
        assert rotated < 0.7 * plain, (scheme, float(rotated), float(plain))


def test_rotate_recipe_rules(tmp_path):
    base = tiny_recipe(tmp_path, tmp_path, [])
    quant = {"method": "rtn", "scheme": "W4A16", "group_size": 16}
    for stages, message in (
            ([quant, {"method": "rotate"}], "move it above stages\\[0\\]"),
            ([{"method": "rotate"}, {"method": "rotate"}, quant], "make it stages\\[0\\], and keep one"),
            ([{"method": "rotate"}], "must be followed by the quantizer stages"),
            ([{"method": "rotate", "residual": False, "attention": False}, quant], "rotates nothing"),
            ([{"method": "rotate"}, {"method": "qat", "scheme": "W4A16", "group_size": 16}], "unrotated")):
        with pytest.raises(RecipeError, match=message):
            parse_recipe({**base, "stages": stages})


def test_a_rotated_conversion_unties_the_embeddings_and_reloads_exactly(tiny_llama, calib_text, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from quantkit import api

    out = tmp_path / "rot"
    recipe = parse_recipe(tiny_recipe(tiny_llama, calib_text, [
        {"method": "rotate"}, {"method": "gptq", "scheme": "W4A16", "group_size": 16}]))
    seen: dict[str, torch.Tensor] = {}
    api.convert(recipe, out, quiet=True, on_weight=lambda n, t: seen.__setitem__(n, t))
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    rotation_facts = json.loads((out / "manifest.json").read_text())["conversion"]["rotation"]
    assert rotation_facts["residual_rotation"] == "randomized hadamard 64"
    assert rotation_facts["attention_rotation"] == "randomized hadamard 16 per head"
    got = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    b = logits(got)  # compressed-tensors decompresses the weights on the first forward
    for name, w in seen.items():  # bit-exact quantized weights after the round trip
        if name.endswith("proj"):
            assert torch.equal(got.get_submodule(name).weight.to(torch.bfloat16), w.to(torch.bfloat16)), name
    # the float tensors it stores are the rotated model's own (in the checkpoint's bf16), lm_head untied
    config = AutoConfig.from_pretrained(tiny_llama)
    view = RotatedCheckpoint(LazyCheckpoint(tiny_llama), config, arch_for(config), recipe.stages[0])
    for name in ("lm_head.weight", "model.embed_tokens.weight", "model.norm.weight",
                 "model.layers.1.input_layernorm.weight"):
        assert torch.equal(got.get_parameter(name).to(torch.bfloat16), view.get(name)), name
    from safetensors import safe_open

    with safe_open(str(next(out.glob("*.safetensors"))), framework="pt") as f:
        assert "lm_head.weight" in f.keys()  # its own tensor now (the source model ties it)
    # quantized, it is still the same model: logits stay close to the float model's
    a = logits(AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval())
    assert torch.isfinite(b).all() and (a - b).abs().mean() < 0.1 * (a.max() - a.min())
