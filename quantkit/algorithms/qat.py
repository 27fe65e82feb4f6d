"""Quantization-aware training math: fake quantization with straight-through gradients. Pure tensor math.

Method: the forward pass uses exactly the weights the export will hold, w_hat = (clamp(round(w/s) + z,
qmin, qmax) - z) * s per group, with s rounded to its storage dtype (bf16), and for W8A8 the engine's
dynamic per-token int8 activations. round() has no useful gradient, so the backward pass uses the
straight-through estimator (Bengio et al. 2013) with clipping: dw_hat/dw = 1 where the code was not
clamped (qmin <= w/s + z <= qmax) and 0 where it was. Learned scales use the LSQ gradient (Esser et al.
2019): dw_hat/ds = round(v) - v inside the range (v = w/s + z), qmin - z below it, qmax - z above it, summed over
the scale's group. Activations are quantized per token with their own absmax, which clips nothing, so
their straight-through gradient is the identity (the gradient through the absmax itself is ignored).

The trainable "latent" weight starts at the post-training result (RTN or GPTQ), nudged towards the
float weight by less than half a step (`latent_init`): the starting codes are exactly the PTQ codes,
and the fractional position tells training which neighbour code the float weight was closer to.

Trade-offs: the STE is biased (it pretends rounding is the identity), which is why QAT needs a low
learning rate and starts from a good PTQ point; learned scales recover more but can drift, so they are
kept positive and bf16-exact in every forward pass. LSQ's gradient scale 1/sqrt(n * qmax) is left out:
AdamW normalizes each parameter's step, which makes a constant gradient factor irrelevant.
Left out: learned zero points, learned rounding (AdaRound), fp8 weights, mixed-precision search.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from quantkit.algorithms.rtn import fake_quantize_activations
from quantkit.schemes import SCHEMES, ActivationSpec, WeightSpec
from quantkit.algorithms.base import QuantizerStage

LATENT_MARGIN = 0.45  # the latent weight stays within +-0.45 of a step of its PTQ code


class _FakeQuantSTE(torch.autograd.Function):
    """w_hat = (clamp(round(w/s) + z, qmin, qmax) - z) * s with STE / LSQ gradients (all [out, in])."""

    @staticmethod
    def forward(ctx, w, s, z, qmin: int, qmax: int, need_scale_grad: bool):
        v = w / s if z is None else w / s + z  # the unrounded code position
        q = torch.round(v).clamp(qmin, qmax)
        zz = 0.0 if z is None else z
        deq = (q - zz) * s
        below, above = v < qmin, v > qmax
        ctx.save_for_backward(below, above, v if need_scale_grad else None, z)
        ctx.qrange = (qmin, qmax)
        ctx.need_scale_grad = need_scale_grad
        return deq

    @staticmethod
    def backward(ctx, grad):
        below, above, v, z = ctx.saved_tensors
        qmin, qmax = ctx.qrange
        inside = ~(below | above)
        grad_w = grad * inside  # straight through inside the clamp range, zero outside
        grad_s = None
        if ctx.need_scale_grad:
            zz = 0.0 if z is None else z
            ds = torch.where(below, qmin - zz, torch.where(above, qmax - zz, torch.round(v) - v))
            grad_s = grad * ds  # per element; autograd sums it into each group's scale
        return grad_w, grad_s, None, None, None, None


class _GroupFakeQuantSTE(torch.autograd.Function):
    """The same fake quantization for contiguous groups, on a [out, n_groups, g] view of the weight: the
    scale broadcasts over its group instead of being expanded to [out, in] by indexing, and its LSQ
    gradient is a sum over the group's last dimension instead of a scatter. Only w, s and z are kept for
    the backward pass, which recomputes the code positions (one division) instead of storing masks."""

    @staticmethod
    def forward(ctx, w, s, z, qmin: int, qmax: int, need_scale_grad: bool):
        out_f, n_groups = s.shape
        wv = w.view(out_f, n_groups, -1)  # [out, n_groups, g]
        sv, zv = s.unsqueeze(-1), (z.unsqueeze(-1) if z is not None else None)  # [out, n_groups, 1]
        v = wv / sv if zv is None else wv / sv + zv
        q = torch.round(v).clamp_(qmin, qmax)
        if zv is not None:
            q.sub_(zv)
        ctx.save_for_backward(w, s, z)
        ctx.qrange, ctx.need_scale_grad = (qmin, qmax), need_scale_grad
        return q.mul_(sv).view_as(w)

    @staticmethod
    def backward(ctx, grad):
        w, s, z = ctx.saved_tensors
        qmin, qmax = ctx.qrange
        out_f, n_groups = s.shape
        sv, zv = s.unsqueeze(-1), (z.unsqueeze(-1) if z is not None else None)
        v = w.view(out_f, n_groups, -1) / sv
        if zv is not None:
            v = v + zv
        g3 = grad.reshape(out_f, n_groups, -1)
        below, above = v < qmin, v > qmax
        grad_w = g3.masked_fill(below | above, 0.0).view_as(w)  # straight through inside the clamp range
        grad_s = None
        if ctx.need_scale_grad:
            zz = 0.0 if zv is None else zv
            ds = torch.where(below, qmin - zz, torch.where(above, qmax - zz, torch.round(v) - v))
            grad_s = (g3 * ds).sum(-1)  # [out, n_groups]
        return grad_w, grad_s, None, None, None, None


def fake_quant_weight_ste(w: torch.Tensor, s: torch.Tensor, z: torch.Tensor | None, spec: WeightSpec,
                          learn_scale: bool = False) -> torch.Tensor:
    """Fake-quantize a [out, in] weight with per-element (already expanded) scale / zero point."""
    if spec.type != "int":
        raise ValueError(f"QAT fake quantization supports integer weights only, not {spec.type!r}")
    return _FakeQuantSTE.apply(w, s, z, spec.qmin, spec.qmax, learn_scale)


def fake_quant_activations_ste(x: torch.Tensor, spec: ActivationSpec) -> torch.Tensor:
    """Per-token dynamic fake quantization (what the engine does) with an identity gradient."""
    return x + (fake_quantize_activations(x, spec) - x).detach()


def storage_round_ste(s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round a scale to its storage dtype in the forward pass, identity gradient (the export is exact)."""
    return s + (s.to(dtype).float() - s).detach()


