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
def quantize_group(layer_root: nn.Module, prefix: str, members: list[Target], recipe: Recipe,
                   x: torch.Tensor | None, scale_dtype: torch.dtype,
                   capture: dict | None = None) -> dict[str, dict]:
    """Quantize one sequential group in place (weights replaced by their dequantized values).

    Returns per-module results: compressed tensors and diagnostics.
    """
    out: dict[str, dict] = {}
    H = None
    by_stage: dict[int, list[Target]] = {}
    for t in members:
        by_stage.setdefault(t.stage, []).append(t)
    x2 = x.reshape(-1, x.shape[-1]).float() if x is not None else None  # [tokens, in]
    for si, targets in by_stage.items():
        st = recipe.stages[si]
        mods = [layer_root.get_submodule(t.name[len(prefix):]) for t in targets]
        spec = targets[0].scheme.weights
        t0 = time.perf_counter()
        if st.method == "gptq":
            if H is None:
                acc = HessianAccumulator(x2.shape[-1], device=x2.device)
                acc.add(x2)
                H = acc.H
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
            elif x2 is not None:
                xs = x2[:SQNR_TOKENS]
                stats["output_sqnr_db"] = round(sqnr_db(xs @ w.t(), xs @ deq.t()), 3)
            tensors = compress_linear(t.name, deq, scale, zp, g_idx, t.ct_scheme, scale_dtype)
            m.weight.data = deq.to(m.weight.dtype)
            if capture is not None:
                capture[t.name] = deq.detach().cpu().clone()
            out[t.name] = {"stats": stats, "tensors": tensors}
    return out


def run_layer(layer: nn.Module, plan: LayerPlan, recipe: Recipe, hidden: torch.Tensor | None,
              layer_kwargs: dict | None, scale_dtype: torch.dtype,
              capture: dict | None = None) -> tuple[dict[str, dict], torch.Tensor | None]:
    results: dict[str, dict] = {}
    if hidden is None:  # weights only: no calibration forward
        for members in plan.groups:
            results.update(quantize_group(layer, plan.prefix, members, recipe, None, scale_dtype, capture))
        return results, None

    # transform stages (AWQ, SmoothQuant): one float forward to capture inputs, then fold the scales
    smoothed = apply_transforms(layer, plan.prefix, plan.smoothing, recipe, hidden, layer_kwargs, scale_dtype,
                                {t.name for g in plan.groups for t in g}, capture) if plan.smoothing else {}
    handles = []
    for members, hooked in zip(plan.groups, plan.group_inputs):
        mod = layer.get_submodule(hooked[len(plan.prefix):])

        def pre_hook(_m, args, members=members):
            results.update(quantize_group(layer, plan.prefix, members, recipe, args[0], scale_dtype, capture))

        handles.append(mod.register_forward_pre_hook(pre_hook))
        # what the engine does at run time: dynamic per-token activation quantization (W8A8, FP8)
        for t in members:
            if t.scheme.activations is not None:
                act = t.scheme.activations
                handles.append(layer.get_submodule(t.name[len(plan.prefix):]).register_forward_pre_hook(
                    lambda _m, args, act=act: (fake_quantize_activations(args[0], act),) + tuple(args[1:])))
    try:
        with torch.no_grad():
            out = layer(hidden, **layer_kwargs)
    finally:
        for h in handles:
            h.remove()
    out = out[0] if isinstance(out, tuple) else out
    for name, extra in smoothed.items():  # diagnostics and folded float tensors travel with the target
        results[name]["stats"]["smoothing"] = extra["smoothing"]
        results[name]["tensors"].update(extra["tensors"])
    return results, out


# ------------------------------------------------------------------------------------- layer inputs
def capture_layer_inputs(model: nn.Module, arch: ArchSpec, ckpt: LazyCheckpoint, input_ids: torch.Tensor,
                         dtype: torch.dtype) -> tuple[torch.Tensor, list[dict]]:
    """Run the embedding (and whatever precedes the layers) once; record each layer's keyword arguments."""
    layers = model.get_submodule(arch.layers)
    embed = model.get_submodule(arch.embed)
    materialize(embed, arch.embed + ".", ckpt, dtype)
    kwargs_per_layer: list[dict] = [None] * len(layers)  # type: ignore[list-item]
    first_hidden: list[torch.Tensor] = []

    class Recorder(nn.Module):
        def __init__(self, idx: int, inner: nn.Module):
            super().__init__()
            self.idx, self.inner = idx, inner
            self.attention_type = getattr(inner, "attention_type", None)

        def forward(self, hidden_states, *args, **kwargs):
            if args:
                raise ConvertError("decoder layers called with positional arguments are not supported")
            kwargs_per_layer[self.idx] = {k: v for k, v in kwargs.items() if k not in ("past_key_values", "past_key_value")}
            kwargs_per_layer[self.idx]["use_cache"] = False
            if self.idx == 0:
                first_hidden.append(hidden_states)
            if self.idx == len(layers) - 1:
                raise _StopForward
            return hidden_states

    originals = list(layers)
    for i in range(len(layers)):
        layers[i] = Recorder(i, originals[i])
    try:
        with torch.no_grad():
            model.get_submodule(arch.layers.rsplit(".", 1)[0])(input_ids=input_ids, use_cache=False)
    except _StopForward:
        pass
    finally:
        for i in range(len(layers)):
            layers[i] = originals[i]
        release(embed)
    return first_hidden[0].to(dtype), kwargs_per_layer


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
        first, layer_kwargs = capture_layer_inputs(model, arch, ckpt, input_ids, compute)
        hidden = first if start == 0 else work.hidden(start)
        hidden = hidden.to(device)
        layer_kwargs = [_to_device(kw, device, compute) for kw in layer_kwargs]
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
