"""The conversion's visit of each decoder layer (the walk itself: quantkit/quantize/walk.py).

The whole calibration batch goes through the layer once, with an observer on the first Linear of every
sequential group (q/k/v -> o -> gate/up -> down). When every chunk has reached a group's input, the group
has its real input (already shaped by the quantized groups before it): its weights are quantized on the
spot through the target's quantizer (quantkit/algorithms/registry.py) and the chunks go on with them, so
one forward per layer observes, quantizes (true-sequential) and produces the next layer's input. The
layer's results (typed `ModuleResult`s) and the next layer's input are then saved in the work folder,
which is the resume point.

Without calibration data (round-to-nearest only) no forward runs at all: weights are rounded layer by
layer straight from the checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from quantkit.algorithms.gptq import HessianAccumulator
from quantkit.algorithms.rtn import (activation_pre_hook, energy_ratio_db, hessian_energy, output_sqnr_db,
                                     rows_per_block, sqnr_db)
from quantkit.distributed import SINGLE, ChunkFold, ChunkLayout, Ranks, deal, decode_json, encode_json, share
from quantkit.plan import ConvertError, LayerPlan, Plan, Target
from quantkit.algorithms.contract import ModuleResult, Observations, QuantizedWeight
from quantkit.quantize.kvcache import KVObserver
from quantkit.algorithms.registry import QuantizerMethod
from quantkit.quantize.transforms import apply_transforms
from quantkit.model.checkpoint import to_layer_device
from quantkit.quantize.timing import PhaseTimes
from quantkit.quantize.walk import ChunkScheduler, LayerInput, Walk, observing, pause_chunk
from quantkit.io import giving_back_freed_memory, release_free_memory
from quantkit.quantize.workdir import WorkDir, compact, decode_weight

log = logging.getLogger("quantkit")
# weights (elements) of a sequential group after whose solve the freed heap goes back to the OS: the solve's
# freed blocks are then large, and re-faulting them costs little beside it; after every group of a small model it
# cost 10% of SmolLM2's GPTQ conversion (the next chunks fault again), while on Llama-3.1-8B's shape it keeps the
# down_proj group's peak from carrying the gate/up solve's heap (2 layers: 4.1 GB in 2 runs without, 3.4-3.6 in 4 with)
TRIM_AFTER = 16 << 20
SQNR_TOKENS = 4096  # calibration tokens for the output SQNR of stages without a Hessian (RTN)


@dataclass(frozen=True)
class Job:
    """What every layer of one conversion shares."""

    plan: Plan  # what to do (stages, policies); the pipeline never reads the recipe
    scale_dtype: torch.dtype  # the dtype scales (and rewritten float tensors) are stored in
    # the calibration forward's dtype (quantkit.hardware.compute_dtype): the layer's weights and the
    # activations are held in it; Hessians, GPTQ and AWQ's search convert to fp32 and solve there
    compute: torch.dtype = torch.float32
    # a public hook: called with every quantized module's dequantized weight and every float tensor a
    # transform rewrote, under its parameter name (tools and tests that compare the export with the
    # in-memory quantized model use it; it costs nothing when None)
    on_weight: Callable[[str, torch.Tensor], None] | None = None
    # this process's place when the calibration is split across processes (quantkit/distributed.py)
    ranks: Ranks = SINGLE
    timing: PhaseTimes = field(default_factory=PhaseTimes)  # seconds per phase (quantkit/quantize/timing.py)
    # where a large group's typed results wait on disk for their layer's save (this process's own folder;
    # quantkit/quantize/workdir.py: SpilledTyped); None: they stay in memory
    spill: Path | None = None

    @property
    def diagnostics_dtype(self) -> torch.dtype:
        """The output-SQNR products' dtype: bf16 where the calibration computes in it (it is native there; fp16's
        range is too small for a Hessian), else fp32."""
        return torch.bfloat16 if self.compute == torch.bfloat16 else torch.float32


# ------------------------------------------------------------------------------------------ layer work
class GroupInputs:
    """What a sequential group's quantizers need from its calibration inputs, gathered chunk by chunk and
    folded in global chunk order (the same on every rank): the Hessian when a GPTQ stage owns a member,
    else the first SQNR_TOKENS rows for the diagnostic.

    With a Hessian, the members' output energies |X W^T|^2 too (the output SQNR's signal, for a quantizer that
    reports its noise), where they cost less from the inputs than from H: 2 T in out flops for T calibration
    tokens against 2 out in^2 from H (`hessian_energy`), so where T <= in (Llama-3.1-8B's down_proj on 4,096
    tokens: 3.5x fewer, and one large product per token slab instead of a pass over H per member). `signal_of`
    names the members and their modules; the energies are summed in fp64 in global chunk order like H."""

    def __init__(self, hessian: bool, layout: ChunkLayout, signal_of: list[tuple[str, nn.Module]] | None = None):
        self.hessian, self.layout = hessian, layout
        self.acc: HessianAccumulator | None = None
        self._rows: list[torch.Tensor] = []
        self.signal_of = signal_of if hessian else None
        self._energy: torch.Tensor | None = None  # [members] fp64, |x W^T|^2 summed over the chunks folded so far
        # Hessian partials are [in, in] each: exchanged round by round; the rows are few: exchanged at the end
        self._fold = ChunkFold(layout, self._fold_hessian if hessian else self._fold_rows, eager=hessian)

    @property
    def phase(self) -> str:
        """The timing phase its statistics are charged to: the Hessian's, or (SQNR rows only) the diagnostics'."""
        return "hessian" if self.hessian else "diagnostics"

    def energies(self, x: torch.Tensor) -> torch.Tensor | None:
        """One chunk's output energy per member ([members] fp64), or None where they are not measured here
        (no members named, or T > in: then they come from H)."""
        if not self.signal_of or sum(map(self.layout.tokens, range(self.layout.n))) > x.shape[-1]:
            return None
        x2 = x.reshape(-1, x.shape[-1])
        out = torch.zeros(len(self.signal_of), dtype=torch.float64, device=x2.device)
        for k, (_, module) in enumerate(self.signal_of):
            w = module.weight.detach()
            step = rows_per_block(w.shape[0])  # tokens per product: [step, out] of ~4M elements
            for r in range(0, x2.shape[0], step):
                y = (x2[r:r + step] @ w.t()).float()
                out[k] += torch.linalg.vector_norm(y, dim=1).double().pow(2).sum()
        return out

    def add(self, x: torch.Tensor, energy: torch.Tensor | None = None) -> None:
        """One of this rank's chunks (in order), with its `energies` where measured."""
        x2 = x.reshape(-1, x.shape[-1])  # [tokens, in], in the compute dtype: the Hessian's products use it
        if self.hessian:
            if self.acc is None:
                if x2.shape[-1] ** 2 >= TRIM_AFTER:  # about to hold a large H: first the heap's free pages back
                    release_free_memory()
                self.acc = HessianAccumulator(x2.shape[-1], device=x2.device)
            if self.layout.ranks.world == 1:  # straight into the sum: no [in, in] product of the chunk alone
                self.acc.add(x2)
                self._add_energy(energy)
                return
            part, n = self.acc.partial(x2)
            self._fold.add([part, torch.tensor([n]), energy])
        else:  # the rows of this chunk among the first SQNR_TOKENS of the whole batch
            keep = max(0, min(x2.shape[0], SQNR_TOKENS - self.layout.token_offset(self._fold.index())))
            self._fold.add([x2[:keep].to(torch.float32, copy=True)])

    def _add_energy(self, energy: torch.Tensor | None) -> None:
        if energy is not None:
            self._energy = energy.cpu() if self._energy is None else self._energy + energy.cpu()

    def _fold_hessian(self, payload) -> None:
        if self.acc is None:  # a rank that has not seen a chunk of this group yet
            self.acc = HessianAccumulator(payload[0].shape[-1], device=payload[0].device)
        self.acc.fold(payload[0].to(self.acc._acc.device), int(payload[1].item()))
        self._add_energy(payload[2])  # (None where the owner measured none: `share` keeps None entries)

    def _fold_rows(self, payload) -> None:
        if payload[0].numel():
            self._rows.append(payload[0])

    def observations(self) -> Observations:
        """The group's statistics, once every chunk is in; this object lets go of them (and of its fold, whose
        callback is one of its own methods: a reference cycle that would keep the Hessian's buffer, which GPTQ
        then fills with its factor, until Python's cycle collector happened to run: on the 8B shape ~1 GB of
        earlier groups' Hessians were still held at the next layer's down_proj solve)."""
        self._fold.finish()
        signals = {}
        if self._energy is not None:  # at H's scale: H = 2/n X^T X, so tr(W H W^T) = 2/n |X W^T|^2
            scale = 2.0 / max(self.acc.n, 1)
            signals = {name: float(e) * scale for (name, _), e in zip(self.signal_of, self._energy.tolist())}
        obs = Observations(hessian=self.acc.H if self.acc is not None else None,
                           sample=torch.cat(self._rows) if self._rows else None, signals=signals)
        self._fold, self.acc, self._rows, self.signal_of, self._energy = None, None, [], None, None
        return obs


