"""The plan: recipe + architecture -> the work of every decoder layer, decided before any weight loads.

This is the one place that matches module names against a recipe's `targets` / `ignore` patterns, and the
last place that reads the recipe's stages: the plan is what the pipeline executes. It says
- per stage (`PlanStage`): its config, its registry entry (role, what it needs) and its scheme;
- per layer: which Linear each stage owns (`Target`), in true-sequential groups (q/k/v -> o -> gate/up ->
  down), each with the module whose input the group shares, and which smoothing mappings (norm or Linear
  -> the Linears it feeds) a transform stage rescales;
- for the whole model: the calibration, mixture-of-experts and KV-cache policy, the compressed-tensors
  config groups the export declares and the Linears that stay in float.

A stage claims a module when its targets match and its ignore does not; the first quantizer or fine-tune
stage that claims a module owns it (transforms and rotations rewrite float weights and own none). A
fine-tune stage trains what the stages before it produced; a module only it claims starts from its registry
entry's `starts_from` quantizer, which the plan records as the target's `quantizer`, so nothing downstream
guesses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from torch import nn

from quantkit.algorithms.registry import METHODS, QUANTIZERS, Method, QuantizerMethod, method_of
from quantkit.model.arch import ArchSpec
from quantkit.model.moe import is_moe_layer
from quantkit.targets import exact_targets, matches_pattern
from quantkit.recipe import CalibrationSpec, KVCacheSpec, Recipe
from quantkit.schemes import Scheme, get_scheme


class ConvertError(RuntimeError):
    """A conversion problem, phrased for the user (the stage or module, and the fix)."""


def _claims(stage, name: str, cls_name: str) -> bool:
    return matches_pattern(stage.targets, name, cls_name) and not matches_pattern(stage.ignore, name, cls_name)


@dataclass(frozen=True, eq=False)
class PlanStage:
    """One recipe stage as the pipeline runs it: its config, its registry entry and (unless it is a
    transform) the scheme its modules follow."""

    index: int  # stages[index] in the recipe: error messages, stats and config group names
    config: object  # the recipe's stage config (quantkit/algorithms/<method>.py)
    method: Method  # its registry entry: role, needs, must come last, runs on MoE, keeps kv scales
    scheme: Scheme | None = None  # None for a transform (it produces no scheme of its own)

    @property
    def role(self) -> str:
        return self.method.role

    @property
    def owns_modules(self) -> bool:
        """A quantizer or fine-tune stage: it claims modules through targets / ignore (a transform or rotation
        rewrites float weights and owns none)."""
        return self.role in ("quantizer", "finetune")

    @cached_property
    def ct_scheme(self):
        """The compressed-tensors QuantizationScheme of its config group (built when a module needs it)."""
        return self.scheme.to_compressed_tensors(targets=[], actorder=_ct_actorder(self.config))


@dataclass
class Target:
    name: str  # full module name, e.g. model.layers.3.mlp.down_proj
    stage: PlanStage  # the stage that owns it
    quantizer: QuantizerMethod  # what produces its PTQ result (a fine-tune stage's own modules: its starts_from)

    @property
    def scheme(self) -> Scheme:
        return self.stage.scheme

    @property
    def ct_scheme(self):
        return self.stage.ct_scheme


@dataclass
class Smoothing:
    """One smoothing mapping of one layer, claimed by one transform stage."""

    stage: PlanStage
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


@dataclass(frozen=True)
class MoEPolicy:
    """How experts the router sends few calibration tokens are calibrated (recipe calibration.moe)."""

    min_tokens: int
    fallback: str  # "all_tokens", or the name of the quantizer that rounds such an expert
    fallback_quantizer: QuantizerMethod | None  # None: all_tokens


@dataclass(frozen=True)
class CalibrationPolicy:
    spec: CalibrationSpec  # the data (sources, samples, sequence length); also a fine-tune stage's text
    batch_size: int  # samples per forward chunk in the layer pipeline
    moe: MoEPolicy


@dataclass(frozen=True)
class KVCachePolicy:
    spec: KVCacheSpec  # what config.json declares (quantkit/quantize/kvcache.py kv_cache_args)
    strategy: str  # "tensor" | "head"
    attention: str  # the decoder layer's attention module (local name) whose k/v are observed


@dataclass
class Plan:
    layers: list[LayerPlan]
    unquantized: list[str]  # Linears that stay in float (lm_head, ignored ones)
    stages: list[PlanStage] = field(default_factory=list)
    calibration: CalibrationPolicy | None = None  # None: weights only, no calibration forward
    kv_cache: KVCachePolicy | None = None

    @property
    def targets(self) -> dict[str, Target]:
        return {t.name: t for layer in self.layers for t in layer.targets}

    @property
    def rotation(self) -> PlanStage | None:
        """The stage that rotates the whole model before the others (the recipe keeps it first)."""
        return next((s for s in self.stages if s.role == "rotation"), None)

    @property
    def finetune(self) -> PlanStage | None:
        """The stage that trains the PTQ result after the layer pipeline (the recipe keeps it last)."""
        return next((s for s in self.stages if s.role == "finetune"), None)

    def config_groups(self) -> dict[str, object]:
        """One compressed-tensors config group per stage that owns modules.

        A single stage that quantizes every decoder Linear targets `Linear` (lm_head and any other kept
        Linear are listed in `ignore`), the form every reader knows. With several stages each group lists
        its modules as anchored regexes with explicit layer indices, so no group over-matches.
        """
        schemes: dict[int, object] = {}
        names: dict[int, list[str]] = {}
        for t in self.targets.values():
            schemes.setdefault(t.stage.index, t.ct_scheme)
            names.setdefault(t.stage.index, []).append(t.name)
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


def plan_stages(recipe: Recipe) -> list[PlanStage]:
    out = []
    for si, st in enumerate(recipe.stages):
        try:
            scheme = None if st.is_transform else stage_scheme(recipe, si)  # transforms and rotations: none
        except ValueError as exc:  # the recipe asks for what this scheme's fixed format cannot take
            raise ConvertError(f"recipe {recipe.name!r} stages[{si}]: {exc}") from None
        out.append(PlanStage(si, st, method_of(st), scheme))
    return out


def make_plan(model: nn.Module, arch: ArchSpec, recipe: Recipe) -> Plan:
    """Every layer's work; fails early on group sizes that do not divide, lm_head, or a recipe that
    quantizes nothing."""
    stages = plan_stages(recipe)
    layers = model.get_submodule(arch.layers)
    plans = [_plan_layer(model, arch, recipe.name, stages, li, layers[li]) for li in range(len(layers))]
    all_linear = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    quantized = {t.name for lp in plans for t in lp.targets}
    kept = sorted(all_linear - quantized)
    for ps in stages:
        for name in kept if ps.owns_modules else ():
            if name.endswith("lm_head") and _claims(ps.config, name, "Linear"):
                raise ConvertError(f"stages[{ps.index}]: quantizing lm_head is not supported; keep 'lm_head' in "
                                   f"stages[{ps.index}].ignore")
    if not quantized:
        raise ConvertError("no module matches any stage's targets (check stages[*].targets and ignore)")
    return Plan(plans, kept, stages, calibration_policy(recipe), kv_cache_policy(recipe, arch))


def calibration_policy(recipe: Recipe) -> CalibrationPolicy | None:
    c = recipe.calibration
    if c is None:
        return None
    moe = MoEPolicy(c.moe.min_tokens, c.moe.fallback, QUANTIZERS.get(c.moe.fallback))
    return CalibrationPolicy(c, c.batch_size, moe)


def kv_cache_policy(recipe: Recipe, arch: ArchSpec) -> KVCachePolicy | None:
    kv = recipe.kv_cache
    return None if kv is None else KVCachePolicy(kv, kv.strategy, arch.attention_module())


def _plan_layer(model: nn.Module, arch: ArchSpec, recipe_name: str, stages: list[PlanStage], li: int,
                layer: nn.Module) -> LayerPlan:
    plan = LayerPlan(li, f"{arch.layers}.{li}.")
    groups = arch.layer_groups(layer)
    block = is_moe_layer(layer, arch)
    if block is not None:
        plan.moe = next(n for n, m in layer.named_children() if m is block)
        _refuse_on_moe(recipe_name, stages, plan.prefix + plan.moe + "." + block.router_name)
        expert_groups = [g for g in groups if g[0].startswith(plan.moe + ".experts.")]
        plan.fused = [g for g in groups if len(g) > 1 and g not in expert_groups]
        plan.fused.append(tuple(n for g in expert_groups for n in g))
    else:
        plan.fused = [g for g in groups if len(g) > 1]
    for group in groups:
        members = [t for t in (_owner(model, recipe_name, stages, plan.prefix + local) for local in group) if t]
        if members:
            if plan.moe is not None and group[0].startswith(plan.moe + ".experts."):
                expert = int(group[0][len(plan.moe + ".experts."):].split(".", 1)[0])
                plan.experts[len(plan.groups)] = (expert, "down" if len(group) == 1 else "gate_up")
            plan.groups.append(members)
            plan.group_inputs.append(plan.prefix + group[0])
    plan.smoothing = plan_smoothing(arch, stages, plan.prefix, {t.name: t for t in plan.targets})
    return plan


def _owner(model: nn.Module, recipe_name: str, stages: list[PlanStage], full: str) -> Target | None:
    """The target of the first stage that owns module `full` (transforms rescale; they own nothing)."""
    from quantkit.algorithms.rtn import check_divisible

    mod = model.get_submodule(full)
    for ps in stages:
        if not ps.owns_modules or not _claims(ps.config, full, type(mod).__name__):
            continue
        try:
            check_divisible(ps.scheme.weights, mod.in_features, full)
        except ValueError as exc:  # the recipe asks for what this model's shapes cannot take
            raise ConvertError(f"recipe {recipe_name!r} stages[{ps.index}]: {exc}") from None
        if ps.scheme.weights.scale_format != "model" and _ct_actorder(ps.config) == "group":
            raise ConvertError(f"recipe {recipe_name!r} stages[{ps.index}].actorder: 'group' needs a g_idx "
                               f"in the checkpoint, which the {ps.scheme.format} format does not carry; "
                               "use actorder: static (same quality, plain groups)")
        quantizer = ps.method if ps.role == "quantizer" else QUANTIZERS[ps.method.starts_from]
        return Target(full, ps, quantizer)
    return None


def _refuse_on_moe(recipe_name: str, stages: list[PlanStage], router: str) -> None:
    """A recipe that names a router (a sparse block's gate) in its targets is refused: routers stay in full
    precision, which is how vLLM builds them (their logits choose the experts; there is no quantized router
    kernel), so a quantized one could not be loaded. `Linear` and regexes never reach it: it is no sequential
    group's member. So is a stage whose method cannot run on mixture-of-experts models."""
    for ps in stages:
        if ps.owns_modules and router in ps.config.targets:
            raise ConvertError(f"recipe {recipe_name!r} stages[{ps.index}].targets names the router {router}: "
                               "routers of mixture-of-experts layers stay in full precision (vLLM has no quantized "
                               "router); remove it from the targets")
    for ps in stages:
        if ps.method.moe_refusal:
            usable = ", ".join(n for n, m in METHODS.items() if m.role != "finetune" and not m.moe_refusal)
            raise ConvertError(f"recipe {recipe_name!r} stages[{ps.index}]: {ps.method.moe_refusal}; use "
                               f"post-training stages ({usable}) for this model")


def plan_smoothing(arch: ArchSpec, stages: list[PlanStage], prefix: str,
                   quantized: dict[str, Target]) -> list[Smoothing]:
    """The mappings of one layer each transform stage applies to (first matching transform wins).

    A mapping applies only when every Linear it feeds is quantized by a later stage and matches the
    transform's targets / ignore.
    """
    out, claimed = [], set()
    for ps in stages:
        if ps.role != "transform":
            continue
        for prev, feeds in arch.smoothing:
            if prev in claimed:
                continue
            names = [prefix + f for f in feeds]
            if not all(n in quantized and _claims(ps.config, n, "Linear") for n in names):
                continue
            claimed.add(prev)
            out.append(Smoothing(ps, prev, [quantized[n] for n in names], float(arch.extra.get("norm_offset", 0.0))))
    return out
