"""The method contract: what the pipeline hands a method, and what a method hands back. Typed, so results
pass between stages as dataclasses, never as dicts of dicts or tuples.

A quantizer turns `(weights of one sequential group owned by one stage, Observations, WeightSpec, stage
config, scale dtype)` into one `QuantizedWeight` per module. It declares what it needs in its registry
entry (quantkit/algorithms/registry.py): a Hessian of the group's inputs, or nothing.

A transform turns the captured statistics of one smoothing mapping (`ChannelStats`) and the Linears it
feeds (`MappingTargets`) into `TransformScales`; the pipeline folds them into the preceding op, which leaves the float
output unchanged. It may also refine the scaled weights after the fold (AWQ's clipping search).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from quantkit.schemes import ActivationSpec, WeightSpec


@dataclass
class Observations:
    """What a sequential group's calibration inputs taught, gathered chunk by chunk."""

    hessian: torch.Tensor | None = None  # [in, in] fp32, over every calibration token (quantizers that need it)
    sample: torch.Tensor | None = None  # [<= SQNR_TOKENS, in] the first calibration rows (diagnostics only)
    # a member's output energy tr(W H W^T) (the output SQNR's signal), where it was measured from the inputs
    # themselves during the forward (quantkit/quantize/layers.py: GroupInputs); by the module's name
    signals: dict[str, float] = field(default_factory=dict)
    # the quantizer may overwrite `hessian` (GPTQ makes its factor in H's buffer): set by the pipeline only where
    # nothing reads H after the solve
    consumable: bool = False


@dataclass
class QuantizedWeight:
    """One Linear's quantization: the dequantized weight the model now computes with, and its parameters."""

    weight: torch.Tensor  # [out, in] fp32, exactly what the export decompresses to
    scale: torch.Tensor  # [out, n_groups], values exactly representable in the storage dtype
    zero_point: torch.Tensor | None = None  # [out, n_groups] integer-valued, asymmetric schemes only
    g_idx: torch.Tensor | None = None  # [in] column -> group, only when the export must carry it
    stats: dict = field(default_factory=dict)  # method diagnostics for the manifest (gptq_loss, damping)
    # NVFP4: the per-tensor global scale (a power of two); `scale` is then the effective group scale,
    # scale * global_scale being the fp8 value the export stores
    global_scale: torch.Tensor | None = None
    # what was rounded to the codes, when it is not the original weight: GPTQ's error-compensated weight
    # [out, in] fp32 (a learned rounding starts from it; it is not exported, and freed with the layer)
    rounded: torch.Tensor | None = None
    # tr((W - Q) H (W - Q)^T) over the calibration tokens' Hessian H, where the quantizer knows it without H
    # (GPTQ: from its own losses); the pipeline's output SQNR then needs H only before the solve
    output_noise: float | None = None

    def columns(self) -> torch.Tensor:
        """[in] column -> group: g_idx when there is one, else contiguous groups of equal size."""
        if self.g_idx is not None:
            return self.g_idx.long()
        in_features, n_groups = self.weight.shape[1], self.scale.shape[1]
        return torch.arange(in_features, device=self.scale.device) // (in_features // n_groups)


@dataclass(frozen=True)
class ScaleSearch:
    """MSE scale search: try each group's (or channel's) range shrunk by every ratio in `ratios` and keep, per
    group, the one whose quantization error is lowest. The error is the weight's squared error, each input
    column weighted by `column_weight` when given (GPTQ passes diag(H): the output error's diagonal part).
    The ratio 1.0 (min/max) is always tried, so the search never ends with a larger error than min/max.
    `full_range` (symmetric int grids): True: each range's scale is max(max / qmax, min / qmin) instead of
    absmax / qmax, so the grid's extra negative code (-8 at 4 bits) is used without clipping anything;
    "signed": scale = e / qmin, e the larger-magnitude end with its sign (rtn._minmax_qparams); with
    `ratios` (1.0,) that is the whole of it (no search)."""

    ratios: tuple[float, ...]
    column_weight: torch.Tensor | None = None  # [in] >= 0
    full_range: bool | str = False

    @staticmethod
    def grid(min_ratio: float, points: int, column_weight: torch.Tensor | None = None,
             full_range: bool | str = False) -> "ScaleSearch":
        """`points` ratios evenly spaced from 1.0 down to `min_ratio`."""
        step = (1.0 - min_ratio) / max(points - 1, 1)
        return ScaleSearch(tuple(1.0 - i * step for i in range(points)), column_weight, full_range)


@dataclass
class ChannelStats:
    """A smoothing mapping's inputs over the calibration batch."""

    sample: torch.Tensor  # [<= max_tokens, in] evenly spaced tokens
    abs_mean: torch.Tensor  # [in] mean |x| over every token
    abs_max: torch.Tensor  # [in] max |x| over every token


@dataclass
class MappingTargets:
    """The Linears one smoothing mapping feeds, as a transform sees them."""

    weights: list[torch.Tensor]  # [out_i, in] fp32, in the order of the architecture spec
    specs: list[WeightSpec]
    acts: list[ActivationSpec | None]  # the engine's activation quantization of each (None: weight-only)
    idx: torch.Tensor  # [in] target column -> channel of the preceding op (smoothing.channel_index)
    channels: int  # of the preceding op's output


@dataclass
class TransformScales:
    scales: torch.Tensor  # [channels] of the preceding op's output
    applied: bool  # False: the method kept s = 1 (nothing is folded)
    error_before: float  # the method's block error with s = 1
    error_after: float  # ... with the chosen scales
    stats: dict = field(default_factory=dict)  # method diagnostics (alpha, ...)


@dataclass
class ModuleResult:
    """What the pipeline keeps of one quantized module: its typed quantization, the scheme it follows and
    the manifest's stats. Float tensors a transform rewrote on the way (a folded norm weight, a bias), and
    the layer's calibrated KV-cache scales (`self_attn.k_scale` / `v_scale`, quantkit/quantize/kvcache.py),
    travel with it in `rewritten`, under their checkpoint names. Compression into the export's format
    happens once, at export (quantkit/export/artifact.py)."""

    name: str
    stats: dict
    weight: QuantizedWeight | None  # None once `typed` holds it (quantkit/quantize/workdir.py: compact)
    spec: WeightSpec
    rewritten: dict[str, torch.Tensor] = field(default_factory=dict)
    # the weight in the work folder's typed form (codes, scale, ...: 1 byte per weight instead of 4), made as
    # soon as nothing in the layer reads the dequantized weight again
    typed: Mapping[str, torch.Tensor] | None = None