def weight_stats(stage: int, method: str, scheme: str, w: torch.Tensor, q: QuantizedWeight, seconds: float) -> dict:
    """A quantized module's manifest stats (both conversion paths write these, so their manifests agree)."""
    return {"stage": stage, "method": method, "scheme": scheme, "weight_sqnr_db": round(sqnr_db(w, q.weight), 3),
            "seconds": round(seconds, 4), **q.stats}


def quantize_group(layer_root: nn.Module, prefix: str, members: list[Target], job: Job,
                   obs: Observations | None, fallback: QuantizerMethod | None = None) -> list[ModuleResult]:
    """Quantize one sequential group in place (weights replaced by their dequantized values), each member
    through its target's quantizer (or `fallback`: an expert's). `obs`: what the group's calibration inputs
    taught (None: weights only, no calibration); where it is `consumable` and one quantizer that reports its
    output noise (GPTQ) solves the whole group, that quantizer may overwrite its Hessian, and `obs.hessian` is
    None after."""
    out: list[ModuleResult] = []
    by_stage: dict[int, list[Target]] = {}
    for t in members:
        by_stage.setdefault(t.stage.index, []).append(t)
    obs = obs or Observations()
    for si, targets in by_stage.items():
        method = fallback or targets[0].quantizer
        mods = [layer_root.get_submodule(t.name[len(prefix):]) for t in targets]
        if method.needs_for(targets[0].stage.config) == "hessian" and obs.hessian is None:
            raise ConvertError(f"{targets[0].name}: {method.name} needs calibration inputs, and none reached this module")
        measured = obs.hessian is not None and method.refine_layer is None
        signals = None
        if measured and obs.consumable and method.reports_output_noise and len(by_stage) == 1:
            with job.timing.measure("diagnostics"):  # the output SQNR's signal: from the inputs, or while H is whole
                signals = [obs.signals[t.name] if t.name in obs.signals
                           else hessian_energy(m.weight.detach(), obs.hessian, job.diagnostics_dtype)
                           for t, m in zip(targets, mods)]
        pieces, seconds = _solve(method, mods, obs if signals is not None else dataclasses.replace(obs, consumable=False),
                                 targets[0].scheme.weights, targets[0].stage.config, job)
        if signals is not None:
            obs.hessian = None  # its buffer holds the solver's factor now
        for k, (t, m, q, sec) in enumerate(zip(targets, mods, pieces, seconds)):
            w = m.weight.detach()  # in the compute dtype: the diagnostics read it a block of rows at a time
            with job.timing.measure("diagnostics"):
                stats = weight_stats(si, method.name, t.scheme.name, w, q, sec)
                # a quantizer with a layer-level pass (autoround) measures there the weights it keeps
                out_sqnr = (_sqnr_from(signals[k], q, t.name) if signals is not None
                            else output_sqnr(w, q.weight, obs, job) if measured else None)
                if out_sqnr is not None:
                    stats["output_sqnr_db"] = out_sqnr
            m.weight.data = q.weight.to(m.weight.dtype)
            if job.on_weight is not None:
                job.on_weight(t.name, q.weight.detach().cpu().clone())
            out.append(ModuleResult(t.name, stats, q, t.scheme.weights))
    return out


