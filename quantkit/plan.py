"""The plan: recipe + architecture -> the work of every decoder layer, decided before any weight loads.

This is the one place that matches module names against a recipe's `targets` / `ignore` patterns. It
says, per layer:
- which Linear each stage owns and with which scheme and method (`Target`), in true-sequential groups
  (q/k/v -> o -> gate/up -> down), each with the module whose input the group shares;
- which smoothing mappings (norm or Linear -> the Linears it feeds) a transform stage rescales;
and, for the whole model, the compressed-tensors config groups the export declares and the Linears
that stay in float. The pipeline, the transforms, QAT and the export all read this plan.

A stage claims a module when its targets match and its ignore does not; the first quantizer stage
that claims a module owns it. A `qat` stage fine-tunes what the stages before it produced; a module
only a `qat` stage claims starts from round-to-nearest (QAT_START), which the plan records as the
target's `method`, so nothing downstream guesses.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from quantkit.model.arch import ArchSpec
from quantkit.model.moe import is_moe_layer
from quantkit.patterns import exact_targets, matches_pattern
from quantkit.recipe import Recipe
from quantkit.schemes import Scheme, get_scheme

QAT_START = "rtn"  # how a module that only a qat stage claims gets its starting point


class ConvertError(RuntimeError):
    """A conversion problem, phrased for the user (the stage or module, and the fix)."""


def _claims(stage, name: str, cls_name: str) -> bool:
    return matches_pattern(stage.targets, name, cls_name) and not matches_pattern(stage.ignore, name, cls_name)


@dataclass
class Target:
    name: str  # full module name, e.g. model.layers.3.mlp.down_proj
    stage: int  # the recipe stage that owns it
    method: str  # the quantizer that produces its PTQ result (a qat stage's own modules: QAT_START)
    scheme: Scheme
    ct_scheme: object  # compressed-tensors QuantizationScheme


@dataclass
class Smoothing:
    """One smoothing mapping of one layer, claimed by one transform stage."""

    stage: int
    prev: str  # local name in the layer: "input_layernorm", "self_attn.v_proj", ...
    targets: list[Target]  # in the order of the architecture spec
    norm_offset: float = 0.0  # the norm multiplies by (offset + weight): 1 for Gemma


@dataclass
class LayerPlan:
    index: int
    prefix: str  # "model.layers.3."
    groups: list[list[Target]] = field(default_factory=list)  # true-sequential order
    group_inputs: list[str] = field(default_factory=list)  # module hooked to see each group's input
    smoothing: list[Smoothing] = field(default_factory=list)
    # a sparse (mixture-of-experts) layer: the block's local name and, per group index, (expert, "gate_up" |
    # "down"); quantkit/model/moe.py
    moe: str | None = None
    experts: dict[int, tuple[int, str]] = field(default_factory=dict)
    # local names vLLM serves as one kernel, so with one scheme: q/k/v, gate/up, and all of a block's experts
    fused: list[tuple[str, ...]] = field(default_factory=list)

    @property
    def targets(self) -> list[Target]:
        return [t for members in self.groups for t in members]


@dataclass
class Plan:
    layers: list[LayerPlan]
    unquantized: list[str]  # Linears that stay in float (lm_head, ignored ones)

    @property
    def targets(self) -> dict[str, Target]:
        return {t.name: t for layer in self.layers for t in layer.targets}

    def config_groups(self) -> dict[str, object]:
        """One compressed-tensors config group per stage that owns modules.

        A single stage that quantizes every decoder Linear targets `Linear` (lm_head and any other kept
        Linear are listed in `ignore`), the form every reader knows. With several stages each group lists
        its modules as anchored regexes with explicit layer indices, so no group over-matches.
        """
        schemes: dict[int, object] = {}
        names: dict[int, list[str]] = {}
        for t in self.targets.values():
            schemes.setdefault(t.stage, t.ct_scheme)
            names.setdefault(t.stage, []).append(t.name)
        if len(schemes) == 1:
            (si, scheme), = schemes.items()
            groups = {si: scheme.model_copy(update={"targets": ["Linear"]})}
        else:
            groups = {si: s.model_copy(update={"targets": exact_targets(names[si])}) for si, s in schemes.items()}
        return {f"group_{si}": s for si, s in groups.items()}


def stage_scheme(recipe: Recipe, i: int) -> Scheme:
    st = recipe.stages[i]
    return get_scheme(st.scheme).with_overrides(group_size=st.group_size, symmetric=st.symmetric)


def _ct_actorder(stage) -> str | None:
    return "group" if getattr(stage, "actorder", "none") == "group" else None


def make_plan(model: nn.Module, arch: ArchSpec, recipe: Recipe) -> Plan:
    """Every layer's work; fails early on group sizes that do not divide, lm_head, or a recipe that
    quantizes nothing."""
    from quantkit.algorithms.rtn import check_divisible

    layers = model.get_submodule(arch.layers)
    ct_schemes: dict[int, object] = {}
    plans = []
    all_linear = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    quantized: set[str] = set()
    for li in range(len(layers)):
        prefix = f"{arch.layers}.{li}."
        plan = LayerPlan(li, prefix)
        groups = arch.layer_groups(layers[li])
        block = is_moe_layer(layers[li], arch)
        if block is not None:
            plan.moe = next(n for n, m in layers[li].named_children() if m is block)
            _refuse_router(recipe, prefix + plan.moe + "." + block.router_name)
            qat = [si for si, st in enumerate(recipe.stages) if st.method == "qat"]
            if qat:
                raise ConvertError(f"recipe {recipe.name!r} stages[{qat[0]}]: QAT does not run on mixture-of-experts "
                                   "models yet (its student is transformers' model, whose experts are fused); use "
                                   "post-training stages (gptq, rtn, awq, smoothquant) for this model")
            expert_groups = [g for g in groups if g[0].startswith(plan.moe + ".experts.")]
            plan.fused = [g for g in groups if len(g) > 1 and g not in expert_groups]
            plan.fused.append(tuple(n for g in expert_groups for n in g))
        else:
            plan.fused = [g for g in groups if len(g) > 1]
        for group in groups:
            members = []
            for local in group:
                full = prefix + local
                mod = model.get_submodule(full)
                for si, st in enumerate(recipe.stages):
                    if st.is_transform or not _claims(st, full, type(mod).__name__):
                        continue  # transforms rescale; only quantizer stages own modules
                    try:
                        scheme = stage_scheme(recipe, si)
                        check_divisible(scheme.weights, mod.in_features, full)
                    except ValueError as exc:  # the recipe asks for what this model's shapes cannot take
                        raise ConvertError(f"recipe {recipe.name!r} stages[{si}]: {exc}") from None
                    if scheme.weights.scale_format != "model" and _ct_actorder(st) == "group":
                        raise ConvertError(f"recipe {recipe.name!r} stages[{si}].actorder: 'group' needs a g_idx "
                                           f"in the checkpoint, which the {scheme.format} format does not carry; "
                                           "use actorder: static (same quality, plain groups)")
                    if si not in ct_schemes:
                        ct_schemes[si] = scheme.to_compressed_tensors(targets=[], actorder=_ct_actorder(st))
                    method = QAT_START if st.method == "qat" else st.method
                    members.append(Target(full, si, method, scheme, ct_schemes[si]))
                    quantized.add(full)
                    break
            if members:
                if plan.moe is not None and group[0].startswith(plan.moe + ".experts."):
                    expert = int(group[0][len(plan.moe + ".experts."):].split(".", 1)[0])
                    plan.experts[len(plan.groups)] = (expert, "down" if len(group) == 1 else "gate_up")
                plan.groups.append(members)
                plan.group_inputs.append(prefix + group[0])
        plan.smoothing = plan_smoothing(arch, recipe, prefix, {t.name: t for t in plan.targets})
        plans.append(plan)
    for si, st in enumerate(recipe.stages):
        for name in sorted(all_linear - quantized) if not st.is_transform else ():
            if name.endswith("lm_head") and _claims(st, name, "Linear"):
                raise ConvertError(f"stages[{si}]: quantizing lm_head is not supported; keep 'lm_head' in "
                                f"stages[{si}].ignore")
    if not quantized:
        raise ConvertError("no module matches any stage's targets (check stages[*].targets and ignore)")
    return Plan(plans, sorted(all_linear - quantized))


def _refuse_router(recipe: Recipe, name: str) -> None:
    """A recipe that names a router (a sparse block's gate) in its targets is refused: routers stay in full
    precision, which is how vLLM builds them (their logits choose the experts; there is no quantized router
    kernel), so a quantized one could not be loaded. `Linear` and regexes never reach it: it is no sequential
    group's member."""
    for si, st in enumerate(recipe.stages):
        if not st.is_transform and name in st.targets:
            raise ConvertError(f"recipe {recipe.name!r} stages[{si}].targets names the router {name}: routers of "
                               "mixture-of-experts layers stay in full precision (vLLM has no quantized router); "
                               "remove it from the targets")


def plan_smoothing(arch: ArchSpec, recipe: Recipe, prefix: str, quantized: dict[str, Target]) -> list[Smoothing]:
    """The mappings of one layer each transform stage applies to (first matching transform wins).

    A mapping applies only when every Linear it feeds is quantized by a later stage and matches the
    transform's targets / ignore.
    """
    out, claimed = [], set()
    for si, st in enumerate(recipe.stages):
        if not st.is_transform:
            continue
        for prev, feeds in arch.smoothing:
            if prev in claimed:
                continue
            names = [prefix + f for f in feeds]
            if not all(n in quantized and _claims(st, n, "Linear") for n in names):
                continue
            claimed.add(prev)
            out.append(Smoothing(si, prev, [quantized[n] for n in names], float(arch.extra.get("norm_offset", 0.0))))
    return out
