"""The layer-sequential, memory-bounded, resumable conversion pipeline.

For each decoder layer: load only that layer from the safetensors files, run the whole calibration
batch through it once with a pre-hook on the first Linear of every sequential group (q/k/v -> o ->
gate/up -> down). When the hook fires it has the group's real input (already shaped by the quantized
groups before it), quantizes the group's weights on the spot through the registered method
(quantkit/algorithms/registry.py) and lets the forward go on with them, so one forward per layer
observes, quantizes (true-sequential) and produces the next layer's input. The layer's results
(typed `ModuleResult`s) and the next layer's input are then saved in the work folder, which is the
resume point; the layer goes back to the meta device.

Without calibration data (round-to-nearest only) no forward runs at all: weights are rounded layer by
layer straight from the checkpoint.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import greenlet
import torch
from torch import nn
from tqdm.auto import tqdm

from quantkit.algorithms.gptq import HessianAccumulator
from quantkit.algorithms.rtn import activation_pre_hook, output_sqnr_db, sqnr_db
from quantkit.distributed import SINGLE, ChunkFold, ChunkLayout, Ranks, deal, decode_json, encode_json, share
from quantkit.errors import human_bytes
from quantkit.io import keep_large_allocations_off_the_heap, release_free_memory
from quantkit.model.arch import ArchSpec
from quantkit.model.checkpoint import LazyCheckpoint, materialize, release, to_layer_device
from quantkit.plan import ConvertError, LayerPlan, Plan, Target
from quantkit.algorithms.contract import ModuleResult, Observations, QuantizedWeight
from quantkit.quantize.kvcache import KVObserver
from quantkit.algorithms.registry import QuantizerMethod
from quantkit.quantize.transforms import apply_transforms
from quantkit.quantize.workdir import WorkDir

log = logging.getLogger("quantkit")
SQNR_TOKENS = 4096  # calibration tokens for the output SQNR of stages without a Hessian (RTN)


class _StopForward(Exception):
    pass


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


# ------------------------------------------------------------------------------------------ layer work
class GroupInputs:
    """What a sequential group's quantizers need from its calibration inputs, gathered chunk by chunk and
    folded in global chunk order (the same on every rank): the Hessian when a GPTQ stage owns a member,
    else the first SQNR_TOKENS rows for the diagnostic."""

    def __init__(self, hessian: bool, layout: ChunkLayout):
        self.hessian, self.layout = hessian, layout
        self.acc: HessianAccumulator | None = None
        self._rows: list[torch.Tensor] = []
        # Hessian partials are [in, in] each: exchanged round by round; the rows are few: exchanged at the end
        self._fold = ChunkFold(layout, self._fold_hessian if hessian else self._fold_rows, eager=hessian)

    def add(self, x: torch.Tensor) -> None:
        """One of this rank's chunks (in order)."""
        x2 = x.reshape(-1, x.shape[-1]).float()  # [tokens, in]
        if self.hessian:
            if self.acc is None:
                self.acc = HessianAccumulator(x2.shape[-1], device=x2.device)
            part, n = self.acc.partial(x2)
            self._fold.add([part, torch.tensor([n])])
        else:  # the rows of this chunk among the first SQNR_TOKENS of the whole batch
            keep = max(0, min(x2.shape[0], SQNR_TOKENS - self.layout.token_offset(self._fold.index())))
            self._fold.add([x2[:keep].clone()])

    def _fold_hessian(self, payload) -> None:
        if self.acc is None:  # a rank that has not seen a chunk of this group yet
            self.acc = HessianAccumulator(payload[0].shape[-1], device=payload[0].device)
        self.acc.fold(payload[0].to(self.acc._acc.device), int(payload[1].item()))

    def _fold_rows(self, payload) -> None:
        if payload[0].numel():
            self._rows.append(payload[0])

    def observations(self) -> Observations:
        self._fold.finish()
        return Observations(hessian=self.acc.H if self.acc is not None else None,
                            sample=torch.cat(self._rows) if self._rows else None)


