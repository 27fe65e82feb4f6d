"""Architecture specs: where things are in one model family, as short data, registered explicitly.

A spec names the decoder layers' container, the embedding, the true-sequential groups of Linears (each
group shares its input and is quantized before the next runs) and the smoothing mappings (the op whose
output feeds a set of Linears) that AWQ and SmoothQuant rescale. Names are relative to a decoder layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from quantkit.model import ModelError


@dataclass(frozen=True)
class ArchSpec:
    """Where things are in one model family, as data. Names are relative to a decoder layer."""

    name: str
    model_types: tuple[str, ...]
    layers: str = "model.layers"
    embed: str = "model.embed_tokens"
    # true-sequential order: each group shares its input and is quantized before the next group runs
    sequential: tuple[tuple[str, ...], ...] = (
        ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        ("self_attn.o_proj",),
        ("mlp.gate_proj", "mlp.up_proj"),
        ("mlp.down_proj",),
    )
    # (preceding op, ops it feeds): used by smoothing transforms (AWQ, SmoothQuant)
    smoothing: tuple[tuple[str, tuple[str, ...]], ...] = (
        ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
        ("self_attn.v_proj", ("self_attn.o_proj",)),
        ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
        ("mlp.up_proj", ("mlp.down_proj",)),
    )
    extra: dict = field(default_factory=dict)


ARCHS: dict[str, ArchSpec] = {}


def register_arch(spec: ArchSpec) -> ArchSpec:
    for mt in spec.model_types:
        if mt in ARCHS:
            raise ValueError(f"model_type {mt!r} registered twice")
        ARCHS[mt] = spec
    return spec


register_arch(ArchSpec("llama", ("llama",)))
register_arch(ArchSpec("mistral", ("mistral",)))
register_arch(ArchSpec("qwen2", ("qwen2",)))
register_arch(ArchSpec("qwen3", ("qwen3",)))  # q_norm / k_norm sit inside attention; linears as llama
# Gemma: the norms are applied as (1 + weight); folding a smoothing scale into them needs care.
register_arch(ArchSpec("gemma", ("gemma",), extra={"norm_offset": 1.0}))
# Gemma 2/3 normalise the attention output (post_attention_layernorm) before the residual add; the MLP
# reads pre_feedforward_layernorm, so that is the norm a smoothing scale folds into.
register_arch(ArchSpec("gemma2", ("gemma2", "gemma3_text"), extra={"norm_offset": 1.0}, smoothing=(
    ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ("self_attn.v_proj", ("self_attn.o_proj",)),
    ("pre_feedforward_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
    ("mlp.up_proj", ("mlp.down_proj",)),
)))


def arch_for(config) -> ArchSpec:
    mt = getattr(config, "model_type", None)
    if mt not in ARCHS:
        raise ModelError(f"model_type {mt!r} has no architecture spec (known: {', '.join(sorted(ARCHS))}); "
                         "add one with quantkit.model.arch.register_arch")
    return ARCHS[mt]