def latent_init(w_float: torch.Tensor, deq: torch.Tensor, s_cols: torch.Tensor,
                margin: float = LATENT_MARGIN) -> torch.Tensor:
    """The PTQ point plus the float weight's offset, clipped to +-margin steps (codes unchanged)."""
    step = margin * s_cols
    return deq + torch.maximum(torch.minimum(w_float - deq, step), -step)


@dataclass(frozen=True)
class QATFormat:
    """How a QATLinear fake-quantizes: its weight (and activation) format, whether it learns its scales, and
    the dtype the scales are stored in."""

    spec: WeightSpec
    act: ActivationSpec | None = None
    learn_scale: bool = True
    scale_dtype: torch.dtype = torch.bfloat16


class QATLinear(nn.Module):
    """A Linear whose forward uses fake-quantized weights (and activations), trained through the STE.

    weight: the latent float weight [out, in]; weight_scale: [out, n_groups] (a Parameter when learned);
    weight_zero_point: [out, n_groups] integer-valued (asymmetric only); g_idx: [in] column -> group.
    The parameter names match nn.Linear's (`weight`, `bias`), so state-dict keys keep the model's names.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, scale: torch.Tensor,
                 zero_point: torch.Tensor | None, g_idx: torch.Tensor, fmt: QATFormat):
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        spec, learn_scale = fmt.spec, fmt.learn_scale
        self.spec, self.act, self.learn_scale, self.scale_dtype = spec, fmt.act, learn_scale, fmt.scale_dtype
        self.weight = nn.Parameter(weight.detach().float().clone())
        self.bias = nn.Parameter(bias.detach().float().clone(), requires_grad=False) if bias is not None else None
        if learn_scale:
            self.weight_scale = nn.Parameter(scale.detach().float().clone())
        else:
            self.register_buffer("weight_scale", scale.detach().float().clone())
        self.register_buffer("weight_zero_point",
                             zero_point.detach().float().clone() if zero_point is not None else None)
        self.register_buffer("g_idx", g_idx.detach().long().clone())
        n_groups = scale.shape[1]
        self._contiguous = (spec.type == "int" and self.in_features % n_groups == 0 and torch.equal(
            self.g_idx.cpu(), torch.arange(self.in_features) // (self.in_features // n_groups)))
        # the float Linear this module replaces, kept as stored (exact in its checkpoint dtype), for the
        # teacher's forward through the same module tree; not part of the state dict
        self.register_buffer("teacher_weight", None, persistent=False)
        self.register_buffer("teacher_bias", None, persistent=False)
        self.as_teacher = False
        # within one optimizer step the latent weight does not change: its fake-quantized value is made once
        # (`begin_step`) and shared by every micro-batch as a leaf; `end_step` sends the gradient they
        # accumulated on it back through the fake quantization once
        self._step_graph: torch.Tensor | None = None
        self._step_leaf: torch.Tensor | None = None

    def keep_float(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        """Keep the original float weight (and bias) so this module can compute as the float model did."""
        self.teacher_weight = weight.detach().to(dtype).clone()
        self.teacher_bias = bias.detach().to(dtype).clone() if bias is not None else None

    def scales(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-column scale and zero point, [out, in]: positive, storage-exact scales."""
        s = storage_round_ste(self.weight_scale.clamp(min=1e-8), self.scale_dtype)  # [out, n_groups]
        s_cols = s[:, self.g_idx]  # [out, n_groups] -> [out, in]
        z_cols = self.weight_zero_point[:, self.g_idx] if self.weight_zero_point is not None else None
        return s_cols, z_cols

    def quantized_weight(self) -> torch.Tensor:
        if self._contiguous:  # groups of equal size in column order: the grouped view, no [out, in] scales
            s = storage_round_ste(self.weight_scale.clamp(min=1e-8), self.scale_dtype)  # [out, n_groups]
            return _GroupFakeQuantSTE.apply(self.weight, s, self.weight_zero_point, self.spec.qmin, self.spec.qmax,
                                            self.learn_scale)
        s_cols, z_cols = self.scales()
        return fake_quant_weight_ste(self.weight, s_cols, z_cols, self.spec, self.learn_scale)

    def begin_step(self) -> None:
        self._step_graph = self.quantized_weight()
        self._step_leaf = self._step_graph.detach().requires_grad_()

    def end_step(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(fake-quantized weight with its graph, the gradient the step's micro-batches put on it), or None
        when no gradient reached it; the step's weight is dropped either way."""
        out = (self._step_graph, self._step_leaf.grad) if self._step_leaf is not None and self._step_leaf.grad is not None else None
        self._step_graph = self._step_leaf = None
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.as_teacher:  # the float model's Linear: no fake quantization, the original weight
            b = self.teacher_bias.to(x.dtype) if self.teacher_bias is not None else None
            return F.linear(x, self.teacher_weight.to(x.dtype), b)
        if self.act is not None:
            x = fake_quant_activations_ste(x, self.act)
        w = self._step_leaf if self._step_leaf is not None and self.training else self.quantized_weight()
        return F.linear(x, w.to(x.dtype), self.bias)

    @torch.no_grad()
    def export(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(dequantized weight [out, in], storage-exact scale [out, n_groups], zero point) as exported."""
        scale = self.weight_scale.clamp(min=1e-8).to(self.scale_dtype).float()
        return self.quantized_weight().detach().clone(), scale, \
            self.weight_zero_point.clone() if self.weight_zero_point is not None else None


# ------------------------------------------------------------------------------------ the stage config
class EarlyStop(BaseModel):
    """Stop when the held-out loss has not improved by more than `min_delta` for `patience` evaluations. The
    export holds the weights of the lowest held-out loss seen, whether or not training stopped early."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    patience: int = Field(3, ge=1, description="evaluations (every eval_every steps) without an improvement "
                                               "before training stops")
    min_delta: float = Field(0.0, ge=0, description="the least fall of the held-out loss that counts as an "
                                                    "improvement (KL for loss kd, next-token loss for ce)")


class QATStage(QuantizerStage):
    """Quantization-aware training (fake quantization + straight-through estimator), see quantkit/quantize/finetune.py.

    Must be the last stage. It fine-tunes every module the stages before it quantized (keeping their
    schemes, starting from their result); modules only it targets start from round-to-nearest.
    """

    method: Literal["qat"]
    steps: int = Field(200, ge=1, description="optimizer steps")
    lr: float = Field(5e-5, gt=0, lt=1, description="peak AdamW learning rate (cosine schedule after warmup)")
    warmup_steps: int = Field(10, ge=0, description="linear warmup steps")
    batch_size: int = Field(4, ge=1, description="sequences per micro-batch")
    seq_len: int = Field(512, ge=8, description="tokens per training sequence")
    grad_accum: int = Field(1, ge=1, description="micro-batches per optimizer step")
    loss: Literal["kd", "ce"] = Field("kd", description="kd: KL to the float model's logits; ce: next-token loss")
    scales: Literal["fixed", "learned"] = Field("learned", description="keep the PTQ scales or learn them (LSQ)")
    eval_every: int = Field(25, ge=1, description="held-out loss every N steps; the export keeps the weights "
                                                "of the evaluation with the lowest held-out loss")
    early_stop: EarlyStop | None = Field(None, description="stop when the held-out loss stops improving "
                                                           "(absent: train all steps)")
    teacher_topk: int = Field(64, ge=0, description="kd against the float model's k most likely next tokens plus "
                                                    "one bucket for the rest of the vocabulary, computed once per "
                                                    "training window and cached; 0 = the full distribution, "
                                                    "recomputed at every step")
    eval_samples: int = Field(8, ge=1, description="held-out sequences scored at each evaluation")
    checkpoint_every: int = Field(25, ge=1, description="resume point every N steps")
    seed: int = 0
    holdout_fraction: float = Field(0.1, gt=0, lt=1, description="share of the training windows held out")
    gradient_checkpointing: bool = Field(False, description="recompute activations in the backward pass: less "
                                         "memory, one more forward per step (for models whose activations do not fit)")
    compute_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="the student's and teacher's forward under autocast: auto = bfloat16 where the hardware "
                            "computes it natively (CUDA, AMX / AVX512-BF16 CPUs), else float32. Master weights, "
                            "AdamW state, the fake quantization, the loss and the held-out evaluation stay fp32")

    @field_validator("scheme")
    @classmethod
    def _int_weights(cls, v: str) -> str:
        if SCHEMES[v].weights.type != "int":
            ints = ", ".join(n for n, s in SCHEMES.items() if s.weights.type == "int")
            raise ValueError(f"{v!r} is not an integer weight scheme, which qat needs (use one of {ints})")
        return v

    @property
    def needs_calibration(self) -> bool:
        return True  # the training text comes from the calibration sources

    def problems(self) -> list[tuple[str, str]]:
        if self.warmup_steps >= self.steps:
            return [("warmup_steps", f"{self.warmup_steps} must be below steps ({self.steps})")]
        return []