def _sqnr_from(signal: float, q: QuantizedWeight, name: str) -> float:
    if q.output_noise is None:
        raise ConvertError(f"{name}: the quantizer reported no output noise after overwriting the Hessian "
                           "(internal error)")
    return round(energy_ratio_db(signal, q.output_noise), 3)


def output_sqnr(w: torch.Tensor, deq: torch.Tensor, obs: Observations, job: Job) -> float | None:
    """A quantized Linear's output SQNR (dB, rounded): from the Hessian, exact over every calibration token, or
    from the sample rows (the first SQNR_TOKENS) where there is no Hessian; None with neither."""
    if obs.hessian is not None:
        return round(output_sqnr_db(w, deq, obs.hessian, job.diagnostics_dtype), 3)
    if obs.sample is not None:
        xs = obs.sample
        return round(sqnr_db(xs @ w.float().t(), xs @ deq.t()), 3)
    return None


def _solve(method, mods: list[nn.Module], obs: Observations, spec, stage, job: Job):
    """The quantizer on one stage's members of a group: ([QuantizedWeight], seconds each). Across processes
    the members are dealt to ranks (largest first) and each result is broadcast from the rank that solved
    it; a quantizer's result for one weight never depends on the others in its call (the contract)."""
    weights = [m.weight.detach() for m in mods]  # in the compute dtype: each quantizer makes its own fp32 copy
    r = job.ranks
    owner = deal([w.numel() for w in weights], r.world)
    mine = [k for k in range(len(mods)) if owner[k] == r.rank]
    t0 = time.perf_counter()
    with job.timing.measure("solve"):
        solved = method.quantize([weights[k] for k in mine], obs, spec, stage, job.scale_dtype) if mine else []
    each = (time.perf_counter() - t0) / max(len(mine), 1)
    if r.world == 1:
        return solved, [each] * len(solved)
    got = dict(zip(mine, solved))
    pieces, seconds = [], []
    for k in range(len(mods)):
        q = got.get(k)
        t = share([q.weight, q.scale, q.zero_point, q.g_idx,
                   encode_json({"stats": q.stats, "seconds": each, "output_noise": q.output_noise}),
                   q.global_scale, q.rounded] if q is not None else None, owner[k], r)
        extra = decode_json(t[4])
        pieces.append(q if q is not None else QuantizedWeight(t[0], t[1], t[2], t[3], extra["stats"], global_scale=t[5],
                                                              rounded=t[6], output_noise=extra["output_noise"]))
        seconds.append(extra["seconds"])
    return pieces, seconds


