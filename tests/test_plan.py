"""The plan is what the pipeline executes: each stage carries its registry entry and role, each target the
stage that owns it and the quantizer that produces its start, and the plan the calibration, MoE and
KV-cache policy, so nothing downstream reads the recipe's stages or names a method."""

from __future__ import annotations

import pytest

from conftest import tiny_recipe
from quantkit.algorithms.registry import FINETUNERS, METHODS, QUANTIZERS, ROTATIONS, TRANSFORMS, method_of
from quantkit.model.arch import arch_for
from quantkit.model.checkpoint import build_skeleton
from quantkit.plan import ConvertError, make_plan
from quantkit.recipe import RecipeError, parse_recipe

Q4 = {"scheme": "W4A16", "group_size": 16}


def _plan(model_dir, calib, stages, **extra):
    recipe = parse_recipe({**tiny_recipe(model_dir, calib, stages), **extra})
    m = build_skeleton(model_dir, "bfloat16")
    return make_plan(m, arch_for(m.config), recipe)


def test_every_registered_method_has_one_role_and_its_stage_config():
    assert set(METHODS) == set(QUANTIZERS) | set(TRANSFORMS) | set(ROTATIONS) | set(FINETUNERS)
    for name, entry in METHODS.items():
        assert entry.role in ("quantizer", "transform", "rotation", "finetune")
        assert entry.stage.model_fields["method"].annotation.__args__ == (name,)  # Literal["<name>"]
    for entry in FINETUNERS.values():  # a module only a fine-tune stage claims starts from a registered quantizer
        assert entry.starts_from in QUANTIZERS


def test_stages_carry_their_entry_and_targets_their_stage(tiny_llama, calib_text):
    plan = _plan(tiny_llama, calib_text, [{"method": "awq", "grid": 2}, {"method": "gptq", **Q4}])
    awq, gptq = plan.stages
    assert (awq.role, gptq.role) == ("transform", "quantizer") and awq.scheme is None
    assert gptq.method is method_of(gptq.config) and gptq.scheme.weights.group_size == 16
    t = next(iter(plan.targets.values()))
    assert t.stage is gptq and t.quantizer is QUANTIZERS["gptq"] and t.scheme is gptq.scheme
    assert all(sm.stage is awq for lp in plan.layers for sm in lp.smoothing)
    assert plan.finetune is None and plan.kv_cache is None
    assert plan.calibration.batch_size == 3 and plan.calibration.moe.fallback_quantizer is None  # all_tokens


def test_a_fine_tune_stage_is_the_plans_and_its_own_modules_start_from_its_entry(tiny_llama, calib_text):
    qat = {"method": "qat", **Q4, "steps": 2, "warmup_steps": 0}
    plan = _plan(tiny_llama, calib_text, [qat])
    assert plan.finetune is plan.stages[0] and plan.finetune.role == "finetune"
    assert {t.quantizer.name for t in plan.targets.values()} == {FINETUNERS["qat"].starts_from}
    assert all(t.stage is plan.finetune for t in plan.targets.values())


def test_policies_come_from_the_recipe_once(tiny_llama, calib_text):
    plan = _plan(tiny_llama, calib_text, [{"method": "rtn", "scheme": "W8A8"}],
                 kv_cache={"scheme": "FP8", "strategy": "head"})
    assert plan.kv_cache.strategy == "head" and plan.kv_cache.attention == "self_attn"
    weights_only = _plan(tiny_llama, None, [{"method": "rtn", "scheme": "W8A8"}])
    assert weights_only.calibration is None


def test_roles_decide_what_the_recipe_refuses(tiny_llama, calib_text):
    qat = {"method": "qat", **Q4, "steps": 2, "warmup_steps": 0}
    with pytest.raises(RecipeError, match=r"stages\[0\].method: 'qat' must be the last stage"):
        parse_recipe(tiny_recipe(tiny_llama, calib_text, [qat, {"method": "rtn", **Q4}]))
    with pytest.raises(RecipeError, match=r"kv_cache: .* a qat stage changes k_proj / v_proj"):
        parse_recipe({**tiny_recipe(tiny_llama, calib_text, [qat]), "kv_cache": {"scheme": "FP8"}})
    with pytest.raises(ConvertError, match="no module matches any stage's targets"):
        _plan(tiny_llama, None, [{"method": "rtn", **Q4, "targets": ["re:nothing"]}])
