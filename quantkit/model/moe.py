"""Mixture-of-experts layers, one Linear per expert, the way checkpoints and vLLM name them.

transformers (5.x) keeps a sparse block's experts as two 3-D parameters (`gate_up_proj`, `down_proj`) and
converts the checkpoint's per-expert tensors into them at load time. quantkit quantizes, and vLLM loads,
one Linear per expert (`...experts.7.gate_proj.weight`, Mixtral's `...experts.7.w1.weight`). So before
anything is planned, `unfuse_experts` replaces every sparse block of the module tree (on the meta device)
with a `SparseMoE`: the router as a Linear, each expert as its own Linears, registered under the name the
checkpoint stores the block at (Mixtral: `block_sparse_moe`, while transformers calls the attribute `mlp`).
Its forward routes exactly like the transformers block: softmax over the router logits in fp32, top-k,
renormalised where the family does.

Calibration of experts (quantkit.quantize.layers): during a layer's calibration forward a `RoutingObserver`
sees every token's routing; each expert's Linears then see only the tokens routed to them. An expert that
receives fewer than `calibration.moe.min_tokens` tokens takes the recipe's fallback: `all_tokens` (its
Linears are calibrated on every token of the batch, as if the router had sent them all; its output still
only counts for the tokens really routed to it) or `rtn` (round-to-nearest, no data). The manifest records
each expert's routed token count and which calibration it got. The router is never quantized.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from quantkit.model import ModelError


@dataclass(frozen=True)
class MoESpec:
    """Where a family keeps its sparse block, as data."""

    block: str  # the decoder layer's attribute holding the sparse block in transformers ("mlp")
    stored: tuple[str, ...]  # where checkpoints keep it, in order of preference ("block_sparse_moe", "mlp")
    num_experts: str  # config attribute: how many experts
    intermediate: str  # config attribute: one expert's intermediate size
    linears: tuple[str, str, str]  # one expert's (gate, up, down) Linears as the checkpoint names them
    renormalize: str | bool  # config attribute, or a constant: top-k weights renormalised to sum 1
    router: str = "gate"  # the router Linear inside the block


class MoERouter(nn.Linear):
    """The router of a sparse block: a Linear that is never quantized (the class name keeps a recipe's
    `targets: [Linear]` from matching it, and the plan refuses a recipe that names it)."""


class Expert(nn.Module):
    def __init__(self, hidden: int, inter: int, names: tuple[str, str, str], act):
        super().__init__()
        self.names = names
        for n, (i, o) in zip(names, ((hidden, inter), (hidden, inter), (inter, hidden))):
            self.add_module(n, nn.Linear(i, o, bias=False))
        self.act = act

    def linears(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        return tuple(getattr(self, n) for n in self.names)  # type: ignore[return-value]


class RoutingObserver:
    """What one layer's calibration forward learns about routing: tokens per expert over every chunk, the
    all-token input of the block (for the `all_tokens` fallback) and which experts take it."""

    def __init__(self, num_experts: int, need_all_tokens: bool):
        from quantkit.algorithms.gptq import HessianAccumulator

        self.counts = torch.zeros(num_experts, dtype=torch.long)
        self.need_all_tokens = need_all_tokens
        self._acc_cls = HessianAccumulator
        self.all_inputs = None  # HessianAccumulator over every token entering the block
        self.all_token_experts: set[int] = set()  # experts whose down_proj sees every token
        self.samples: list[torch.Tensor] = []  # the first rows entering the block (diagnostics of rtn stages)

    def routed(self, flat: torch.Tensor, idx: torch.Tensor) -> None:
        self.counts += torch.bincount(idx.reshape(-1).cpu(), minlength=len(self.counts))
        if self.need_all_tokens:
            if self.all_inputs is None:
                self.all_inputs = self._acc_cls(flat.shape[-1], device=flat.device)
            self.all_inputs.add(flat)

    def all_token_hessian(self) -> torch.Tensor:
        return self.all_inputs.H


class SparseMoE(nn.Module):
    """A sparse block with one Linear per expert; routes like the transformers block it replaces."""

    def __init__(self, spec: MoESpec, config):
        super().__init__()
        from transformers.activations import ACT2FN

        hidden = config.hidden_size
        self.num_experts = int(getattr(config, spec.num_experts))
        self.top_k = int(config.num_experts_per_tok)
        inter = int(getattr(config, spec.intermediate))
        self.renormalize = (bool(getattr(config, spec.renormalize, False)) if isinstance(spec.renormalize, str)
                            else spec.renormalize)
        self.router_name = spec.router
        self.add_module(spec.router, MoERouter(hidden, self.num_experts, bias=False))
        act = ACT2FN[config.hidden_act]
        self.experts = nn.ModuleList(Expert(hidden, inter, spec.linears, act) for _ in range(self.num_experts))
        self.observer: RoutingObserver | None = None  # set by the calibration forward only

    def route(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = getattr(self, self.router_name)(flat)
        probs = torch.softmax(logits.float(), dim=-1)
        weights, idx = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(flat.dtype), idx

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        flat = hidden_states.reshape(-1, shape[-1])
        weights, idx = self.route(flat)
        obs = self.observer
        if obs is not None:
            obs.routed(flat, idx)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            tok, pos = torch.where(idx == e)
            gate, up, down = expert.linears()
            if obs is None and tok.numel() == 0:
                continue
            # calibrating, every expert is called, even with no tokens: its Linears' input hooks must fire
            x = flat[tok]
            mid = expert.act(gate(x)) * up(x)
            if obs is not None and e in obs.all_token_experts:  # fallback: down_proj calibrated on every token
                # gate/up are quantized by now; .forward skips their hooks (their inputs were gathered), so
                # this all-token pass sees their weights without activation rounding
                y = down(expert.act(gate.forward(flat)) * up.forward(flat))[tok]
            else:
                y = down(mid)
            out.index_add_(0, tok, (y * weights[tok, pos, None]).to(out.dtype))
        return out.reshape(shape)


def is_moe_layer(layer: nn.Module, arch) -> SparseMoE | None:
    """The layer's sparse block once unfused, else None (dense layers of a MoE model, dense models)."""
    if arch.moe is None:
        return None
    for name in arch.moe.stored:
        mod = getattr(layer, name, None) if name in layer._modules else None
        if isinstance(mod, SparseMoE):
            return mod
    return None


