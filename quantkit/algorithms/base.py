"""The recipe's stage configs share these bases; each method's own stage config lives beside its math
(quantkit/algorithms/<method>.py) and is registered in quantkit/algorithms/registry.py, from which the recipe
builds its `stages` schema."""

from __future__ import annotations

import re

from pydantic import Field, field_validator

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


class TransformStage(Targeted):
    """A transform rescales weights and activations without changing the float model's output; the
    quantizer stages after it then quantize the transformed layers. It applies to every smoothing
    mapping of the architecture whose target Linears all match `targets` (and not `ignore`) and are
    quantized by a later stage; it optimizes for the scheme of the stage that quantizes them."""

    @property
    def needs_calibration(self) -> bool:
        return True

    @property
    def is_transform(self) -> bool:
        return True

    @property
    def scheme(self) -> None:  # a transform produces no scheme (and no config group) of its own
        return None
