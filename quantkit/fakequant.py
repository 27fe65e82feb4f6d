"""The in-memory quantized model: the float model with quantized weights and, for W8A8/FP8, dynamic
per-token activation quantization, exactly as the engine computes it. Used to check an export against
what the pipeline produced, and to measure quality without an engine."""

from __future__ import annotations

from pathlib import Path

import torch

from quantkit.algorithms.rtn import fake_quantize_activations
from quantkit.pipeline import plan_layers
from quantkit.models import arch_for
from quantkit.recipe import Recipe


def fake_quant_model(model_dir: Path, recipe: Recipe, weights: dict[str, torch.Tensor],
                     dtype: torch.dtype = torch.float32):
    """Load the float model, put the quantized weights in, hook activation quantization where the scheme has it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, use_safetensors=True,
                                                 trust_remote_code=recipe.model.trust_remote_code)
    model.eval()
    plans, _ = plan_layers(model, arch_for(model.config), recipe)
    for plan in plans:
        for members in plan.groups:
            for t in members:
                mod = model.get_submodule(t.name)
                mod.weight.data = weights[t.name].to(dtype)
                if t.scheme.activations is not None:
                    act = t.scheme.activations
                    mod.register_forward_pre_hook(
                        lambda _m, args, act=act: (fake_quantize_activations(args[0], act),) + tuple(args[1:]))
    params = dict(model.named_parameters())
    for name, w in weights.items():  # float tensors a transform stage rewrote (norm weights, biases)
        if name in params:
            params[name].data = w.to(dtype)
    return model
