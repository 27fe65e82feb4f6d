"""The measurement: every unit's squared error on its decoder layer's output, |y_q - y|^2 over every
calibration token, with that unit alone quantized (at the low scheme, and at the high one when it is
quantized too) by the recipe's own method while the rest of the layer stays float."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from quantkit.plan import Target
from quantkit.recipe import Recipe
from quantkit.schemes import Scheme
from quantkit.tune.sensitivity.layer_walk import FloatLayer, Walk, open_walk, walk_float_layers
from quantkit.tune.sensitivity.recipes import high_stage
from quantkit.tune.sensitivity.units import Unit, plan_units, use_proxy


@dataclass(frozen=True)
class _Quantizer:
    """The recipe's registered quantizer with its stage at the low and (None: float) the high scheme."""

    method: Any
    low: Any  # the recipe's stage config
    high_scheme: Scheme | None
    high: Any | None  # the same stage at the high scheme
    scale_dtype: torch.dtype

    @classmethod
    def of(cls, walk: Walk, high: Scheme | None) -> "_Quantizer":
        first = next(iter(walk.plan.targets.values()))  # the recipe's one quantizer stage owns every target
        hi = high_stage(walk.recipe.stages[0], high) if high is not None else None
        return cls(first.quantizer, first.stage.config, high, hi, getattr(torch, walk.recipe.model.dtype))


@torch.no_grad()
def measure(recipe: Recipe, high: Scheme | None, weights_dir: Path | None = None, device: str = "auto",
            progress: Callable[[str], None] | None = None) -> tuple[list[Unit], dict]:
    """Every unit's layer-output error at the low (and high) scheme, in one layer-by-layer pass.

    With `weights_dir`, each layer's quantized weights (low and high) are saved there as
    layer_NNNNN.safetensors, for validation to put into the full model later.
    """
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    say = progress or (lambda m: None)
    walk = open_walk(recipe, device)
    shapes = {t: tuple(walk.ckpt.layout(t + ".weight")[1]) for t in walk.plan.targets}
    float_bytes = torch.empty((), dtype=getattr(torch, recipe.model.dtype)).element_size()
    units = plan_units(walk.plan, shapes, high, float_bytes)
    by_layer: dict[int, list[Unit]] = {}
    for u in units:
        by_layer.setdefault(u.layer, []).append(u)
    q = _Quantizer.of(walk, high)
    if weights_dir is not None:
        weights_dir.mkdir(parents=True, exist_ok=True)
    say(f"sensitivity: {len(units)} units in {len(walk.plan.layers)} layers, {walk.calib.input_ids.numel()} calibration tokens")
    clock = {"layer": time.perf_counter(), "energy": 0.0}

    def on_layer(fl: FloatLayer) -> str:
        saved: dict[str, torch.Tensor] = {}
        for g, (members, unit) in enumerate(zip(fl.plan.groups, by_layer[fl.plan.index])):
            _measure_unit(fl, g, members, unit, q, saved if weights_dir is not None else None)
        if weights_dir is not None:
            save_file(saved, str(weights_dir / f"layer_{fl.plan.index:05d}.safetensors"))
        energy = clock["energy"] = float(fl.ref.double().pow(2).sum())
        for u in by_layer[fl.plan.index]:
            u.layer_energy = energy
        worst = max(by_layer[fl.plan.index], key=lambda u: u.sq_low)
        say(f"layer {fl.plan.index + 1}/{len(walk.plan.layers)} in {time.perf_counter() - clock['layer']:.1f}s: most "
            f"sensitive {worst.name} (error {worst.sq_low / energy:.3g} of this layer's output)")
        clock["layer"] = time.perf_counter()
        return worst.name

    walk_float_layers(walk, on_layer)
    energy = clock["energy"]
    use_proxy(units, "layer", energy)
    return units, _facts(walk, shapes, float_bytes, energy, t0)


def _measure_unit(fl: FloatLayer, g: int, members: list[Target], unit: Unit, q: _Quantizer,
                  saved: dict[str, torch.Tensor] | None) -> None:
    """Set `unit`'s sq_low (and sq_high): sequential group `g` quantized alone, the layer run again, its
    output compared with the float one; the float weights put back. The quantized weights go to `saved`."""
    from quantkit.algorithms.rtn import activation_pre_hook

    obs = fl.observations(g)
    mods = [fl.module.get_submodule(t.name[len(fl.plan.prefix):]) for t in members]
    originals = [m.weight.data.clone() for m in mods]
    for which, scheme, stage in (("low", members[0].scheme, q.low), ("high", q.high_scheme, q.high)):
        if scheme is None:
            continue
        got = q.method.quantize([w.float() for w in originals], obs, scheme.weights, stage, q.scale_dtype)
        hooks = []
        for m, qw in zip(mods, got):
            m.weight.data = qw.weight.to(m.weight.dtype)
            if scheme.activations is not None:
                hooks.append(m.register_forward_pre_hook(activation_pre_hook(scheme.activations)))
        try:
            sq = _sq_error(fl.forward(), fl.ref)
        finally:
            for h in hooks:
                h.remove()
            for m, w in zip(mods, originals):
                m.weight.data = w
        setattr(unit, f"sq_{which}", sq)
        if saved is not None:
            for t, qw in zip(members, got):
                saved[f"{which}.{t.name}"] = qw.weight.float().contiguous().cpu()  # exact


def _sq_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref.double()).pow(2).sum())


def _facts(walk: Walk, shapes: dict, float_bytes: int, final_energy: float, t0: float) -> dict:
    from quantkit.export.shards import stored_bytes

    return {"model_dir": str(walk.model_dir), "calibration_tokens": int(walk.calib.input_ids.numel()),
            "calibration_fingerprint": walk.calib.fingerprint, "compute_dtype": str(walk.compute).replace("torch.", ""),
            "device": str(walk.device), "float_bytes": float_bytes, "seconds": round(time.perf_counter() - t0, 1),
            "other_bytes": stored_bytes(walk.ckpt, {n + ".weight" for n in shapes}), "final_energy": final_energy}
