"""Helpers for the transform tests: run a recipe's transform stages alone on a float HF model, layer by
layer through the pipeline's own code (make_plan -> capture_layer_inputs -> apply_transforms), and
compare logits."""

from __future__ import annotations

import torch

from conftest import tiny_recipe
from quantkit.model.arch import arch_for
from quantkit.model.checkpoint import LazyCheckpoint, build_skeleton
from quantkit.plan import make_plan
from quantkit.quantize.layers import Job
from quantkit.quantize.walk import capture_layer_inputs
from quantkit.quantize.transforms import apply_transforms
from quantkit.recipe import parse_recipe


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
    plan = make_plan(model, arch, recipe)
    layers = model.get_submodule(arch.layers)
    # the first layer's input and every layer's keyword arguments, exactly as the pipeline captures them
    ids = calibration_ids(recipe, model_dir)
    hidden, kwargs_by_size = capture_layer_inputs(build_skeleton(model_dir, "float32"), arch, LazyCheckpoint(model_dir),
                                                  ids, torch.float32, ids.shape[0])
    job = Job(plan, torch.bfloat16)
    stats: dict = {}
    for i, lp in enumerate(plan.layers):  # the float layer input is the same before and after transforms
        kwargs = kwargs_by_size[ids.shape[0]][i]
        with torch.no_grad():
            out = layers[i](hidden, **kwargs)
        res = apply_transforms(layers[i], lp.prefix, lp.smoothing, job, [(hidden, kwargs)], {t.name for t in lp.targets})
        stats.update({k: v.smoothing for k, v in res.items()})
        hidden = out[0] if isinstance(out, tuple) else out
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