def quantize_group(layer_root: nn.Module, prefix: str, members: list[Target], job: Job,
                   obs: Observations | None, fallback: QuantizerMethod | None = None) -> list[ModuleResult]:
    """Quantize one sequential group in place (weights replaced by their dequantized values), each member
    through its target's quantizer (or `fallback`: an expert's). `obs`: what the group's calibration inputs
    taught (None: weights only, no calibration)."""
    out: list[ModuleResult] = []
    by_stage: dict[int, list[Target]] = {}
    for t in members:
        by_stage.setdefault(t.stage.index, []).append(t)
    obs = obs or Observations()
    for si, targets in by_stage.items():
        method = fallback or targets[0].quantizer
        mods = [layer_root.get_submodule(t.name[len(prefix):]) for t in targets]
        if method.needs == "hessian" and obs.hessian is None:
            raise ConvertError(f"{targets[0].name}: {method.name} needs calibration inputs, and none reached this module")
        pieces, seconds = _solve(method, mods, obs, targets[0].scheme.weights, targets[0].stage.config, job)
        for t, m, q, sec in zip(targets, mods, pieces, seconds):
            w = m.weight.detach().float()
            stats = {"stage": si, "method": method.name, "scheme": t.scheme.name,
                     "weight_sqnr_db": round(sqnr_db(w, q.weight), 3), "seconds": round(sec, 4),
                     **q.stats}
            if obs.hessian is not None:  # exact over every calibration token
                stats["output_sqnr_db"] = round(output_sqnr_db(w, q.weight, obs.hessian), 3)
            elif obs.sample is not None:
                xs = obs.sample
                stats["output_sqnr_db"] = round(sqnr_db(xs @ w.t(), xs @ q.weight.t()), 3)
            m.weight.data = q.weight.to(m.weight.dtype)
            if job.on_weight is not None:
                job.on_weight(t.name, q.weight.detach().cpu().clone())
            out.append(ModuleResult(t.name, stats, q, t.scheme.weights))
    return out


def _solve(method, mods: list[nn.Module], obs: Observations, spec, stage, job: Job):
    """The quantizer on one stage's members of a group: ([QuantizedWeight], seconds each). Across processes
    the members are dealt to ranks (largest first) and each result is broadcast from the rank that solved
    it; a quantizer's result for one weight never depends on the others in its call (the contract)."""
    weights = [m.weight.detach().float() for m in mods]
    r = job.ranks
    owner = deal([w.numel() for w in weights], r.world)
    mine = [k for k in range(len(mods)) if owner[k] == r.rank]
    t0 = time.perf_counter()
    solved = method.quantize([weights[k] for k in mine], obs, spec, stage, job.scale_dtype) if mine else []
    each = (time.perf_counter() - t0) / max(len(mine), 1)
    if r.world == 1:
        return solved, [each] * len(solved)
    got = dict(zip(mine, solved))
    pieces, seconds = [], []
    for k in range(len(mods)):
        q = got.get(k)
        t = share([q.weight, q.scale, q.zero_point, q.g_idx, encode_json({"stats": q.stats, "seconds": each}),
                   q.global_scale] if q is not None else None, owner[k], r)
        extra = decode_json(t[4])
        pieces.append(q if q is not None else QuantizedWeight(t[0], t[1], t[2], t[3], extra["stats"],
                                                              global_scale=t[5]))
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

    def __init__(self, layer: nn.Module, plan: LayerPlan, job: Job):
        from quantkit.model.moe import RoutingObserver

        if job.ranks.world > 1:
            raise ConvertError(f"{plan.prefix}{plan.moe}: mixture-of-experts layers are calibrated in one process "
                               "for now; run this conversion without --nproc")
        self.layer, self.plan, self.job = layer, plan, job
        self.cfg = job.plan.calibration.moe
        self.block = layer.get_submodule(plan.moe)
        self.block.observer = RoutingObserver(self.block.num_experts, self.cfg.fallback == "all_tokens")
        self.how: dict[int, str] = {}

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


