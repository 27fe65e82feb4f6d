"""Architecture specs: where things are in one model family, as short data, registered explicitly.

A spec names the decoder layers' container, the embedding, the true-sequential groups of Linears (each
group shares its input and is quantized before the next runs) and the smoothing mappings (the op whose
output feeds a set of Linears) that AWQ and SmoothQuant rescale. Names are relative to a decoder layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from quantkit.model import ModelError
from quantkit.model.moe import MoESpec, is_moe_layer


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
    # offline rotation (quantkit/algorithms/rotate.py): each norm on the residual stream and the Linears it
    # feeds, the Linears that add into the residual, the attention value path (v, o) and the final norm
    residual_readers: tuple[tuple[str, tuple[str, ...]], ...] = (
        ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
        ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
    )
    residual_writers: tuple[str, ...] = ("self_attn.o_proj", "mlp.down_proj")
    value_path: tuple[str, str] = ("self_attn.v_proj", "self_attn.o_proj")
    final_norm: str = "model.norm"
    rotation_refusal: str | None = None  # why the residual stream cannot be rotated offline (None: it can)
    extra: dict = field(default_factory=dict)
    # mixture of experts: where the sparse block is and how it routes (quantkit/model/moe.py); its layers
    # take their attention groups from `sequential` and one (gate, up) and one (down) group per expert
    moe: MoESpec | None = None

    def attention_module(self) -> str:
        """The attention module of a decoder layer (local name): the parent of the architecture's k_proj."""
        for group in self.sequential:
            for local in group:
                if local.endswith(".k_proj"):
                    return local.rsplit(".", 1)[0]
        raise ValueError(f"architecture {self.name!r} names no k_proj; its KV cache cannot be calibrated")

    def layer_groups(self, layer) -> tuple[tuple[str, ...], ...]:
        """The true-sequential groups of one decoder layer (a module of this family), local names."""
        block = is_moe_layer(layer, self)
        if block is None:
            return self.sequential
        where = next(n for n, m in layer.named_children() if m is block)
        mlp_roots = {self.moe.block, where}
        groups = tuple(g for g in self.sequential if g[0].split(".", 1)[0] not in mlp_roots)
        gate, up, down = self.moe.linears
        for e in range(block.num_experts):
            groups += ((f"{where}.experts.{e}.{gate}", f"{where}.experts.{e}.{up}"), (f"{where}.experts.{e}.{down}",))
        return groups


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
register_arch(ArchSpec("gemma2", ("gemma2", "gemma3_text"), extra={"norm_offset": 1.0}, rotation_refusal=(
    "Gemma 2/3 normalise the attention and MLP outputs (post_attention_layernorm, post_feedforward_layernorm) before "
    "adding them to the residual, so a rotation of the residual stream cannot be folded into o_proj / down_proj"),
    smoothing=(
    ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ("self_attn.v_proj", ("self_attn.o_proj",)),
    ("pre_feedforward_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
    ("mlp.up_proj", ("mlp.down_proj",)),
)))


# Qwen3-MoE: every layer sparse unless listed in mlp_only_layers (those keep a dense mlp); no shared expert
register_arch(ArchSpec("qwen3_moe", ("qwen3_moe",), moe=MoESpec(
    block="mlp", stored=("mlp",), num_experts="num_experts", intermediate="moe_intermediate_size",
    linears=("gate_proj", "up_proj", "down_proj"), renormalize="norm_topk_prob")))
# Mixtral: checkpoints keep the block at block_sparse_moe (transformers 5 calls it mlp), experts w1/w3/w2
register_arch(ArchSpec("mixtral", ("mixtral",), moe=MoESpec(
    block="mlp", stored=("block_sparse_moe", "mlp"), num_experts="num_local_experts",
    intermediate="intermediate_size", linears=("w1", "w3", "w2"), renormalize=True)))


def arch_for(config) -> ArchSpec:
    mt = getattr(config, "model_type", None)
    if mt not in ARCHS:
        raise ModelError(f"model_type {mt!r} has no architecture spec (known: {', '.join(sorted(ARCHS))}); "
                         "add one with quantkit.model.arch.register_arch")
    return ARCHS[mt]