class _ExpertCalibration:
    """The experts of one sparse layer during its calibration forward (quantkit/model/moe.py).

    Each expert's Linears see the tokens routed to them. By the time the first expert group is quantized
    every chunk has passed the router, so each expert's routed token count over the whole batch is known.
    An expert under `calibration.moe.min_tokens` takes the fallback: `all_tokens` quantizes its gate/up with
    the Hessian of every token entering the block and makes the chunks feed its down_proj every token (its
    output still counts only for the routed ones); `rtn` rounds it to nearest. Its stats record the count
    and the calibration it got; the manifest carries them.
    """

    def __init__(self, plan: LayerPlan, job: Job):
        if job.ranks.world > 1:
            raise ConvertError(f"{plan.prefix}{plan.moe}: mixture-of-experts layers are calibrated in one process "
                               "for now; run this conversion without --nproc")
        self.plan, self.job = plan, job
        self.cfg = job.plan.calibration.moe
        self.how: dict[int, str] = {}

    def install(self, layer: nn.Module) -> None:
        from quantkit.model.moe import RoutingObserver

        self.layer, self.block = layer, layer.get_submodule(self.plan.moe)
        self.block.observer = RoutingObserver(self.block.num_experts, self.cfg.fallback == "all_tokens")

    def remove(self) -> None:
        self.block.observer = None

    def quantize(self, g: int, members: list[Target], obs: Observations) -> list[ModuleResult]:
        expert, role = self.plan.experts[g]
        tokens = int(self.block.observer.counts[expert])
        if expert not in self.how:
            self.how[expert] = "routed" if tokens >= self.cfg.min_tokens else self.cfg.fallback
        how, method = self.how[expert], None
        if how == "all_tokens":
            if role == "gate_up":
                obs = Observations(hessian=self.block.observer.all_token_hessian())
                self.block.observer.all_token_experts.add(expert)
            # down: the chunks already fed it every token (all_token_experts was set at gate/up)
        elif how != "routed":  # the fallback quantizer, on the sample rows for the diagnostic
            method, obs = self.cfg.fallback_quantizer, Observations(sample=obs.sample)
        results = quantize_group(self.layer, self.plan.prefix, members, self.job, obs, method)
        for r in results:
            r.stats.update({"expert": expert, "expert_tokens": tokens, "expert_calibration": how})
        if how != "routed" and role == "gate_up":
            log.info("%s%s.experts.%d: %d routed calibration tokens (< %d): %s", self.plan.prefix, self.plan.moe,
                     expert, tokens, self.cfg.min_tokens, how)
        return results


