"""Learned rounding by signed gradient descent (the SignRound idea of Cheng et al. 2023, "Optimize Weight Rounding
via Signed Gradient Descent"; our own implementation), one decoder layer at a time.

Start: every Linear the stage owns is first quantized by GPTQ or RTN (`init`) like any quantizer, in the layer
walk's group pass, so the result can only start from a good point. Then, for the whole decoder layer at once:

- each weight gets a rounding offset V in [-0.5, 0.5] per element, added before rounding, and (with `learn_clip`)
  a range factor per group in [clip_min, 1] (by default from an RTN start only) that shrinks the group's max (and, asymmetric, its min) before the
  scale is derived, exactly as the scale of the start was derived (rounded to its storage dtype);
- the layer's output on calibration chunks (the quantized model's activations) is compared with the float
  model's output at this layer (`reference: float_model`, the default: the float layer on the float model's own
  activations, a second stream the walk carries; so each layer also undoes what the quantized layers before it
  changed) or with the float layer on the same inputs (`float_layer`) (mean squared error), gradients reach V and the factors through straight-through rounding, and every
  parameter moves by `lr x sign(gradient)` with lr decaying linearly to zero over `steps`;
- the parameters with the lowest chunk loss seen (as a fraction of the start's loss on that chunk) are kept, and they replace the start only if they also
  lower the error over every calibration chunk: the refinement never leaves a layer worse than its start.

What is learned is frozen to the integer grid: the export holds ordinary int codes and scales (int4/int8,
symmetric or with zero points, groups or channels, GPTQ's g_idx kept), so nothing changes for the engine.

Cost: `steps` forward + backward passes of one layer over one chunk (`calibration.batch_size` samples)
each, plus two full passes (the float reference and the final check). Across `--nproc` processes each
process steps through its own chunks and the gradients are summed before the sign is taken (deterministic
per world size). Left out: FP4/FP8 grids (refused by the recipe), learning the scales' exponent directly.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Literal

import torch
from pydantic import Field, model_validator
from torch import nn

from quantkit.algorithms import gptq, rtn
from quantkit.algorithms.contract import Observations, QuantizedWeight
from quantkit.algorithms.gptq import GPTQStage
from quantkit.schemes import SCHEMES, WeightSpec

log = logging.getLogger("quantkit")


class AutoRoundStage(GPTQStage):
    """Learned rounding and clipping per decoder layer (sign-gradient descent), from a GPTQ or RTN start. GPTQ's
    fields (block_size, dampening_frac, actorder) and the scale observer apply to the start."""

    method: Literal["autoround"]  # type: ignore[assignment]
    init: Literal["gptq", "rtn"] = Field("gptq", description="what the learned rounding starts from")
    steps: int = Field(100, ge=1, le=100000, description="sign-gradient steps per decoder layer")
    lr: float | None = Field(None, gt=0, le=1, description="step size (None: 1 / steps), decayed linearly to 0")
    learn_clip: bool | None = Field(None, description="also learn a range factor per group (None: from an RTN "
                                                      "start only; GPTQ's error feedback is built on its scales)")
    clip_min: float = Field(0.7, gt=0, le=1, description="the smallest range factor learned")
    reference: Literal["float_model", "float_layer"] = Field(
        "float_model", description="what the layer's output is trained towards: the float MODEL's output at this "
        "layer (the float layer on the float model's activations, carried beside the quantized ones: each layer "
        "also corrects the drift of the quantized layers before it), or the float layer on the quantized model's "
        "activations (no second stream)")

    loss: Literal["mse", "token_relative"] = Field(
        "token_relative", description="the layer's output error: mse (every element alike), or token_relative (each token's "
        "squared error divided by its reference's mean square, as the next RMSNorm reads the residual stream: a "
        "massive-activation token, 98% of the squared norm from the demo model's layer 11 on, no longer decides "
        "every step; on the demo model 1.116 -> 1.111 perplexity ratio, README Accuracy)")

    @model_validator(mode="after")
    def _int_grid(self) -> "AutoRoundStage":
        w = SCHEMES[self.scheme].weights if self.scheme in SCHEMES else None
        if w is not None and w.type != "int":
            raise ValueError(f"scheme {self.scheme} has {w.type} weights; autoround learns rounding on an int "
                             "grid (W4A16, W4A16_ASYM, W8A8, W8A16, ...). Use gptq for FP8/FP4 schemes")
        return self

    @property
    def step_size(self) -> float:
        # every parameter moves by the step size each step, so 1 / steps bounds the total travel to 0.5 (half
        # a code); 2 / steps with learned ranges made the demo model's layer 0 error 12x worse in 5 steps
        return self.lr if self.lr is not None else 1.0 / self.steps

    @property
    def learns_ranges(self) -> bool:
        # from GPTQ's start, learning the ranges raised layer 0's chunk losses (30 steps, lr 0.005: 0.0125 -> 0.018)
        return self.learn_clip if self.learn_clip is not None else self.init == "rtn"


def needs(stage: AutoRoundStage) -> Literal["hessian", "nothing"]:
    """GPTQ's start needs its Hessian; RTN's start nothing (the output SQNR then comes from sample rows)."""
    return "hessian" if stage.init == "gptq" else "nothing"


def quantize(weights: list[torch.Tensor], obs: Observations, spec: WeightSpec, stage: AutoRoundStage,
             scale_dtype: torch.dtype) -> list[QuantizedWeight]:
    """The start of the learned rounding, in the group pass: GPTQ's or RTN's result."""
    if stage.init == "gptq":  # with the weight GPTQ rounded: the learned rounding starts from it
        return gptq.quantize(weights, obs, spec, stage, scale_dtype, keep_rounded=True)
    return rtn.quantize(weights, obs, spec, stage, scale_dtype)


# ------------------------------------------------------------------------------------- the learned grid
class _FakeQuant(torch.autograd.Function):
    """w = (clamp(round(base / s + V) + z, qmin, qmax) - z) * s with the rounding passed straight through, in a few
    whole-tensor passes instead of autograd's chain of a dozen ops (the learned grid's elementwise work was half
    of a bf16 step on AMX). Gradients, where `inside` marks the codes the clamp kept (its bounds included, as
    torch.clamp's backward): dw/dV = s inside, 0 outside; dw/ds = (q - z) - base / s inside, q - z outside
    (summed over the elements sharing a scale). z (the zero point) is a constant."""

    @staticmethod
    def forward(ctx, base, V, s, z, qmin, qmax, dtype):
        x = torch.div(base, s).add_(V).round_()
        if z is not None:
            x.add_(z)
        inside = (x >= qmin) & (x <= qmax)
        x.clamp_(qmin, qmax)
        if z is not None:
            x.sub_(z)  # x: q - z
        ctx.save_for_backward(base, s, inside, x if ctx.needs_input_grad[2] else None)
        return torch.mul(x, s, out=torch.empty(x.shape, dtype=dtype, device=x.device))

    @staticmethod
    def backward(ctx, gw):
        base, s, inside, qz = ctx.saved_tensors
        g = gw.float()
        gV = torch.mul(g, s).mul_(inside) if ctx.needs_input_grad[1] else None
        gs = None
        if ctx.needs_input_grad[2]:
            t = torch.div(base, s).mul_(inside)
            gs = torch.sub(qz, t, out=t).mul_(g)
            dims = [d for d in range(gs.dim()) if s.shape[d] == 1 and gs.shape[d] != 1]
            gs = gs.sum(dims, keepdim=True) if dims else gs
        return None, gV, gs, None, None, None, None


def _ste_cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x + (x.to(dtype).float() - x).detach()


class LearnedGrid(nn.Module):
    """One weight's learnable rounding (V) and range factors around a start (QuantizedWeight)."""

    def __init__(self, w_float: torch.Tensor, start: QuantizedWeight, spec: WeightSpec, init: str,
                 scale_dtype: torch.dtype):
        super().__init__()
        self.spec, self.scale_dtype = spec, scale_dtype
        # what is rounded: the float weight (RTN's start) or the weight GPTQ rounded (its columns as its error
        # feedback left them), so that with V = 0 the codes are the start's and their distances to the rounding
        # boundaries are spread, not all at 0.5
        base = start.rounded if start.rounded is not None else (w_float if init == "rtn" else start.weight)
        self.register_buffer("base", base.float().clone())
        self.register_buffer("cols", start.columns())
        self.g_idx = start.g_idx
        s = start.scale.float()
        if spec.symmetric:  # hi: the start's scale, shrunk by the range factor (its sign kept: full_range signed)
            hi, lo = s, None
        else:  # the range the start's grid covers
            hi, lo = (spec.qmax - start.zero_point) * s, (spec.qmin - start.zero_point) * s
        self.register_buffer("hi", hi)
        self.register_buffer("lo", lo)
        self.V = nn.Parameter(torch.zeros_like(self.base))
        self.a_hi = nn.Parameter(torch.ones_like(s))
        self.a_lo = nn.Parameter(torch.ones_like(s))

    def qparams(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Scale (and zero point) per group, derived from the shrunk range as the start's were."""
        spec = self.spec
        if spec.symmetric:  # any of the symmetric rules: the start's scale times the factor (the same as the
            # rule on the shrunk range, since every rule is linear in the range), its magnitude kept >= 1e-10
            scale = self.hi * self.a_hi
            return _ste_cast(torch.where(scale < 0, scale.clamp(max=-1e-10), scale.clamp(min=1e-10)),
                             self.scale_dtype), None
        hi, lo = self.hi * self.a_hi, self.lo * self.a_lo
        lo, hi = lo.clamp(max=0), hi.clamp(min=0)
        scale = _ste_cast(((hi - lo) / (spec.qmax - spec.qmin)).clamp(min=1e-10), self.scale_dtype)
        zp = torch.round(spec.qmin - lo / scale).clamp(spec.qmin, spec.qmax).detach()
        return scale, zp

    def forward(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dequantized weight [out, in] in `dtype`, differentiable in V and the range factors."""
        scale, zp = self.qparams()
        out_f, in_f = self.base.shape
        if self.g_idx is None:  # contiguous groups (or one per channel): broadcast, no [out, in] gather
            shape = (out_f, scale.shape[1], in_f // scale.shape[1])
            base, V = self.base.view(shape), self.V.view(shape)
            s, z = scale.unsqueeze(-1), (zp.unsqueeze(-1) if zp is not None else None)
        else:
            base, V = self.base, self.V
            s, z = scale[:, self.cols], (zp[:, self.cols] if zp is not None else None)
        return _FakeQuant.apply(base, V, s, z, self.spec.qmin, self.spec.qmax, dtype).reshape(out_f, in_f)

    def range_factors(self) -> list[nn.Parameter]:
        """The learned range factors: the max's, and the min's too with a zero point (symmetric: one)."""
        return [self.a_hi] if self.spec.symmetric else [self.a_hi, self.a_lo]

    @torch.no_grad()
    def clamp_(self, clip_min: float) -> None:
        self.V.clamp_(-0.5, 0.5)
        self.a_hi.clamp_(clip_min, 1.0)
        self.a_lo.clamp_(clip_min, 1.0)

    @torch.no_grad()
    def frozen(self, stats: dict) -> QuantizedWeight:
        scale, zp = self.qparams()
        return QuantizedWeight(self.forward().detach().clone(), scale.detach().clone(),
                               zp.clone() if zp is not None else None, self.g_idx, stats)


# ------------------------------------------------------------------------------------- the layer loop
@dataclass
class LayerProblem:
    """What refining one decoder layer needs: its learnable weights, how to run it, and the targets."""

    modules: list[nn.Linear]  # the Linears the stage owns in this layer (weights: the start's dequantized)
    floats: list[torch.Tensor]  # their float weights [out, in]
    starts: list[QuantizedWeight]  # the start (GPTQ's / RTN's result)
    spec: WeightSpec
    forward: Callable[[int], torch.Tensor]  # chunk index -> the layer's output on that chunk
    reference: list[torch.Tensor]  # the float layer's output per chunk
    chunks: list[int]  # this process's chunk indices, in order
    all_reduce: Callable[[list[torch.Tensor]], None] | None = None  # sums gradients across processes
    # the start's output per chunk where the caller has it (the group pass computed it): saves a pass
    start_outputs: list[torch.Tensor] | None = None
    # set by refine_layer: the output per chunk of what it returns (the start's or the learned weights')
    outputs: list[torch.Tensor] | None = None
    weights: list[torch.Tensor | None] | None = None  # set by refine_layer: each chunk's token weights (loss)


def refine_layer(p: LayerProblem, stage: AutoRoundStage, scale_dtype: torch.dtype) -> list[QuantizedWeight]:
    """Learn the layer's rounding and ranges; the frozen result, or the start where learning did not lower the
    error over every calibration chunk. Stats per weight: the layer's error before and after, steps, seconds."""
    t0 = time.perf_counter()
    start_out = p.start_outputs if p.start_outputs is not None else _outputs(p)  # module weights: the start's
    p.weights = _token_weights(p.reference, stage.loss)
    start_losses = _chunk_losses(p, start_out)
    start_err = _layer_error(p, start_losses)
    grids = [LearnedGrid(w, q, p.spec, stage.init, scale_dtype).to(w.device) for w, q in zip(p.floats, p.starts)]
    params = [g.V for g in grids] + ([t for g in grids for t in g.range_factors()] if stage.learns_ranges else [])
    with _learned(p.modules, grids):
        best = _descend(p, grids, params, stage, start_losses)
        with torch.no_grad():
            for prm, b in zip(params, best):
                prm.copy_(b)
        end_out = _outputs(p)
        end_err = _layer_error(p, _chunk_losses(p, end_out))
        learned = [g.frozen({}) for g in grids]
    kept = end_err >= start_err
    p.outputs = start_out if kept else end_out
    stats = {"autoround_error_start": start_err, "autoround_error": min(start_err, end_err),
             "autoround_steps": stage.steps, "autoround_kept_start": kept,
             "autoround_seconds": round(time.perf_counter() - t0, 3)}
    out = p.starts if kept else learned
    for q in out:
        q.stats = {**q.stats, **stats}
        q.rounded = None  # served its purpose: not kept with the layer's results
    return out


def _descend(p: LayerProblem, grids: list[LearnedGrid], params: list[nn.Parameter], stage: AutoRoundStage,
             start_losses: list[torch.Tensor]) -> list[torch.Tensor]:
    """Sign-gradient descent over the chunks in turn; returns the parameters whose chunk loss was the lowest
    fraction of the start's loss on the same chunk (chunks differ in how hard they are: by the raw loss, the
    easiest chunk's steps would always win and the last steps on the others never could)."""
    best_rel, best = float("inf"), [prm.detach().clone() for prm in params]
    for t in range(stage.steps):
        i = t % len(p.reference) if p.reference else None
        if i is None:  # a process with no chunk: it adds nothing to the sums
            loss, start, grads = torch.zeros(()), torch.zeros(()), [torch.zeros_like(prm) for prm in params]
        else:
            loss = _error(p.forward(i), p.reference[i], p.weights[i])
            grads = list(torch.autograd.grad(loss, params))
            loss, start = loss.detach(), start_losses[i].clone()  # the sum below is in place
        if p.all_reduce is not None:
            p.all_reduce([loss.reshape(1), start.reshape(1), *grads])
        rel = float(loss) / max(float(start), 1e-30)  # across processes: the ratio of the sums
        if t % 10 == 0:
            log.debug("autoround step %d: chunk loss %.6g (%.4f of the start's)", t, float(loss), rel)
        if rel < best_rel:  # the loss of the parameters before this step's update
            best_rel = rel
            best = [prm.detach().clone() for prm in params]
        lr = stage.step_size * (1.0 - t / stage.steps)
        with torch.no_grad():
            for prm, g in zip(params, grads):
                prm.sub_(g.sign(), alpha=lr)
        for g in grids:
            g.clamp_(stage.clip_min)
    return best


@torch.no_grad()
def _outputs(p: LayerProblem) -> list[torch.Tensor]:
    return [p.forward(i) for i in range(len(p.reference))]


@torch.no_grad()
def _chunk_losses(p: LayerProblem, outputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each chunk's error against its reference (as the descent's loss computes it)."""
    return [_error(y, ref, w) for y, ref, w in zip(outputs, p.reference, p.weights)]


def _token_weights(reference: list[torch.Tensor], loss: str) -> list[torch.Tensor | None]:
    """Per chunk, each token's weight in the error [..., tokens, 1]: None (mse), or 1 / the token's mean square."""
    if loss == "mse":
        return [None] * len(reference)
    return [ref.float().pow(2).mean(-1, keepdim=True).clamp(min=1e-12).reciprocal() for ref in reference]


def _error(y: torch.Tensor, ref: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    """The mean over the chunk's elements of the squared error, each token's weighted (one fused op for mse)."""
    if weight is None:
        return nn.functional.mse_loss(y.float(), ref.float())
    return (y.float() - ref.float()).pow(2).mul(weight).mean()


@torch.no_grad()
def _layer_error(p: LayerProblem, chunk_losses: list[torch.Tensor]) -> float:
    """The layer's error per element over every chunk (and process), from each chunk's (_chunk_losses)."""
    sse, n = torch.zeros(()), torch.zeros(())
    for loss, ref in zip(chunk_losses, p.reference):
        sse += loss.cpu() * ref.numel()
        n += ref.numel()
    acc = [sse.reshape(1).double(), n.reshape(1).double()]
    if p.all_reduce is not None:
        p.all_reduce(acc)
    return float(acc[0] / acc[1].clamp(min=1))


class _learned:
    """The modules compute with their learned grid's weight for the block (their stored weights untouched)."""

    def __init__(self, modules: list[nn.Linear], grids: list[LearnedGrid]):
        self.modules, self.grids = modules, grids

    def __enter__(self):
        for m, g in zip(self.modules, self.grids):
            m.forward = (lambda x, m=m, g=g: nn.functional.linear(x, g(x.dtype),
                                                                  m.bias.to(x.dtype) if m.bias is not None else None))
        return self

    def __exit__(self, *exc):
        for m in self.modules:
            del m.forward
        return False
