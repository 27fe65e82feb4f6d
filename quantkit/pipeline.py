"""The layer-sequential, memory-bounded, resumable conversion pipeline.

For each decoder layer: load only that layer from the safetensors files, run the whole calibration
batch through it once with a pre-hook on the first Linear of every sequential group (q/k/v -> o ->
gate/up -> down). When the hook fires it has the group's real input (already shaped by the quantized
groups before it), quantizes the group's weights on the spot and lets the forward go on with them, so
one forward per layer observes, quantizes (true-sequential) and produces the next layer's input.
The layer's compressed tensors, its diagnostics and the next layer's input are then saved in the work
folder, which is the resume point; the layer goes back to the meta device.

Without calibration data (round-to-nearest only) no forward runs at all: weights are rounded layer by
layer straight from the checkpoint.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import greenlet
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm.auto import tqdm

from quantkit.algorithms.gptq import HessianAccumulator, gptq_quantize
from quantkit.algorithms.rtn import check_divisible, fake_quantize_activations, output_sqnr_db, rtn, sqnr_db
from quantkit.export.compressed_tensors import compress_linear
from quantkit.io import atomic_write_json, keep_large_allocations_off_the_heap, release_free_memory
from quantkit.models import ArchSpec, LazyCheckpoint, materialize, release
from quantkit.recipe import Recipe, matches_pattern
from quantkit.schemes import Scheme, get_scheme
from quantkit.transforms import apply_transforms, plan_smoothing

log = logging.getLogger("quantkit")
SQNR_TOKENS = 4096  # calibration tokens for the output SQNR of stages without a Hessian (RTN)


class ConvertError(RuntimeError):
    pass


class _StopForward(Exception):
    pass


@dataclass
class Target:
    name: str  # full module name, e.g. model.layers.3.mlp.down_proj
    stage: int
    scheme: Scheme
    ct_scheme: object  # compressed-tensors QuantizationScheme


@dataclass
class LayerPlan:
    index: int
    prefix: str  # "model.layers.3."
    groups: list[list[Target]] = field(default_factory=list)  # true-sequential order
    group_inputs: list[str] = field(default_factory=list)  # module hooked to see each group's input
    smoothing: list = field(default_factory=list)  # transforms.Smoothing: mappings a transform stage rescales


def stage_scheme(recipe: Recipe, i: int) -> Scheme:
    st = recipe.stages[i]
    return get_scheme(st.scheme).with_overrides(group_size=st.group_size, symmetric=st.symmetric)


def ct_actorder(recipe: Recipe, i: int) -> str | None:
    st = recipe.stages[i]
    return "group" if getattr(st, "actorder", "none") == "group" else None


def plan_layers(model: nn.Module, arch: ArchSpec, recipe: Recipe) -> tuple[list[LayerPlan], list[str]]:
    """Which module each stage quantizes; fails early on group sizes that do not divide."""
    layers = model.get_submodule(arch.layers)
    ct_schemes = {}
    plans = []
    all_linear = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    quantized: set[str] = set()
    for li in range(len(layers)):
        prefix = f"{arch.layers}.{li}."
        plan = LayerPlan(li, prefix)
        for group in arch.sequential:
            members = []
            for local in group:
                full = prefix + local
                mod = model.get_submodule(full)
                for si, st in enumerate(recipe.stages):
                    if st.is_transform:  # transforms rescale; only quantizer stages own modules
                        continue
                    if matches_pattern(st.targets, full, type(mod).__name__) and not matches_pattern(st.ignore, full, type(mod).__name__):
                        scheme = stage_scheme(recipe, si)
                        check_divisible(scheme.weights, mod.in_features, full)
                        if si not in ct_schemes:
                            ct_schemes[si] = scheme.to_compressed_tensors(targets=[], actorder=ct_actorder(recipe, si))
                        members.append(Target(full, si, scheme, ct_schemes[si]))
                        quantized.add(full)
                        break
            if members:
                plan.groups.append(members)
                plan.group_inputs.append(prefix + group[0])
        plan.smoothing = plan_smoothing(arch, recipe, prefix, {t.name: t for g in plan.groups for t in g})
        plans.append(plan)
    for si, st in enumerate(recipe.stages):
        for name in sorted(all_linear - quantized) if not st.is_transform else ():
            if name.endswith("lm_head") and not matches_pattern(st.ignore, name, "Linear") and \
                    matches_pattern(st.targets, name, "Linear"):
                raise ConvertError(f"stages[{si}]: quantizing lm_head is not supported; keep 'lm_head' in "
                                   f"stages[{si}].ignore")
    if not quantized:
        raise ConvertError("no module matches any stage's targets (check stages[*].targets and ignore)")
    return plans, sorted(all_linear - quantized)


# ------------------------------------------------------------------------------------------ layer work
class GroupInputs:
    """What a sequential group's quantizers need from its calibration inputs, gathered chunk by chunk:
    the Hessian when a GPTQ stage owns a member, else the first SQNR_TOKENS rows for the diagnostic."""

    def __init__(self, hessian: bool):
        self.hessian = hessian
        self.acc: HessianAccumulator | None = None
        self._rows: list[torch.Tensor] = []
        self._n = 0

    def add(self, x: torch.Tensor) -> None:
        x2 = x.reshape(-1, x.shape[-1]).float()  # [tokens, in]
        if self.hessian:
            if self.acc is None:
                self.acc = HessianAccumulator(x2.shape[-1], device=x2.device)
            self.acc.add(x2)
        elif self._n < SQNR_TOKENS:
            self._rows.append(x2[:SQNR_TOKENS - self._n].clone())
            self._n += self._rows[-1].shape[0]

    @property
    def H(self) -> torch.Tensor | None:
        return self.acc.H if self.acc is not None else None

    @property
    def sample(self) -> torch.Tensor | None:
        return torch.cat(self._rows) if self._rows else None


def needs_hessian(members: list[Target], recipe: Recipe) -> bool:
    return any(recipe.stages[t.stage].method == "gptq" for t in members)


def quantize_group(layer_root: nn.Module, prefix: str, members: list[Target], recipe: Recipe,
                   inputs: GroupInputs | None, scale_dtype: torch.dtype,
                   capture: dict | None = None) -> dict[str, dict]:
    """Quantize one sequential group in place (weights replaced by their dequantized values).

    `inputs` holds what the group's calibration inputs taught (None: weights only, no calibration).
    Returns per-module results: compressed tensors and diagnostics.
    """
    out: dict[str, dict] = {}
    by_stage: dict[int, list[Target]] = {}
    for t in members:
        by_stage.setdefault(t.stage, []).append(t)
    H = inputs.H if inputs is not None else None
    xs = inputs.sample if inputs is not None else None  # [<= SQNR_TOKENS, in], only without a Hessian
    for si, targets in by_stage.items():
        st = recipe.stages[si]
        mods = [layer_root.get_submodule(t.name[len(prefix):]) for t in targets]
        spec = targets[0].scheme.weights
        t0 = time.perf_counter()
        if st.method == "gptq":
            if H is None:
                raise ConvertError(f"{targets[0].name}: GPTQ needs calibration inputs, and none reached this module")
            W = torch.cat([m.weight.detach().float() for m in mods], dim=0)  # [sum(out), in]: rows independent
            res = gptq_quantize(W, H, spec, block_size=st.block_size, dampening_frac=st.dampening_frac,
                                actorder=st.actorder, scale_dtype=scale_dtype)
            row = 0
            pieces = []
            for m in mods:
                r = slice(row, row + m.out_features)
                row += m.out_features
                zp = res.qparams.zero_point[r] if res.qparams.zero_point is not None else None
                pieces.append((res.weight[r], res.qparams.scale[r], zp, res.g_idx,
                               {"gptq_loss": float(res.loss[r].sum()), "damping": res.damping}))
        else:  # rtn
            pieces = []
            for m in mods:
                deq, qp = rtn(m.weight.detach().float(), spec, scale_dtype)
                pieces.append((deq, qp.scale, qp.zero_point, None, {}))
        elapsed = time.perf_counter() - t0
        for t, m, (deq, scale, zp, g_idx, extra) in zip(targets, mods, pieces):
            w = m.weight.detach().float()
            stats = {"stage": si, "method": st.method, "scheme": t.scheme.name,
                     "weight_sqnr_db": round(sqnr_db(w, deq), 3), "seconds": round(elapsed / len(mods), 4), **extra}
            if H is not None:  # exact over every calibration token
                stats["output_sqnr_db"] = round(output_sqnr_db(w, deq, H), 3)
            elif xs is not None:
                stats["output_sqnr_db"] = round(sqnr_db(xs @ w.t(), xs @ deq.t()), 3)
            tensors = compress_linear(t.name, deq, scale, zp, g_idx, t.ct_scheme, scale_dtype)
            m.weight.data = deq.to(m.weight.dtype)
            if capture is not None:
                capture[t.name] = deq.detach().cpu().clone()
            out[t.name] = {"stats": stats, "tensors": tensors}
    return out


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
        out = self.layer(self.hidden, **self.kwargs)
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


def run_layer(layer: nn.Module, plan: LayerPlan, recipe: Recipe, hidden: torch.Tensor | None,
              layer_kwargs: dict[int, dict] | None, scale_dtype: torch.dtype,
              capture: dict | None = None) -> tuple[dict[str, dict], torch.Tensor | None]:
    """Quantize one layer; return its results and the next layer's input.

    With calibration data, the batch goes through the layer in chunks of `calibration.batch_size`
    samples (`layer_kwargs` maps a chunk's batch size to the layer's keyword arguments). Every chunk
    stops at the input of each sequential group in turn; once all have added their inputs to the
    group's statistics, the group is quantized and the chunks go on with the quantized weights. So one
    forward per layer still observes, quantizes (true-sequential) and propagates, while only one
    chunk's intermediate tensors are being computed at a time.
    """
    results: dict[str, dict] = {}
    if hidden is None:  # weights only: no calibration forward
        for members in plan.groups:
            results.update(quantize_group(layer, plan.prefix, members, recipe, None, scale_dtype, capture))
        return results, None

    pieces = [(h, layer_kwargs[h.shape[0]]) for h in hidden.split(recipe.calibration.batch_size)]  # views
    # transform stages (AWQ, SmoothQuant): one float forward to capture inputs, then fold the scales
    smoothed = apply_transforms(layer, plan.prefix, plan.smoothing, recipe, pieces, scale_dtype,
                                {t.name for g in plan.groups for t in g}, capture) if plan.smoothing else {}
    inputs = [GroupInputs(needs_hessian(members, recipe)) for members in plan.groups]
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
                act = t.scheme.activations
                handles.append(layer.get_submodule(t.name[len(plan.prefix):]).register_forward_pre_hook(
                    lambda _m, args, act=act: (fake_quantize_activations(args[0], act),) + tuple(args[1:])))
    chunks = [_Chunk(layer, h, kw) for h, kw in pieces]
    out = torch.empty_like(hidden)
    grad = torch.is_grad_enabled()
    torch.set_grad_enabled(False)  # for the chunks too: they run on this thread
    try:
        for g, members in enumerate(plan.groups):
            for c in chunks:
                c.step()  # to group g's input
            results.update(quantize_group(layer, plan.prefix, members, recipe, inputs[g], scale_dtype, capture))
            inputs[g] = None
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
        torch.set_grad_enabled(grad)
    for name, extra in smoothed.items():  # diagnostics and folded float tensors travel with the target
        results[name]["stats"]["smoothing"] = extra["smoothing"]
        results[name]["tensors"].update(extra["tensors"])
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


# ---------------------------------------------------------------------------------------- work folder
class WorkDir:
    """Resume state: per-layer compressed tensors + stats, the next layer's input, and a state file."""

    def __init__(self, root: Path):
        self.root = root
        self.layers = root / "layers"

    def state(self) -> dict | None:
        p = self.root / "state.json"
        return json.loads(p.read_text()) if p.is_file() else None

    def start(self, fingerprint: dict, restart: bool) -> int:
        st = self.state()
        if st is not None and st["fingerprint"] != fingerprint:
            if not restart:
                changed = [k for k in fingerprint if st["fingerprint"].get(k) != fingerprint[k]]
                raise ConvertError(
                    f"{self.root}: an unfinished conversion with a different {', '.join(changed)} is here; "
                    "run again with --restart to discard it, or choose another --output")
            st = None
        if st is None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.layers.mkdir(parents=True)
            atomic_write_json(self.root / "state.json", {"fingerprint": fingerprint, "next_layer": 0})
            return 0
        return int(st["next_layer"])

    def save_layer(self, index: int, results: dict[str, dict], hidden: torch.Tensor | None) -> None:
        tensors = {k: v for r in results.values() for k, v in r["tensors"].items()}
        tmp = self.layers / f".{index:05d}.tmp"
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        tmp.replace(self.layers / f"{index:05d}.safetensors")
        atomic_write_json(self.layers / f"{index:05d}.json", {k: r["stats"] for k, r in results.items()})
        if hidden is not None:
            tmp = self.root / f".hidden-{index + 1:05d}.tmp"
            save_file({"hidden": hidden.contiguous()}, str(tmp))
            tmp.replace(self.root / f"hidden-{index + 1:05d}.safetensors")
        st = self.state()
        st["next_layer"] = index + 1
        atomic_write_json(self.root / "state.json", st)
        old = self.root / f"hidden-{index:05d}.safetensors"
        old.unlink(missing_ok=True)

    def hidden(self, index: int) -> torch.Tensor:
        return load_file(str(self.root / f"hidden-{index:05d}.safetensors"))["hidden"]

    def layer_files(self, n: int) -> list[Path]:
        return [self.layers / f"{i:05d}.safetensors" for i in range(n)]

    def layer_stats(self, n: int) -> dict[str, dict]:
        stats: dict[str, dict] = {}
        for i in range(n):
            stats.update(json.loads((self.layers / f"{i:05d}.json").read_text()))
        return stats