class GroupInputHooks:
    """The observer of every sequential group's input: a pre-hook on the group's input module adds each
    chunk's input to the group's statistics, then pauses the chunk (the scheduler's turn)."""

    def __init__(self, plan: LayerPlan, layout: ChunkLayout, timing: PhaseTimes | None = None,
                 signals: bool = False):
        self.plan, self.timing, self.signals = plan, timing or PhaseTimes(), signals
        self.inputs = [GroupInputs(any(t.quantizer.needs_for(t.stage.config) == "hessian" for t in members), layout)
                       for members in plan.groups]
        self.handles: list = []

    def _signal_members(self, layer: nn.Module, g: int) -> list[tuple[str, nn.Module]] | None:
        """Group g's members whose output SQNR takes its signal before the solve (`quantize_group`: one stage,
        a quantizer that reports its output noise from a Hessian it may overwrite), with their modules."""
        members = self.plan.groups[g]
        q = members[0].quantizer
        if (not self.signals or g in (self.plan.experts or {}) or len({t.stage.index for t in members}) > 1
                or not q.reports_output_noise or q.refine_layer is not None):
            return None
        return [(t.name, layer.get_submodule(t.name[len(self.plan.prefix):])) for t in members]

    def install(self, layer: nn.Module) -> None:
        for g, hooked in enumerate(self.plan.group_inputs):
            self.inputs[g].signal_of = self._signal_members(layer, g) if self.inputs[g].hessian else None

            def pre_hook(_m, args, g=g):
                with self.timing.measure("diagnostics"):
                    energy = self.inputs[g].energies(args[0])
                with self.timing.measure(self.inputs[g].phase):
                    self.inputs[g].add(args[0], energy)
                pause_chunk()

            self.handles.append(layer.get_submodule(hooked[len(self.plan.prefix):]).register_forward_pre_hook(pre_hook))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    def observations(self, g: int) -> Observations:
        """Group g's statistics once every chunk has added its input (then dropped: they can be large). Their
        making (across processes, the last partials; H made whole and scaled) is the Hessian's time."""
        with self.timing.measure(self.inputs[g].phase):
            obs = self.inputs[g].observations()
        self.inputs[g] = None
        return obs


class _ActivationQuant:
    """What the engine does at run time: dynamic per-token activation quantization (W8A8, FP8) of the
    targets whose scheme has it, as a pre-hook (after the group-input hook on the same module)."""

    def __init__(self, plan: LayerPlan):
        self.plan, self.handles = plan, []

    def install(self, layer: nn.Module) -> None:
        for t in self.plan.targets:
            if t.scheme.activations is not None:
                self.handles.append(layer.get_submodule(t.name[len(self.plan.prefix):]).register_forward_pre_hook(
                    activation_pre_hook(t.scheme.activations)))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


class _PassedWeights:
    """The weights every chunk has gone past, dropped while the later groups are solved.

    Once every chunk waits at group g's input, the groups before it are behind them all (the plan's groups
    follow the layer's forward order), and what a later step reads of theirs is the typed result the layer
    keeps, not the dequantized weight in the module: for a Llama-3.1-8B-shape layer that is q/k/v/o and
    gate/up, 304 MB of bf16 at down_proj's solve, where the conversion's peak sits (its 822 MB Hessian).
    Not used where a layer-level pass re-runs the whole layer afterwards (autoround). Should a forward still
    reach a dropped module (a plan whose group order differed from the forward's), a guard puts the weight
    back from the typed result first, bit for bit the value it had (its codes dequantize exactly to it), and
    says so in the log."""

    def __init__(self):
        self.layer: nn.Module | None = None
        self.dropped: dict[str, tuple[nn.Module, ModuleResult, torch.dtype, torch.device]] = {}
        self.handles: dict[str, object] = {}

    def install(self, layer: nn.Module) -> None:
        self.layer = layer

    def remove(self) -> None:
        for h in self.handles.values():
            h.remove()
        self.handles.clear()

    def drop(self, plan: LayerPlan, results: list[ModuleResult]) -> None:
        """Every finished result's module weight (the chunks are past them all), replaced by a meta stand-in."""
        for r in results:
            if r.name in self.dropped:
                continue
            m = self.layer.get_submodule(r.name[len(plan.prefix):])
            w = m.weight
            self.dropped[r.name] = (m, r, w.dtype, w.device)
            m.weight = nn.Parameter(torch.empty(w.shape, dtype=w.dtype, device="meta"), requires_grad=False)
            self.handles[r.name] = m.register_forward_pre_hook(lambda _m, _a, name=r.name: self._restore(name))

    def _restore(self, name: str) -> None:
        m, r, dtype, device = self.dropped[name]
        log.warning("%s: read by the layer's forward after its group was passed; its weight is put back from the "
                    "result (the plan's group order differs from the forward's)", name)
        q = r.weight if r.typed is None else decode_weight(r.typed, r.name, r.spec)
        m.weight = nn.Parameter(q.weight.to(device=device, dtype=dtype), requires_grad=False)
        self.handles.pop(name).remove()


