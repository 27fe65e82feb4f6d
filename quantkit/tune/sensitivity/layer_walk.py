"""The float layer walk sensitivity measures on: a visitor of the shared layer walk (quantkit/quantize/walk.py),
the one convert's pipeline visits too.

Unlike convert's visitor it stays float: each layer's float output is the next layer's input, and the measurement
quantizes units on forwards of its own (FloatLayer.forward) against the float output (FloatLayer.ref).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from quantkit.plan import LayerPlan, Plan
from quantkit.quantize.layers import GroupInputHooks
from quantkit.quantize.walk import Walk as LayerWalk
from quantkit.quantize.walk import observing
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
    inputs: GroupInputHooks  # per sequential group: what its calibration inputs taught

    def forward(self) -> torch.Tensor:
        return forward(self.module, self.pieces)

    def observations(self, g: int):
        """What group `g`'s calibration inputs taught (then dropped: they can be large)."""
        return self.inputs.observations(g)


def forward(layer: nn.Module, pieces) -> torch.Tensor:
    from quantkit.model.checkpoint import to_layer_device

    outs = []
    for h, kw in pieces:
        o = layer(to_layer_device(h, layer), **kw)
        outs.append(o[0] if isinstance(o, tuple) else o)
    return torch.cat(outs)


class _FloatVisitor:
    """Convert's walk kept float: the group inputs gathered on the layer's float forward, whose output is the
    next layer's input; `on_layer` measures what it wants while the layer is materialized."""

    def __init__(self, on_layer: Callable[[FloatLayer], str], batch_size: int):
        self.on_layer, self.batch_size = on_layer, batch_size

    def visit(self, index: int, layer: nn.Module, lp: LayerPlan, inp) -> tuple[torch.Tensor, str]:
        hooks = GroupInputHooks(lp, inp.layout)
        pieces = inp.pieces(self.batch_size)
        with observing(layer, [hooks]):
            ref = forward(layer, pieces)
        return ref, self.on_layer(FloatLayer(lp, layer, pieces, ref, hooks))


def walk_float_layers(setup: Walk, on_layer: Callable[[FloatLayer], str]) -> None:
    """Every decoder layer in turn through the shared layer walk (quantkit/quantize/walk.py), run float over
    the calibration batch with its sequential groups' inputs gathered; `on_layer` sees each before release."""
    walk = LayerWalk(setup.module, setup.arch, setup.ckpt, setup.plan, setup.device, setup.compute)
    walk.run(_FloatVisitor(on_layer, setup.plan.calibration.batch_size), setup.calib.input_ids, quiet=True)
