"""Reading what the writer wrote, its inverse: one exported Linear's stored tensors and config group, its
codes and scales decoded (by quantkit, and by compressed-tensors' own decompressor), and the fake-quantized
model (the float model with quantized weights and, for W8A8/FP8, dynamic per-token activation
quantization, exactly as the engine computes it), used to check an export against what the pipeline
produced and to measure quality without an engine."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from quantkit.algorithms.rtn import activation_pre_hook
from quantkit.model.arch import arch_for
from quantkit.targets import matches_pattern
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


# ----------------------------------------------------------------------------------- exported tensors
PACK_FACTOR_INT4 = 8  # 4-bit codes per int32 in compressed-tensors' pack-quantized format


# ----------------------------------------------------------------------------------- exported tensors
@dataclass
class ExportedLinear:
    """One Linear as the export stores it: the compressed-tensors config group and its tensors (local names)."""

    name: str
    group: dict  # {"weights": {...}, "input_activations": {...} | None, "format": ...}
    tensors: dict[str, torch.Tensor] = field(repr=False)

    @property
    def shape(self) -> tuple[int, int]:
        if "weight_shape" in self.tensors:
            out_f, in_f = (int(v) for v in self.tensors["weight_shape"].tolist())
            return out_f, in_f
        return tuple(self.tensors["weight"].shape)  # type: ignore[return-value]

    @property
    def weights(self) -> dict:
        return self.group["weights"]

    @property
    def activations(self) -> dict | None:
        return self.group.get("input_activations")

    def quantization_config(self) -> dict:
        """A config.json `quantization_config` holding only this Linear's group (what vLLM reads)."""
        fmt = self.group.get("format") or "int-quantized"
        return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
                "config_groups": {"group_0": {**self.group, "targets": ["Linear"]}}, "ignore": []}


def _group_for(qc: dict, name: str) -> dict:
    for group in (qc.get("config_groups") or {}).values():
        if matches_pattern(group.get("targets") or [], name, "Linear"):
            return group
    raise KeyError(f"{name}: no config group of this export targets it")


def read_exported_linear(export_dir: Path, name: str) -> ExportedLinear:
    """The tensors an export holds for Linear `name` (e.g. model.layers.3.mlp.down_proj), with its group."""
    from safetensors import safe_open

    export_dir = Path(export_dir)
    qc = json.loads((export_dir / "config.json").read_text())["quantization_config"]
    index = export_dir / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file()
             else ["model.safetensors"])
    tensors: dict[str, torch.Tensor] = {}
    for fname in files:
        with safe_open(str(export_dir / fname), "pt") as f:
            for key in f.keys():
                if key.startswith(name + ".") and "." not in key[len(name) + 1:]:
                    tensors[key[len(name) + 1:]] = f.get_tensor(key)
    if not tensors:
        raise KeyError(f"{name}: not in {export_dir}")
    return ExportedLinear(name, _group_for(qc, name), tensors)


def unpack_int4(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """pack-quantized int32 [out, in/8] -> signed codes [out, in] (8 codes per int32, lowest bits first,
    stored with +8 offset)."""
    p = packed.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(PACK_FACTOR_INT4, dtype=torch.int64) * 4
    codes = (p.unsqueeze(-1) >> shifts) & 0xF  # [out, in/8, 8]
    return codes.reshape(packed.shape[0], -1)[:, :in_features].to(torch.int32) - 8


def codes_and_scales(lin: ExportedLinear) -> tuple[torch.Tensor, torch.Tensor]:
    """(integer codes [out, in] as int32, fp32 scale expanded per column [out, in]) of a symmetric export."""
    out_f, in_f = lin.shape
    w = lin.weights
    if not w.get("symmetric", True) or "weight_zero_point" in lin.tensors or "weight_g_idx" in lin.tensors:
        raise NotImplementedError("only symmetric exports without g_idx are handled here")
    if "weight_packed" in lin.tensors:
        q = unpack_int4(lin.tensors["weight_packed"], in_f)
    else:
        q = lin.tensors["weight"].to(torch.int32)
    scale = lin.tensors["weight_scale"].float()  # [out, n_groups]
    per_col = scale.repeat_interleave(in_f // scale.shape[1], dim=1)
    return q, per_col


def dequantize(lin: ExportedLinear) -> torch.Tensor:
    """What the export means to quantkit: code * scale in float32 (exact: small integers times bf16 scales)."""
    q, s = codes_and_scales(lin)
    return q.float() * s


def dequantize_compressed_tensors(lin: ExportedLinear, scale_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """What compressed-tensors' own decompressor gives (float32 result). It dequantizes in the scale's dtype:
    transformers loads the scales into the model's dtype first (float32 in the reference column: exact);
    with bf16 scales the products code * scale are rounded to bf16."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    scheme = QuantizationScheme(targets=["Linear"], weights=lin.weights,
                                input_activations=lin.activations, format=lin.group.get("format"))
    comp = BaseCompressor.get_value_from_registry(lin.group["format"])
    sd = dict(lin.tensors)
    sd["weight_scale"] = sd["weight_scale"].to(scale_dtype)
    return comp.decompress(sd, scheme)["weight"].float()