def run_layer(layer: nn.Module, plan: LayerPlan, job: Job,
              inp: LayerInput) -> tuple[list[ModuleResult], torch.Tensor | None, torch.Tensor | None]:
    """Quantize one layer; return its results, the next layer's input (this rank's chunks) and, where `inp`
    carries the float model's activations, the float model's next ones (the float layer's output on them).

    With calibration data, the batch goes through the layer in chunks of `calibration.batch_size` samples,
    stepped by a ChunkScheduler: every chunk stops at the input of each sequential group in turn; once all
    have added their inputs to the group's statistics, the group is quantized and the chunks go on with the
    quantized weights. Across processes what the chunks teach is folded in global chunk order on every rank
    (quantkit/distributed.py).
    """
    if inp.hidden is None:  # weights only: no calibration forward
        return [r for members in plan.groups for r in quantize_group(layer, plan.prefix, members, job, None)], None, None
    bs = job.plan.calibration.batch_size
    layout = inp.layout or ChunkLayout.of(inp.hidden.shape[0], bs, inp.hidden.shape[1])
    pieces = inp.pieces(bs)
    float_next = None
    if inp.float_hidden is not None:  # the float model's next activations, from the layer before any change
        with job.timing.measure("refine"):
            float_next = torch.cat(layer_outputs(layer, inp.pieces(bs, inp.float_hidden), [])).to(inp.float_hidden.device)
    # transform stages (AWQ, SmoothQuant): one float forward to capture inputs, then fold the scales
    quantized = {t.name for t in plan.targets}
    with job.timing.measure("transforms"):
        smoothed = (apply_transforms(layer, plan.prefix, plan.smoothing, job, pieces, quantized, layout)
                    if plan.smoothing else {})
    model_reference = list(float_next.split(bs)) if float_next is not None else None
    refining = _Refinement.of(layer, plan, job, pieces, model_reference)  # autoround's targets, before any change
    groups = GroupInputHooks(plan, layout, job.timing, signals=refining is None)
    experts = _ExpertCalibration(plan, job) if plan.moe is not None else None
    kv_policy = job.plan.kv_cache  # k/v scales from the keys and values these (quantized-model) chunks feed attention
    kv = KVObserver(plan.prefix, kv_policy.attention, kv_policy.strategy, layout) if kv_policy is not None else None
    passed = _PassedWeights() if refining is None else None  # a layer pass re-runs every weight
    observers = [groups, _ActivationQuant(plan), *(o for o in (experts, kv, passed) if o is not None)]
    scheduler = ChunkScheduler(layer, pieces)
    out = torch.empty_like(inp.hidden)
    results: list[ModuleResult] = []
    with observing(layer, observers):
        try:
            for g, members in enumerate(plan.groups):
                scheduler.advance()  # every chunk to group g's input
                if passed is not None:
                    passed.drop(plan, results)
                results += _quantize_observed_group(layer, plan, g, members, job, groups.observations(g), experts,
                                                    refining)
            scheduler.finish(out)
        finally:
            scheduler.close()
    if refining is not None:
        with job.timing.measure("refine"):
            refining.run(results, out)
    _attach(plan, results, kv, smoothed)
    return results, out, float_next


def _quantize_observed_group(layer: nn.Module, plan: LayerPlan, g: int, members: list[Target], job: Job,
                             obs: Observations, experts, refining) -> list[ModuleResult]:
    """Group g, once every chunk has shown it its inputs: quantized (by its experts' rules in a sparse block),
    its observations kept for a layer pass that refines a member, and its results held in their typed form."""
    large = sum(layer.get_submodule(t.name[len(plan.prefix):]).weight.numel() for t in members) >= TRIM_AFTER
    # a large group: the heap's free pages back before its solve's fp32 copies, between the solve's blocks, and
    # once its results are compacted (on leaving the block), wherever in the heap its freed blocks sit
    with giving_back_freed_memory() if large else contextlib.nullcontext():
        if experts is not None and g in plan.experts:
            got = experts.quantize(g, members, obs)
        else:  # nothing reads the group's Hessian after its solve, but a layer pass over a member
            obs.consumable = refining is None or not any(t.name in refining.floats for t in members)
            got = quantize_group(layer, plan.prefix, members, job, obs)
        if refining is not None:
            refining.keep(members, obs)
        del obs
        with job.timing.measure("save"):  # what the layer pass reads no more: its typed form (a large group's on disk)
            for r in got:
                if refining is None or r.name not in refining.floats:
                    compact(r, job.spill if large else None)
    return got


