"""What sensitivity measures: units (the modules one engine kernel fuses), their sizes at either scheme, and
the proxy error that normalises their measured squared error."""

from __future__ import annotations

from dataclasses import dataclass

from quantkit.plan import Plan, Target
from quantkit.schemes import Scheme, WeightSpec


@dataclass
class Unit:
    """Modules that share a scheme in the engine (one fused kernel), measured together."""

    name: str  # "3.self_attn.q_proj+k_proj+v_proj"
    layer: int
    modules: list[str]  # full module names
    params: int
    bytes_low: int
    bytes_high: int
    # |y_q - y|^2 this unit alone adds to its layer's output over every calibration token, at the low and the
    # high scheme (0: it stays float), and the layer output's energy |y|^2
    sq_low: float = float("nan")
    sq_high: float = 0.0
    layer_energy: float = float("nan")
    # the proxy (PROXIES): sq_* normalised by the layer's own energy or by the last layer's
    error_low: float = float("nan")
    error_high: float = 0.0
    kl_low: float | None = None  # full-model KL with only this unit at the low scheme (validated units)

    @property
    def bytes_added(self) -> int:
        return self.bytes_high - self.bytes_low

    @property
    def saving(self) -> float:
        """Error removed per byte added by keeping this unit at the high scheme."""
        return (self.error_low - self.error_high) / max(self.bytes_added, 1)


def weight_bytes(spec: WeightSpec | None, out_features: int, in_features: int, float_bytes: int) -> int:
    """Bytes one Linear weight takes in the export (the scheme's own rule, WeightSpec.stored_bytes); `spec`
    None: the float weight as it is."""
    if spec is None:
        return out_features * in_features * float_bytes
    return spec.stored_bytes(out_features, in_features, float_bytes)


def _unit_name(members: list[Target], prefix: str, layer: int) -> str:
    locals_ = [t.name[len(prefix):] for t in members]
    head, _, _ = locals_[0].rpartition(".")
    tails = [loc.rpartition(".")[2] if loc.rpartition(".")[0] == head else loc for loc in locals_]
    return f"{layer}.{head + '.' if head else ''}{'+'.join(tails)}"


def plan_units(plan: Plan, shapes: dict[str, tuple[int, int]], high: Scheme | None, float_bytes: int) -> list[Unit]:
    """One unit per sequential group of every layer, with its sizes at the low and the high scheme."""
    units = []
    for lp in plan.layers:
        for members in lp.groups:
            low = sum(weight_bytes(t.scheme.weights, *shapes[t.name], float_bytes) for t in members)
            hi = sum(weight_bytes(high.weights if high else None, *shapes[t.name], float_bytes) for t in members)
            units.append(Unit(_unit_name(members, lp.prefix, lp.index), lp.index, [t.name for t in members],
                              sum(a * b for a, b in (shapes[t.name] for t in members)), low, hi))
    return units


PROXIES = {
    "layer": "the error relative to the unit's own layer output (how much of that layer's work it damages)",
    "stream": "the error relative to the last layer's output (the residual stream the error ends up in)",
}


def use_proxy(units: list[Unit], proxy: str, final_energy: float) -> None:
    """Set every unit's error_low / error_high from its squared errors under `proxy` (PROXIES)."""
    for u in units:
        norm = u.layer_energy if proxy == "layer" else final_energy
        u.error_low, u.error_high = u.sq_low / norm, u.sq_high / norm
