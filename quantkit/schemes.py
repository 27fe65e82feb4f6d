"""Quantization schemes: *what* to produce (bits, type, symmetry, granularity, activations).

A scheme is a frozen description; the algorithm (RTN, GPTQ, ...) decides *how* to round. Each preset
maps onto compressed-tensors `QuantizationArgs` so the export is the format vLLM loads natively.

Presets are registered explicitly by name with `register_scheme`; nothing is discovered.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal


Strategy = Literal["channel", "group"]


@dataclass(frozen=True)
class WeightSpec:
    num_bits: int
    type: Literal["int", "float"] = "int"
    symmetric: bool = True
    strategy: Strategy = "channel"
    group_size: int | None = None  # only for strategy == "group"
    # how group scales are stored: in the model's dtype; as fp8 e4m3 under one power-of-two global scale per
    # tensor (NVFP4); or as power-of-two exponents, E8M0 (MX formats). FP4 schemes fix their group size.
    scale_format: Literal["model", "fp8", "e8m0"] = "model"
    # integer codes kept within [-(code_limit + 1), code_limit] though stored (and declared) in num_bits: the
    # export is the ordinary format, the weights use a narrower range (W8A8_AVX2); None: the full range
    code_limit: int | None = None

    # compressed-tensors (and vLLM) keep integer codes in the signed range for both symmetric and
    # asymmetric schemes; an asymmetric zero point lives in the same range: w = (q - zp) * scale.
    @property
    def qmin(self) -> int:
        return -(self.code_limit + 1) if self.code_limit is not None else -(2 ** (self.num_bits - 1))

    @property
    def qmax(self) -> int:
        return self.code_limit if self.code_limit is not None else 2 ** (self.num_bits - 1) - 1

    @property
    def is_fp4(self) -> bool:
        """fp4 (e2m1) codes: a fixed grid of 15 values, not an integer range."""
        return self.type == "float" and self.num_bits == 4

    def stored_bytes(self, out_features: int, in_features: int, float_bytes: int) -> int:
        """Bytes one Linear weight takes in the export: packed codes, group (or channel) scales as this format
        stores them (the model's dtype, or one byte for fp8 / E8M0 scales, plus NVFP4's per-tensor global
        scale), and packed zero points for asymmetric schemes."""
        groups = in_features // self.group_size if self.strategy == "group" else 1
        scale_bytes = float_bytes if self.scale_format == "model" else 1
        b = out_features * in_features * self.num_bits / 8 + out_features * groups * scale_bytes
        if self.scale_format == "fp8":
            b += 4  # the fp32 global scale
        if not self.symmetric:
            b += out_features * groups * self.num_bits / 8
        return int(math.ceil(b))


@dataclass(frozen=True)
class ActivationSpec:
    """Dynamic per-token activation quantization (the only kind vLLM's CPU kernels run)."""

    num_bits: int = 8
    type: Literal["int", "float"] = "int"


@dataclass(frozen=True)
class QualityBar:
    """A scheme's default quality gates (quantkit/gates.py builds them; a recipe's own gates win per family).

    perplexity and weight memory are candidate / baseline ratios; top-1 agreement is absolute; task
    recovery is candidate / baseline accuracy, pooled (mean) and per task. The per-task floor sits below the
    pooled one because a suite scores ~50 items per task: one item is 2 points of accuracy there."""

    perplexity_ratio: float
    top1_agreement: float
    task_recovery: float
    task_recovery_each: float
    weight_memory_ratio: float


# 8-bit weights and activations; 8-bit weights only (and fp8); 4-bit weights (int4 or fp4). Wide for 4 bits
# because 4-bit weights cost tiny models far more than 7B+ ones; a production recipe for a large model should
# ask for perplexity <= 1.05. The memory ratios are loose because small models keep a large 16-bit embedding
# (SmolLM2-135M: W8A8 weights are 0.61 of bf16, W4A16 0.42); for 7B+ models tighten them (about 0.55 / 0.30).
BAR_8BIT_ACT = QualityBar(1.05, 0.90, 0.97, 0.90, 0.65)
BAR_8BIT_WEIGHT = QualityBar(1.03, 0.92, 0.98, 0.92, 0.65)
BAR_4BIT = QualityBar(1.35, 0.75, 0.90, 0.83, 0.45)


@dataclass(frozen=True)
class Scheme:
    name: str
    weights: WeightSpec
    activations: ActivationSpec | None
    format: str  # compressed-tensors format written on export
    description: str
    bar: QualityBar  # the default quality gates of an artifact in this scheme

    def with_overrides(self, group_size: int | None = None, symmetric: bool | None = None) -> "Scheme":
        w = self.weights
        if w.scale_format != "model" and (group_size not in (None, w.group_size) or symmetric is False):
            raise ValueError(f"{self.name} has a fixed format (symmetric, groups of {w.group_size}); remove the "
                             "stage's group_size / symmetric")
        if group_size is not None:
            w = replace(w, strategy="channel" if group_size == -1 else "group",
                        group_size=None if group_size == -1 else group_size)
        if symmetric is not None:
            w = replace(w, symmetric=symmetric)
        return replace(self, weights=w)

    def to_compressed_tensors(self, targets: list[str], actorder: str | None = None):
        """The compressed-tensors QuantizationScheme (imported here: recipe validation stays light)."""
        from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

        import torch

        w = self.weights
        extra = {}
        strategy = w.strategy
        if w.scale_format == "fp8":  # NVFP4: fp8 group scales under a per-tensor global scale
            strategy = "tensor_group"
            extra = {"scale_dtype": torch.float8_e4m3fn, "zp_dtype": torch.float8_e4m3fn}
        elif w.scale_format == "e8m0":  # MX: power-of-two group scales stored as biased exponents
            extra = {"scale_dtype": torch.uint8, "zp_dtype": torch.uint8}
        weight_args = QuantizationArgs(
            num_bits=w.num_bits,
            type=w.type,
            symmetric=w.symmetric,
            strategy=strategy,
            group_size=w.group_size,
            dynamic=False,
            actorder=actorder,
            **extra,
        )
        act_args = None
        if self.activations is not None:
            a = self.activations
            act_args = QuantizationArgs(num_bits=a.num_bits, type=a.type, symmetric=True,
                                        strategy="token", dynamic=True)
        return QuantizationScheme(targets=targets, weights=weight_args, input_activations=act_args,
                                  format=self.format)


SCHEMES: dict[str, Scheme] = {}


def register_scheme(scheme: Scheme) -> Scheme:
    if scheme.name in SCHEMES:
        raise ValueError(f"scheme {scheme.name!r} registered twice")
    SCHEMES[scheme.name] = scheme
    return scheme


register_scheme(Scheme(
    "W8A8", WeightSpec(8, "int", True, "channel"), ActivationSpec(8, "int"), "int-quantized",
    "int8 per-channel symmetric weights, dynamic per-token int8 activations", BAR_8BIT_ACT))
register_scheme(Scheme(
    "W4A16", WeightSpec(4, "int", True, "group", 128), None, "pack-quantized",
    "int4 weights, symmetric, groups of 128 (override group_size), 16-bit activations", BAR_4BIT))
register_scheme(Scheme(
    "W4A16_ASYM", WeightSpec(4, "int", False, "group", 128), None, "pack-quantized",
    "int4 weights with zero points, groups of 128 (override group_size), 16-bit activations", BAR_4BIT))
register_scheme(Scheme(
    "W8A16", WeightSpec(8, "int", True, "channel"), None, "pack-quantized",
    "int8 per-channel symmetric weights, 16-bit activations (vLLM's CPU backend has no kernel for it)", BAR_8BIT_WEIGHT))
register_scheme(Scheme(
    "FP8_DYNAMIC", WeightSpec(8, "float", True, "channel"), ActivationSpec(8, "float"), "float-quantized",
    "fp8 e4m3 per-channel weights, dynamic per-token fp8 activations", BAR_8BIT_WEIGHT))

register_scheme(Scheme(
    "NVFP4A16", WeightSpec(4, "float", True, "group", 16, scale_format="fp8"), None, "nvfp4-pack-quantized",
    "fp4 (e2m1) weights in groups of 16 with fp8 scales under a per-tensor global scale, 16-bit activations "
    "(NVIDIA Blackwell; no CPU kernel)", BAR_4BIT))
register_scheme(Scheme(
    "MXFP4A16", WeightSpec(4, "float", True, "group", 32, scale_format="e8m0"), None, "mxfp4-pack-quantized",
    "fp4 (e2m1) weights in groups of 32 with power-of-two (E8M0) scales, 16-bit activations (OCP MX; no CPU "
    "kernel)", BAR_4BIT))

# vLLM's int8 GEMM on a CPU without VNNI (oneDNN on AVX2) multiplies unsigned activation codes (0..255) by the
# signed weight codes and adds adjacent pairs in int16, which saturates when both products of a pair are large
# (quantkit.diagnostics.numerics.int8_gemm_int16_pairs): W8A8 lost 6.8% perplexity there against 3.4% in the
# reference. With |weight code| <= 64 a pair is at most 255 x 128 = 32640 < 32767: nothing saturates, for one
# bit less of weight precision. The export is plain W8A8 (int8 codes, per-channel scales), served everywhere.
register_scheme(Scheme(
    "W8A8_AVX2", WeightSpec(8, "int", True, "channel", code_limit=63), ActivationSpec(8, "int"), "int-quantized",
    "int8 per-channel symmetric weights using codes -64..63 (exact on CPUs without VNNI, whose int8 GEMM "
    "saturates int16 pair sums), dynamic per-token int8 activations", BAR_8BIT_ACT))


def get_scheme(name: str) -> Scheme:
    try:
        return SCHEMES[name]
    except KeyError:
        raise KeyError(f"{name!r} is not a known scheme (known: {', '.join(SCHEMES)})") from None