class _Chunk(greenlet.greenlet):
    """One calibration chunk's forward through a layer, as a coroutine (a greenlet).

    It runs between `step()` (called by the scheduler) and the next `pause()` (called from a hook inside
    the forward) or the end of the forward, then control is back with the scheduler. Coroutines rather
    than threads: everything stays on the caller's thread, so torch's thread-local state (grad mode,
    thread count) is the scheduler's and no thread is left behind when a layer fails.
    """

    def __init__(self, layer: nn.Module, hidden: torch.Tensor, kwargs: dict):
        super().__init__()
        self.layer, self.hidden, self.kwargs = layer, hidden, kwargs
        self.output: torch.Tensor | None = None

    def run(self) -> None:
        out = self.layer(to_layer_device(self.hidden, self.layer), **self.kwargs)
        self.output = out[0] if isinstance(out, tuple) else out

    def step(self) -> None:
        """Run this chunk until its next pause or its end; what its forward raises is raised here."""
        if not self.dead:
            self.switch()

    def abort(self) -> None:
        if self and not self.dead:  # started and paused: unwind its forward
            self.throw(greenlet.GreenletExit)


def _pause_chunk() -> None:
    current = greenlet.getcurrent()
    if isinstance(current, _Chunk):
        current.parent.switch()


def run_layer(layer: nn.Module, plan: LayerPlan, job: Job, hidden: torch.Tensor | None,
              layer_kwargs: dict[int, dict] | None,
              layout: ChunkLayout | None = None) -> tuple[list[ModuleResult], torch.Tensor | None]:
    """Quantize one layer; return its results and the next layer's input.

    With calibration data, the batch goes through the layer in chunks of `calibration.batch_size`
    samples (`layer_kwargs` maps a chunk's batch size to the layer's keyword arguments). Every chunk
    stops at the input of each sequential group in turn; once all have added their inputs to the
    group's statistics, the group is quantized and the chunks go on with the quantized weights. So one
    forward per layer still observes, quantizes (true-sequential) and propagates, while only one
    chunk's intermediate tensors are being computed at a time.

    Across processes `hidden` holds this rank's chunks of the `layout`; what the chunks teach is folded in
    global chunk order on every rank (quantkit/distributed.py).
    """
    results: list[ModuleResult] = []
    if hidden is None:  # weights only: no calibration forward
        for members in plan.groups:
            results += quantize_group(layer, plan.prefix, members, job, None)
        return results, None

    bs = job.plan.calibration.batch_size
    layout = layout or ChunkLayout.of(hidden.shape[0], bs, hidden.shape[1])
    pieces = [(h, layer_kwargs[h.shape[0]]) for h in hidden.split(bs)]  # views
    # transform stages (AWQ, SmoothQuant): one float forward to capture inputs, then fold the scales
    quantized = {t.name for t in plan.targets}
    smoothed = (apply_transforms(layer, plan.prefix, plan.smoothing, job, pieces, quantized, layout)
                if plan.smoothing else {})
    inputs = [GroupInputs(any(t.quantizer.needs == "hessian" for t in members), layout)
              for members in plan.groups]
    handles = []
    for g, (members, hooked) in enumerate(zip(plan.groups, plan.group_inputs)):
        mod = layer.get_submodule(hooked[len(plan.prefix):])

        def pre_hook(_m, args, g=g):
            inputs[g].add(args[0])
            _pause_chunk()

        handles.append(mod.register_forward_pre_hook(pre_hook))
        # what the engine does at run time: dynamic per-token activation quantization (W8A8, FP8)
        for t in members:
            if t.scheme.activations is not None:
                handles.append(layer.get_submodule(t.name[len(plan.prefix):]).register_forward_pre_hook(
                    activation_pre_hook(t.scheme.activations)))
    experts = _ExpertCalibration(layer, plan, job) if plan.moe is not None else None
    chunks = [_Chunk(layer, h, kw) for h, kw in pieces]
    out = torch.empty_like(hidden)
    grad = torch.is_grad_enabled()
    torch.set_grad_enabled(False)  # for the chunks too: they run on this thread
    # recipe kv_cache: k/v scales from the keys and values these (quantized-model) chunks feed attention
    kv_policy = job.plan.kv_cache
    kv = (KVObserver.install(layer, plan.prefix, kv_policy.attention, kv_policy.strategy, layout)
          if kv_policy is not None else None)
    try:
        for g, members in enumerate(plan.groups):
            for c in chunks:
                c.step()  # to group g's input
            obs = inputs[g].observations()
            if experts is not None and g in plan.experts:
                results += experts.quantize(g, members, obs)
            else:
                results += quantize_group(layer, plan.prefix, members, job, obs)
            inputs[g] = obs = None
        row = 0
        for c in chunks:
            c.step()  # to the end of the layer
            out[row:row + c.hidden.shape[0]] = c.output
            row += c.hidden.shape[0]
            c.output = None
    finally:
        for c in chunks:
            c.abort()
        for h in handles:
            h.remove()
        if experts is not None:
            experts.block.observer = None
        if kv is not None:
            kv.remove()
        torch.set_grad_enabled(grad)
    if kv is not None:  # the scales travel with the layer's first result into the work folder and the export
        if not results:
            raise ConvertError(f"layer {plan.index}: kv_cache needs at least one quantized module in every layer "
                               "to carry the layer's k/v scales; this layer has none (check stages' targets/ignore)")
        scales, kv_stats = kv.finish()
        results[0].rewritten.update(scales)
        results[0].stats["kv_cache"] = kv_stats
    for r in results:  # diagnostics and folded float tensors travel with the target
        if r.name in smoothed:
            r.stats["smoothing"] = smoothed[r.name].smoothing
            r.rewritten.update(smoothed[r.name].tensors)
    return results, out