def carries_float_stream(plan: Plan) -> bool:
    """Whether the walk must carry the float model's activations beside the quantized model's: a layer-level
    refinement (autoround) trains towards the float model's output."""
    return any(t.quantizer.refine_layer is not None and getattr(t.stage.config, "reference", None) == "float_model"
               for lp in plan.layers for t in lp.targets)


def layer_outputs(layer: nn.Module, pieces: list[tuple[torch.Tensor, dict]], observers: list) -> list[torch.Tensor]:
    """The layer's output per chunk (grad off), with `observers` installed for the pass."""
    def call(h, kw):
        y = layer(to_layer_device(h, layer), **kw)
        return y[0] if isinstance(y, tuple) else y

    with observing(layer, observers):
        return [call(h, kw) for h, kw in pieces]


class _Refinement:
    """The layer-level pass of quantizers that have one (autoround): after the group pass, each such stage's
    Linears in this layer are refined together, on the quantized model's chunks with the engine's activation
    quantization in the forward, towards the stage's reference: the float model's output at this layer
    (`float_model`: the float layer on the float model's activations, which the walk carries) or the float
    layer's output on the same chunks (`float_layer`). The next layer's input is then recomputed through the
    refined layer. (The layer's k/v-cache scales stay those of the group pass, from the start's weights.)"""

    def __init__(self, layer: nn.Module, plan: LayerPlan, job: Job, pieces: list[tuple[torch.Tensor, dict]],
                 stages: dict[int, list[Target]], model_reference: list[torch.Tensor] | None):
        self.layer, self.plan, self.job, self.pieces, self.stages = layer, plan, job, pieces, stages
        self.floats = {t.name: self._module(t).weight.detach().float().clone() for ts in stages.values() for t in ts}
        self.inputs: dict[str, Observations] = {}  # each refined module's Hessian or sample rows, for its output SQNR
        wanted = {getattr(ts[0].stage.config, "reference", "float_layer") for ts in stages.values()}
        if "float_model" in wanted and model_reference is None:
            raise ConvertError(f"{plan.prefix}: the float model's activations were not carried to this layer")
        self.references = {"float_model": model_reference,
                           "float_layer": layer_outputs(layer, pieces, []) if "float_layer" in wanted else None}

    @classmethod
    def of(cls, layer, plan: LayerPlan, job: Job, pieces, model_reference) -> "_Refinement | None":
        stages: dict[int, list[Target]] = {}
        for t in plan.targets:
            if t.quantizer.refine_layer is not None:
                stages.setdefault(t.stage.index, []).append(t)
        return cls(layer, plan, job, pieces, stages, model_reference) if stages else None

    def _module(self, t: Target) -> nn.Module:
        return self.layer.get_submodule(t.name[len(self.plan.prefix):])

    def _forward(self, i: int) -> torch.Tensor:
        h, kw = self.pieces[i]
        y = self.layer(to_layer_device(h, self.layer), **kw)
        return y[0] if isinstance(y, tuple) else y

    def keep(self, members: list[Target], obs: Observations) -> None:
        """A group's observations, for the output SQNR of the members that will be refined."""
        for t in members:
            if t.name in self.floats:
                self.inputs[t.name] = Observations(hessian=obs.hessian, sample=obs.sample)

    def run(self, results: list[ModuleResult], out: torch.Tensor) -> None:
        from quantkit.algorithms.autoround import LayerProblem
        from quantkit.distributed import sum_across

        by_name = {r.name: r for r in results}
        bs = self.pieces[0][0].shape[0]
        for targets in self.stages.values():
            mods = [self._module(t) for t in targets]
            reference = self.references[getattr(targets[0].stage.config, "reference", "float_layer")]
            problem = LayerProblem(mods, [self.floats[t.name] for t in targets], [by_name[t.name].weight for t in targets],
                                   targets[0].scheme.weights, self._forward, reference, list(range(len(self.pieces))),
                                   None if self.job.ranks.world == 1 else (lambda ts: sum_across(ts, self.job.ranks)),
                                   start_outputs=list(out.split(bs)))  # the group pass's (or the stage before's)
            # (the walk runs the layer inside reusing_freed_memory: the descent's steps reuse freed blocks)
            with _trainable(self.layer), observing(self.layer, [_ActivationQuant(self.plan)]), torch.enable_grad():
                refined = targets[0].quantizer.refine_layer(problem, targets[0].stage.config, self.job.scale_dtype)
            for t, m, q in zip(targets, mods, refined):
                r = by_name[t.name]
                r.weight = q
                r.stats.update({k: v for k, v in q.stats.items() if k.startswith("autoround_")})
                r.stats["weight_sqnr_db"] = round(sqnr_db(self.floats[t.name], q.weight), 3)
                out_sqnr = output_sqnr(self.floats[t.name], q.weight, self.inputs[t.name], self.job)
                if out_sqnr is not None:
                    r.stats["output_sqnr_db"] = out_sqnr
                m.weight.data = q.weight.to(m.weight.dtype)
                if self.job.on_weight is not None:
                    self.job.on_weight(t.name, q.weight.detach().cpu().clone())
            if problem.outputs is not problem.start_outputs:  # the next input: through the refined layer
                torch.cat(problem.outputs, out=out)