def process_layers(model: nn.Module, arch: ArchSpec, ckpt: LazyCheckpoint, plans: list[LayerPlan],
                   recipe: Recipe, work: WorkDir, start: int, input_ids: torch.Tensor | None,
                   device: torch.device, quiet: bool = False, capture: dict | None = None) -> None:
    compute = torch.float32
    scale_dtype = getattr(torch, recipe.model.dtype)
    keep_large_allocations_off_the_heap()
    layers = model.get_submodule(arch.layers)
    hidden, layer_kwargs = None, None
    if input_ids is not None:
        first, by_size = capture_layer_inputs(model, arch, ckpt, input_ids, compute, recipe.calibration.batch_size)
        hidden = first if start == 0 else work.hidden(start)
        del first
        hidden = hidden.to(device)
        layer_kwargs = [{size: _to_device(kws[i], device, compute) for size, kws in by_size.items()}
                        for i in range(len(layers))]
    bar = tqdm(range(start, len(layers)), desc="layers", unit="layer", disable=quiet, initial=start,
               total=len(layers))
    for i in bar:
        t0 = time.perf_counter()
        layer = layers[i]
        materialize(layer, plans[i].prefix, ckpt, compute, device)
        results, hidden = run_layer(layer, plans[i], recipe, hidden, layer_kwargs[i] if layer_kwargs else None,
                                    scale_dtype, capture)
        release(layer)
        work.save_layer(i, results, hidden.cpu() if hidden is not None else None)
        worst = min((r["stats"].get("output_sqnr_db", r["stats"]["weight_sqnr_db"]) for r in results.values()),
                    default=float("nan"))
        loss = sum(r["stats"].get("gptq_loss", 0.0) for r in results.values())
        bar.set_postfix_str(f"min SQNR {worst:.1f} dB" + (f", GPTQ loss {loss:.3g}" if loss else ""))
        log.info("layer %d done in %.2fs: min SQNR %.2f dB%s", i, time.perf_counter() - t0, worst,
                 f", GPTQ loss {loss:.4g}" if loss else "")
        del results
        release_free_memory()


def _to_device(obj, device, dtype):
    if isinstance(obj, torch.Tensor):
        return obj.to(device=device, dtype=dtype) if obj.is_floating_point() else obj.to(device)
    if isinstance(obj, tuple):
        return tuple(_to_device(o, device, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: _to_device(v, device, dtype) for k, v in obj.items()}
    return obj