# ------------------------------------------------------------------------------------- layer inputs
def capture_layer_inputs(model: nn.Module, arch: ArchSpec, ckpt: LazyCheckpoint, input_ids: torch.Tensor,
                         dtype: torch.dtype, batch_size: int) -> tuple[torch.Tensor, dict[int, list[dict]]]:
    """Run the embedding (and whatever precedes the layers) once, in chunks of `batch_size` samples.

    Returns the first layer's input for the whole batch and, for each chunk size that occurs, every
    layer's keyword arguments (position embeddings, masks) as the model builds them for that size.
    """
    layers = model.get_submodule(arch.layers)
    embed = model.get_submodule(arch.embed)
    materialize(embed, arch.embed + ".", ckpt, dtype)
    kwargs_by_size: dict[int, list[dict]] = {}
    first_hidden: list[torch.Tensor] = []

    class Recorder(nn.Module):
        def __init__(self, idx: int, inner: nn.Module):
            super().__init__()
            self.idx, self.inner = idx, inner
            self.attention_type = getattr(inner, "attention_type", None)

        def forward(self, hidden_states, *args, **kwargs):
            if args:
                raise ConvertError("decoder layers called with positional arguments are not supported")
            kw = {k: v for k, v in kwargs.items() if k not in ("past_key_values", "past_key_value")}
            kw["use_cache"] = False
            recorded[self.idx] = kw
            if self.idx == 0:
                first_hidden.append(hidden_states.to(dtype))
            if self.idx == len(layers) - 1:
                raise _StopForward
            return hidden_states

    originals = list(layers)
    for i in range(len(layers)):
        layers[i] = Recorder(i, originals[i])
    try:
        for ids in input_ids.split(batch_size):  # [<= batch_size, seq]
            recorded: list[dict] = [None] * len(layers)  # type: ignore[list-item]
            try:
                with torch.no_grad():
                    model.get_submodule(arch.layers.rsplit(".", 1)[0])(input_ids=ids, use_cache=False)
            except _StopForward:
                pass
            kwargs_by_size.setdefault(ids.shape[0], recorded)
    finally:
        for i in range(len(layers)):
            layers[i] = originals[i]
        release(embed)
    return torch.cat(first_hidden), kwargs_by_size


