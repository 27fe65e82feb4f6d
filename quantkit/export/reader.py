"""The in-memory quantized model: the float model with quantized weights and, for W8A8/FP8, dynamic
per-token activation quantization, exactly as the engine computes it. Used to check an export against
what the pipeline produced, and to measure quality without an engine."""

from __future__ import annotations

from pathlib import Path

import torch

from quantkit.algorithms.rtn import activation_pre_hook
from quantkit.model.arch import arch_for
from quantkit.plan import make_plan
from quantkit.recipe import Recipe


def fake_quant_model(model_dir: Path, recipe: Recipe, weights: dict[str, torch.Tensor],
                     dtype: torch.dtype = torch.float32):
    """Load the float model, put the quantized weights in, hook activation quantization where the scheme has it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, use_safetensors=True,
                                                 trust_remote_code=recipe.model.trust_remote_code)
    model.eval()
    for t in make_plan(model, arch_for(model.config), recipe).targets.values():
        mod = model.get_submodule(t.name)
        mod.weight.data = weights[t.name].to(dtype)
        if t.scheme.activations is not None:
            mod.register_forward_pre_hook(activation_pre_hook(t.scheme.activations))
    params = dict(model.named_parameters())
    for name, w in weights.items():  # float tensors a transform stage rewrote (norm weights, biases)
        if name in params:
            params[name].data = w.to(dtype)
    return model