@contextlib.contextmanager
def _trainable(layer: nn.Module):
    """The layer's own parameters frozen (only the learned grids take gradients), restored after."""
    saved = [(p, p.requires_grad) for p in layer.parameters()]
    for p, _ in saved:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, rg in saved:
            p.requires_grad_(rg)


def _attach(plan: LayerPlan, results: list[ModuleResult], kv: KVObserver | None, smoothed: dict) -> None:
    """The layer's k/v scales travel with its first result, a mapping's diagnostics and folded float tensors
    with its targets, into the work folder and the export."""
    if kv is not None:
        if not results:
            raise ConvertError(f"layer {plan.index}: kv_cache needs at least one quantized module in every layer "
                               "to carry the layer's k/v scales; this layer has none (check stages' targets/ignore)")
        scales, kv_stats = kv.finish()
        results[0].rewritten.update(scales)
        results[0].stats["kv_cache"] = kv_stats
    for r in results:
        if r.name in smoothed:
            r.stats["smoothing"] = smoothed[r.name].smoothing
            r.rewritten.update(smoothed[r.name].tensors)


class _Converting:
    """The conversion's visitor of the walk: quantize each layer, save its results and (rank 0) the whole
    batch's next input in the work folder, the resume point."""

    def __init__(self, job: Job, work: WorkDir):
        self.job, self.work = job, work
        self.carry = carries_float_stream(job.plan)
        self.float_hidden: torch.Tensor | None = None  # the float model's activations, where carried

    def _float_input(self, index: int, inp: LayerInput) -> torch.Tensor:
        if self.float_hidden is not None:
            return self.float_hidden
        if index == 0:  # the float and quantized models' first inputs are the same
            return inp.hidden
        return inp.layout.local(self.work.float_hidden(index)).to(inp.hidden.device)  # resumed

    def visit(self, index: int, layer: nn.Module, lp: LayerPlan, inp: LayerInput) -> tuple[torch.Tensor | None, str]:
        t0 = time.perf_counter()
        if self.carry and inp.hidden is not None:
            inp = dataclasses.replace(inp, float_hidden=self._float_input(index, inp))
        with self.job.timing.measure("layer"):
            results, hidden, self.float_hidden = run_layer(layer, lp, self.job, inp)
            gather = (lambda t: inp.layout.gather(t) if inp.layout is not None and t is not None else None)
            whole, float_whole = gather(hidden), gather(self.float_hidden)  # rank 0: the whole batch
            if self.job.ranks.root:
                with self.job.timing.measure("save"):
                    self.work.save_layer(index, results, whole.cpu() if whole is not None else None,
                                         float_whole.cpu() if float_whole is not None else None)
            del whole, float_whole
        worst = min((r.stats.get("output_sqnr_db", r.stats["weight_sqnr_db"]) for r in results), default=float("nan"))
        loss = sum(r.stats.get("gptq_loss", 0.0) for r in results)
        log.info("layer %d done in %.2fs: min SQNR %.2f dB%s", index, time.perf_counter() - t0, worst,
                 f", GPTQ loss {loss:.4g}" if loss else "")
        return hidden, f"min SQNR {worst:.1f} dB" + (f", GPTQ loss {loss:.3g}" if loss else "")


def process_layers(walk: Walk, job: Job, work: WorkDir, start: int, input_ids: torch.Tensor | None,
                   quiet: bool = False) -> None:
    """Every layer from `start` on, each saved in `work` as it finishes (the resume point)."""
    walk.run(_Converting(job, work), input_ids, start, work.hidden, quiet)
