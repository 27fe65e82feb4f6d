"""Quantization schemes: *what* to produce (bits, type, symmetry, granularity, activations).

A scheme is a frozen description; the algorithm (RTN, GPTQ, ...) decides *how* to round. Each preset
maps onto compressed-tensors `QuantizationArgs` so the export is the format vLLM loads natively.

Presets are registered explicitly by name with `register_scheme`; nothing is discovered.
"""

from __future__ import annotations

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

    # compressed-tensors (and vLLM) keep integer codes in the signed range for both symmetric and
    # asymmetric schemes; an asymmetric zero point lives in the same range: w = (q - zp) * scale.
    @property
    def qmin(self) -> int:
        return -(2 ** (self.num_bits - 1))

    @property
    def qmax(self) -> int:
        return 2 ** (self.num_bits - 1) - 1


@dataclass(frozen=True)
class ActivationSpec:
    """Dynamic per-token activation quantization (the only kind vLLM's CPU kernels run)."""

    num_bits: int = 8
    type: Literal["int", "float"] = "int"


@dataclass(frozen=True)
class Scheme:
    name: str
    weights: WeightSpec
    activations: ActivationSpec | None
    format: str  # compressed-tensors format written on export
    description: str

    def with_overrides(self, group_size: int | None = None, symmetric: bool | None = None) -> "Scheme":
        w = self.weights
        if group_size is not None:
            w = replace(w, strategy="channel" if group_size == -1 else "group",
                        group_size=None if group_size == -1 else group_size)
        if symmetric is not None:
            w = replace(w, symmetric=symmetric)
        return replace(self, weights=w)

    def to_compressed_tensors(self, targets: list[str], actorder: str | None = None):
        """The compressed-tensors QuantizationScheme (imported here: recipe validation stays light)."""
        from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

        w = self.weights
        weight_args = QuantizationArgs(
            num_bits=w.num_bits,
            type=w.type,
            symmetric=w.symmetric,
            strategy=w.strategy,
            group_size=w.group_size,
            dynamic=False,
            actorder=actorder,
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
    "int8 per-channel symmetric weights, dynamic per-token int8 activations"))
register_scheme(Scheme(
    "W4A16", WeightSpec(4, "int", True, "group", 128), None, "pack-quantized",
    "int4 weights, symmetric, groups of 128 (override group_size), 16-bit activations"))
register_scheme(Scheme(
    "W4A16_ASYM", WeightSpec(4, "int", False, "group", 128), None, "pack-quantized",
    "int4 weights with zero points, groups of 128 (override group_size), 16-bit activations"))
register_scheme(Scheme(
    "W8A16", WeightSpec(8, "int", True, "channel"), None, "pack-quantized",
    "int8 per-channel symmetric weights, 16-bit activations (vLLM's CPU backend has no kernel for it)"))
register_scheme(Scheme(
    "FP8_DYNAMIC", WeightSpec(8, "float", True, "channel"), ActivationSpec(8, "float"), "float-quantized",
    "fp8 e4m3 per-channel weights, dynamic per-token fp8 activations"))


def get_scheme(name: str) -> Scheme:
    try:
        return SCHEMES[name]
    except KeyError:
        raise KeyError(f"{name!r} is not a known scheme (known: {', '.join(SCHEMES)})") from None
