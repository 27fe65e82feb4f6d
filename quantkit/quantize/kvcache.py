"""FP8 KV-cache scales (recipe `kv_cache:`), calibrated in the layer walk from the keys and values the
quantized model's attention receives: scale = amax / 448, per layer or per KV head. docs/design.md says how."""

from __future__ import annotations

import sys

import torch
from torch import nn

from quantkit.distributed import ChunkFold, ChunkLayout

KV_ATTENTION = "quantkit_kv_observe"  # the attention implementation name registered with transformers
FP8_E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
MIN_AMAX = 1e-6  # an all-zero k or v (a dead head) still gets a positive scale: vLLM divides by it
STRATEGY_CT = {"tensor": "tensor", "head": "attn_head"}  # recipe strategy -> compressed-tensors strategy


def scales_from_amax(amax: torch.Tensor, strategy: str) -> torch.Tensor:
    """fp32 scales from per-KV-head maxima ([heads]): [1] for tensor, [heads, 1, 1] for head (the shapes
    compressed-tensors gives k_scale / v_scale, and vLLM's loader reads)."""
    a = amax.float().clamp_min(MIN_AMAX)
    if strategy == "tensor":
        return (a.max() / FP8_E4M3_MAX).reshape(1)
    if strategy == "head":
        return (a / FP8_E4M3_MAX).reshape(-1, 1, 1)
    raise ValueError(f"unknown kv_cache strategy {strategy!r} (known: {', '.join(STRATEGY_CT)})")


def kv_cache_args(spec):
    """The compressed-tensors QuantizationArgs of a recipe's `kv_cache` (None: none), what config.json's
    quantization_config.kv_cache_scheme holds."""
    if spec is None:
        return None
    from compressed_tensors.quantization import QuantizationArgs

    return QuantizationArgs(num_bits=8, type="float", strategy=STRATEGY_CT[spec.strategy], dynamic=False,
                            symmetric=True)


def scale_names(prefix: str, attention: str) -> tuple[str, str]:
    """('model.layers.3.self_attn.k_scale', '...v_scale'): the checkpoint names vLLM maps to attn.k_scale."""
    return f"{prefix}{attention}.k_scale", f"{prefix}{attention}.v_scale"


def _observing_attention(module: nn.Module, query, key, value, attention_mask, *args, **kwargs):
    obs: KVObserver | None = getattr(module, "_quantkit_kv", None)
    if obs is None:  # a module that is not being observed (never set by quantkit): plain sdpa
        return _implementation("sdpa", module)(module, query, key, value, attention_mask, *args, **kwargs)
    obs.record(key, value)
    return _implementation(obs.inner, module)(module, query, key, value, attention_mask, *args, **kwargs)


def _implementation(name: str, module: nn.Module):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name in (None, "eager"):  # each modeling file has its own eager function (the interface's default)
        fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if fn is None:
            raise RuntimeError(f"{type(module).__name__}: no eager_attention_forward to delegate to")
        return fn
    return ALL_ATTENTION_FUNCTIONS[name]


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(KV_ATTENTION, _observing_attention)


_register()


class KVObserver:
    """One layer's k/v maxima over the calibration chunks; `finish()` folds them across ranks and returns
    the scale tensors by checkpoint name.

    An observer of the layer walk (quantkit/quantize/walk.py): installed on the layer's attention module until
    `remove`; each chunk's attention call adds one payload, in this rank's chunk order."""

    def __init__(self, prefix: str, attention: str, strategy: str, layout: ChunkLayout):
        self.attention, self.names, self.strategy = attention, scale_names(prefix, attention), strategy
        self.amax: list[torch.Tensor | None] = [None, None]
        self.calls = 0
        self._fold = ChunkFold(layout, self._fold_max, eager=False)

    def install(self, layer: nn.Module) -> None:
        """Observe the layer's attention module: its config's attention implementation becomes KV_ATTENTION."""
        self.attn = layer.get_submodule(self.attention)
        self.inner = self.attn.config._attn_implementation
        self.attn._quantkit_kv = self
        self.attn.config._attn_implementation = KV_ATTENTION

    def remove(self) -> None:
        self.attn.config._attn_implementation = self.inner
        if getattr(self.attn, "_quantkit_kv", None) is self:
            del self.attn._quantkit_kv

    def record(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """key, value: [batch, kv_heads, seq, head_dim] as the attention kernel gets them."""
        self.calls += 1
        self._fold.add([key.detach().abs().amax(dim=(0, 2, 3)).float().cpu(),
                        value.detach().abs().amax(dim=(0, 2, 3)).float().cpu()])

    def _fold_max(self, payload) -> None:
        for i in (0, 1):
            self.amax[i] = payload[i] if self.amax[i] is None else torch.maximum(self.amax[i], payload[i])

    def finish(self) -> tuple[dict[str, torch.Tensor], dict]:
        """({k_scale name: tensor, v_scale name: tensor}, stats) once every chunk has been through attention."""
        self._fold.finish()
        if self.amax[0] is None:
            raise RuntimeError(f"{self.names[0]}: attention never ran on the calibration chunks (internal error)")
        k, v = (scales_from_amax(a, self.strategy) for a in self.amax)
        stats = {"module": self.names[0].rsplit(".", 1)[0], "strategy": self.strategy,
                 "k_amax": self.amax[0].tolist(), "v_amax": self.amax[1].tolist(),
                 "k_scale": k.flatten().tolist(), "v_scale": v.flatten().tolist()}
        return {self.names[0]: k, self.names[1]: v}, stats


def manifest_section(spec, ct_args: dict | None, stats: dict[str, dict]) -> dict | None:
    """manifest.json's quantization.kv_cache: the recipe's scheme, what config.json declares, and per
    attention module the calibrated maxima (per KV head) and the scales the checkpoint holds. Takes the
    per-layer records out of the module stats they travelled in (quantkit/quantize/layers.py)."""
    layers = {}
    for module_stats in stats.values():
        rec = module_stats.pop("kv_cache", None)
        if rec is not None:
            layers[rec["module"]] = {k: v for k, v in rec.items() if k != "module"}
    if spec is None:
        return None
    k_all = [x for r in layers.values() for x in r["k_scale"]]
    v_all = [x for r in layers.values() for x in r["v_scale"]]
    return {"scheme": spec.scheme, "strategy": spec.strategy, "kv_cache_scheme": ct_args,
            "observed": "keys after RoPE (and k_norm) and values as the attention receives them, in the quantized "
                        "model's calibration forward; scale = amax / 448",
            "summary": {"layers": len(layers), "k_scale_min": min(k_all, default=None),
                        "k_scale_max": max(k_all, default=None), "v_scale_min": min(v_all, default=None),
                        "v_scale_max": max(v_all, default=None)},
            "layers": layers}
