"""The recipe's stage configs share these bases; each method's own stage config lives beside its math
(quantkit/algorithms/<method>.py) and is registered in quantkit/algorithms/registry.py, from which the recipe
builds its `stages` schema."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from quantkit.algorithms.contract import ScaleSearch
from quantkit.schemes import SCHEMES
from quantkit.strict import Strict


class Targeted(Strict):
    targets: list[str] = Field(default_factory=lambda: ["Linear"],
                               description="module class names, or 're:<regex>' on module names")
    ignore: list[str] = Field(default_factory=lambda: ["lm_head"])

    @field_validator("targets")
    @classmethod
    def _some_targets(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("is empty, so the stage would quantize nothing; name module classes (e.g. [Linear]) "
                             "or 're:<regex>' patterns, or remove the stage")
        return v

    @field_validator("targets", "ignore")
    @classmethod
    def _patterns(cls, v: list[str]) -> list[str]:
        for p in v:
            if p.startswith("re:"):
                try:
                    re.compile(p[3:])
                except re.error as exc:
                    raise ValueError(f"{p!r} is not a valid regular expression ({exc})") from None
        return v

    def problems(self) -> list[tuple[str, str]]:
        """(field, problem) pairs that involve several fields; the recipe reports them as stages[i].<field>."""
        return []


class QuantizerStage(Targeted):
    """A stage that owns modules and says what to produce: a scheme, optionally overridden."""

    scheme: str
    group_size: int | None = Field(None, description="override the scheme's group size; -1 = per channel")
    symmetric: bool | None = None

    @field_validator("scheme")
    @classmethod
    def _known_scheme(cls, v: str) -> str:
        if v not in SCHEMES:
            raise ValueError(f"{v!r} is not a known scheme (known: {', '.join(SCHEMES)})")
        return v

    @field_validator("group_size")
    @classmethod
    def _group(cls, v: int | None) -> int | None:
        if v is not None and v != -1 and (v <= 0 or v % 2):
            raise ValueError(f"{v!r} is not a valid group size (use a positive even number, or -1 per channel)")
        return v

    @property
    def needs_calibration(self) -> bool:
        return False

    @property
    def is_transform(self) -> bool:
        return False


class ScaleSearchOptions(Strict):
    """The scale observer of a quantizer stage: min/max, or the MSE scale search (quantkit/algorithms/rtn.py
    ScaleSearch): each group's or channel's range shrunk by `mse_points` ratios from 1.0 down to
    `mse_min_ratio`, keeping the one with the lowest error (GPTQ weighs it by the input's diag(H))."""

    observer: Literal["minmax", "mse"] = "minmax"
    mse_min_ratio: float = Field(0.6, gt=0, lt=1, description="the smallest range ratio the MSE search tries")
    mse_points: int = Field(17, ge=2, le=200, description="ratios tried, evenly spaced from 1.0 to mse_min_ratio")
    full_range: bool | Literal["signed"] = Field(
        False, description="symmetric int grids: true: scale = max(max / qmax, min / qmin), using the grid's extra "
        "negative code (-8 at 4 bits) without clipping; signed: scale = e / qmin with e the group's larger-magnitude "
        "extreme, sign included (the scale is negative where the max is larger), so every group has all 2^bits codes "
        "at absmax / 2^(bits-1) and e lands on qmin exactly; off: absmax / qmax (the compressed-tensors observers' "
        "rule). The export format is unchanged (signed: negative scales, which w = q x scale serves as any scale)")

    def scale_search(self, column_weight=None):
        """The ScaleSearch this stage asks for (None: min/max over absmax)."""
        if self.observer != "mse":
            return ScaleSearch((1.0,), None, self.full_range) if self.full_range else None
        return ScaleSearch.grid(self.mse_min_ratio, self.mse_points, column_weight, self.full_range)


class RewritesWeights(Strict):
    """A stage that rewrites float weights without changing the float model's output and produces no scheme
    (and no config group) of its own; quantizer stages must follow it (the recipe checks)."""

    @property
    def needs_calibration(self) -> bool:
        return True

    @property
    def is_transform(self) -> bool:
        return True

    @property
    def scheme(self) -> None:
        return None


class TransformStage(Targeted, RewritesWeights):
    """A transform rescales weights and activations without changing the float model's output; the
    quantizer stages after it then quantize the transformed layers. It applies to every smoothing
    mapping of the architecture whose target Linears all match `targets` (and not `ignore`) and are
    quantized by a later stage; it optimizes for the scheme of the stage that quantizes them."""