# ------------------------------------------------------------------------------------------- the loop
def process_layers(model: nn.Module, arch: ArchSpec, ckpt: LazyCheckpoint, plan: Plan, job: Job, work: WorkDir,
                   start: int, input_ids: torch.Tensor | None, device: torch.device, quiet: bool = False) -> None:
    """Every layer from `start` on, each saved in `work` as it finishes (the resume point)."""
    compute = job.compute
    keep_large_allocations_off_the_heap()
    layers = model.get_submodule(arch.layers)
    hidden, layer_kwargs, layout = None, None, None
    if input_ids is not None:
        bs = job.plan.calibration.batch_size
        layout = ChunkLayout.of(input_ids.shape[0], bs, input_ids.shape[1], job.ranks)
        first, by_size = capture_layer_inputs(model, arch, ckpt, layout.local(input_ids), compute, bs)
        hidden = first if start == 0 else layout.local(work.hidden(start))
        del first
        place, why = activation_placement(device, 2 * hidden.numel() * hidden.element_size(), _largest_layer_bytes(plan, ckpt, compute))
        log.info("calibration activations (%s x 2) on %s: %s", human_bytes(hidden.numel() * hidden.element_size()), place, why)
        hidden = hidden.to(device) if place == "device" else (hidden.pin_memory() if device.type == "cuda" else hidden)
        layer_kwargs = [{size: _to_device(kws[i], device, compute) for size, kws in by_size.items()}
                        for i in range(len(layers))]
    bar = tqdm(range(start, len(layers)), desc="layers", unit="layer", disable=quiet or not job.ranks.root, initial=start,
               total=len(layers))
    for i in bar:
        t0 = time.perf_counter()
        layer = layers[i]
        lp = plan.layers[i]
        materialize(layer, lp.prefix, ckpt, compute, device)
        results, hidden = run_layer(layer, lp, job, hidden, layer_kwargs[i] if layer_kwargs else None, layout)
        release(layer)
        whole = layout.gather(hidden) if layout is not None else None  # rank 0: the whole batch
        if job.ranks.root:
            work.save_layer(i, results, whole.cpu() if whole is not None else None)
        del whole
        worst = min((r.stats.get("output_sqnr_db", r.stats["weight_sqnr_db"]) for r in results), default=float("nan"))
        loss = sum(r.stats.get("gptq_loss", 0.0) for r in results)
        bar.set_postfix_str(f"min SQNR {worst:.1f} dB" + (f", GPTQ loss {loss:.3g}" if loss else ""))
        log.info("layer %d done in %.2fs: min SQNR %.2f dB%s", i, time.perf_counter() - t0, worst,
                 f", GPTQ loss {loss:.4g}" if loss else "")
        del results
        release_free_memory()


def activation_placement(device: torch.device, need_bytes: int, layer_bytes: int,
                         free_bytes: int | None = None) -> tuple[str, str]:
    """Where the calibration activations (a layer's input and output for the whole batch) live: on the GPU
    when they fit beside the layer being processed (its weights, Hessians and the solves' workspace, taken as
    3x the layer's compute-dtype size) with 10% to spare, else in pinned host memory, moved chunk by chunk."""
    if device.type != "cuda":
        return "device", "the conversion runs on the CPU"
    if free_bytes is None:
        free_bytes = torch.cuda.mem_get_info(device)[0]
    room = int(0.9 * free_bytes) - 3 * layer_bytes
    if need_bytes <= room:
        return "device", f"{human_bytes(need_bytes)} fit in {human_bytes(max(room, 0))} of GPU memory left beside the layer"
    return "host", (f"{human_bytes(need_bytes)} do not fit in {human_bytes(max(room, 0))} of GPU memory left beside "
                    "the layer: they stay in pinned host memory and move to the GPU one chunk at a time")


def _largest_layer_bytes(plan: Plan, ckpt: LazyCheckpoint, compute: torch.dtype) -> int:
    """The largest decoder layer's parameters in the compute dtype, from the checkpoint's headers."""
    size = torch.empty((), dtype=compute).element_size()
    return size * max((sum(ckpt.numel(k) for k in ckpt.keys() if k.startswith(lp.prefix)) for lp in plan.layers),
                      default=0)


def _to_device(obj, device, dtype):
    if isinstance(obj, torch.Tensor):
        return obj.to(device=device, dtype=dtype) if obj.is_floating_point() else obj.to(device)
    if isinstance(obj, tuple):
        return tuple(_to_device(o, device, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: _to_device(v, device, dtype) for k, v in obj.items()}
    return obj