def stored_prefix(spec: MoESpec, keys, layer_prefix: str) -> str | None:
    """Where this checkpoint keeps layer `layer_prefix`'s sparse block (None: the layer is dense)."""
    for name in spec.stored:
        if f"{layer_prefix}{name}.{spec.router}.weight" in keys:
            return name
    return None


def unfuse_experts(model: nn.Module, arch, keys) -> int:
    """Replace every sparse block of `model` (on the meta device) with a `SparseMoE` registered where the
    checkpoint (`keys`: its tensor names) stores it. Returns how many blocks were replaced."""
    spec: MoESpec | None = arch.moe
    if spec is None:
        return 0
    keys = set(keys)
    layers = model.get_submodule(arch.layers)
    done = 0
    for li, layer in enumerate(layers):
        prefix = f"{arch.layers}.{li}."
        where = stored_prefix(spec, keys, prefix)
        if where is None:
            continue  # a dense layer (Qwen3-MoE's mlp_only_layers)
        e0 = f"{prefix}{where}.experts.0.{spec.linears[0]}.weight"
        if e0 not in keys:
            raise ModelError(f"{prefix}{where}: the checkpoint has a router but no per-expert tensor {e0!r}; "
                             "quantkit reads experts stored one Linear each (the form transformers saves)")
        with torch.device("meta"):
            block = SparseMoE(spec, model.config)
        if spec.block in layer._modules:
            del layer._modules[spec.block]
        layer.add_module(where, block)
        if where != spec.block:  # the layer's forward calls self.<block>: the same module, under its stored name
            object.__setattr__(layer, spec.block, block)
        done += 1
    return done
