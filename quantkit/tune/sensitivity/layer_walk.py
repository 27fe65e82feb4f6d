"""The float layer walk sensitivity measures on: convert's layer loop (quantize/layers.py) rebuilt in one
place, so that it can become a visitor of the shared layer walker.

Unlike convert's walk it stays float: each layer's float output is the next layer's input, and the visitor
quantizes units on forwards of its own (FloatLayer.forward) against the float output (FloatLayer.ref).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import torch
from torch import nn

from quantkit.plan import LayerPlan, Plan
from quantkit.recipe import Recipe

if TYPE_CHECKING:
    from quantkit.data import CalibrationSet
    from quantkit.model.arch import ArchSpec
    from quantkit.model.checkpoint import LazyCheckpoint


@dataclass
class Walk:
    """What one walk goes over: the skeleton (no weights), its plan, the lazy checkpoint and the
    calibration batch, on the conversion device in the compute dtype."""

    recipe: Recipe
    model_dir: Path
    module: nn.Module
    arch: ArchSpec
    plan: Plan
    ckpt: LazyCheckpoint
    calib: CalibrationSet
    device: torch.device
    compute: torch.dtype


def open_walk(recipe: Recipe, device: str = "auto") -> Walk:
    from quantkit.data import build_calibration_set
    from quantkit.hardware import compute_dtype, conversion_device
    from quantkit.model.arch import arch_for
    from quantkit.model.checkpoint import LazyCheckpoint, build_skeleton
    from quantkit.model.sources import load_tokenizer, resolve_model_dir
    from quantkit.plan import make_plan

    dev, _ = conversion_device(device)
    compute = getattr(torch, compute_dtype(recipe.model.compute_dtype, dev)[0])
    model_dir = resolve_model_dir(recipe.model, quiet=True)
    tok = load_tokenizer(model_dir, recipe.model.trust_remote_code)
    calib = build_calibration_set(recipe.calibration, tok)
    model = build_skeleton(model_dir, recipe.model.dtype, recipe.model.trust_remote_code)
    arch = arch_for(model.config)
    plan = make_plan(model, arch, recipe)
    return Walk(recipe, model_dir, model, arch, plan, LazyCheckpoint(model_dir), calib, dev, compute)


@dataclass
class FloatLayer:
    """One decoder layer on the device after its float forward: what a visitor measures against."""

    plan: LayerPlan
    module: nn.Module
    pieces: list[tuple[torch.Tensor, dict]]  # the calibration chunks and the layer's keyword arguments
    ref: torch.Tensor  # the float layer's output for the whole batch
    inputs: list  # per sequential group: its GroupInputs, taken once by `observations`

    def forward(self) -> torch.Tensor:
        return forward(self.module, self.pieces)

    def observations(self, g: int):
        """What group `g`'s calibration inputs taught (its GroupInputs are dropped: they can be large)."""
        obs = self.inputs[g].observations()
        self.inputs[g] = None
        return obs


def forward(layer: nn.Module, pieces) -> torch.Tensor:
    from quantkit.model.checkpoint import to_layer_device

    outs = []
    for h, kw in pieces:
        o = layer(to_layer_device(h, layer), **kw)
        outs.append(o[0] if isinstance(o, tuple) else o)
    return torch.cat(outs)


def walk_float_layers(walk: Walk, hessian: bool) -> Iterator[FloatLayer]:
    """Every decoder layer in turn, materialized, run float over the calibration batch with its sequential
    groups' inputs gathered (the Hessian when `hessian`); released once the visitor is done with it."""
    from quantkit.distributed import ChunkLayout
    from quantkit.model.checkpoint import materialize, release
    from quantkit.quantize.layers import GroupInputs
    from quantkit.quantize.walk import capture_layer_inputs, to_device

    bs = walk.recipe.calibration.batch_size
    hidden, by_size = capture_layer_inputs(walk.module, walk.arch, walk.ckpt, walk.calib.input_ids, walk.compute, bs)
    hidden = hidden.to(walk.device)
    layout = ChunkLayout.of(hidden.shape[0], bs, hidden.shape[1])
    layers = walk.module.get_submodule(walk.arch.layers)
    for lp in walk.plan.layers:
        layer = layers[lp.index]
        materialize(layer, lp.prefix, walk.ckpt, walk.compute, walk.device)
        kws = {size: to_device(kw[lp.index], walk.device, walk.compute) for size, kw in by_size.items()}
        pieces = [(h, kws[h.shape[0]]) for h in hidden.split(bs)]
        inputs = [GroupInputs(hessian, layout) for _ in lp.groups]
        handles = [layer.get_submodule(name[len(lp.prefix):]).register_forward_pre_hook(
            lambda _m, args, g=g: inputs[g].add(args[0])) for g, name in enumerate(lp.group_inputs)]
        try:
            ref = forward(layer, pieces)
        finally:
            for h in handles:
                h.remove()
        yield FloatLayer(lp, layer, pieces, ref, inputs)
        hidden = ref  # the float model's activations go on to the next layer
        release(layer)
