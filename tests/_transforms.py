"""Helpers for the transform tests: run a recipe's transform stages alone on a float HF model, layer by
layer through the pipeline's own code (plan_layers -> apply_transforms), and compare logits."""

from __future__ import annotations

import torch

from conftest import tiny_recipe
from quantkit.models import arch_for
from quantkit.pipeline import plan_layers
from quantkit.recipe import parse_recipe
from quantkit.transforms import apply_transforms


def calibration_ids(recipe, model_dir):
    from transformers import AutoTokenizer

    from quantkit.data import build_calibration_set

    return build_calibration_set(recipe.calibration, AutoTokenizer.from_pretrained(model_dir)).input_ids


def transform_float_model(model_dir, calib_dir, stages):
    """(float model, transformed float model, per-target stats, recipe): nothing is quantized."""
    from transformers import AutoModelForCausalLM

    recipe = parse_recipe(tiny_recipe(model_dir, calib_dir, stages))
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    arch = arch_for(model.config)
    plans, _ = plan_layers(model, arch, recipe)
    layers = model.get_submodule(arch.layers)
    seen: dict[int, tuple] = {}

    def record(module, args, kwargs, i):
        import inspect

        names = list(inspect.signature(module.forward).parameters)
        kw = {**dict(zip(names[1:], args[1:])), **kwargs}  # positional extras by name
        seen.setdefault(i, (args[0], {k: v for k, v in kw.items() if k not in ("past_key_values", "use_cache")}))

    handles = [layer.register_forward_pre_hook(lambda m, a, k, i=i: record(m, a, k, i), with_kwargs=True)
               for i, layer in enumerate(layers)]
    with torch.no_grad():
        model(calibration_ids(recipe, model_dir), use_cache=False)
    for h in handles:
        h.remove()
    stats: dict = {}
    for i, plan in enumerate(plans):  # the float layer input is the same before and after transforms
        hidden, kwargs = seen[i]
        names = {t.name for g in plan.groups for t in g}
        res = apply_transforms(layers[i], plan.prefix, plan.smoothing, recipe, [(hidden, kwargs)], torch.bfloat16, names)
        stats.update({k: v["smoothing"] for k, v in res.items()})
    return ref, model, stats, recipe


def logits(model, seed=0):
    ids = torch.randint(3, 300, (2, 24), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(ids, use_cache=False).logits


def outlier_inputs(tokens: int, features: int, outliers=(3, 17, 40), factor: float = 30.0, seed: int = 0):
    """Activations with a few channels much larger than the rest, as LLM norms produce."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, features, generator=g)
    x[:, list(outliers)] *= factor
    return x
