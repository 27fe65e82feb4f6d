"""What an export actually holds, checked against what its recipe meant: the artifact family of gates.

`export_coverage(artifact, manifest)` recomputes the plan (the recipe stored in the manifest on the base
model's architecture, built on the meta device: no weight is read) and compares it with the export's own
tensors, read from the safetensors files:
- coverage: the share of the planned modules that the export stores quantized (a `<module>.weight_scale`
  tensor: every compressed-tensors weight format writes one); the missing ones are named;
- nonfinite_tensors: scale, global-scale and zero-point tensors (weights' and the k/v cache's) holding a NaN or
  an infinity (for E8M0 exponent scales, the NaN code 255);
- experts_unrecorded: MoE expert Linears whose calibration (routed tokens, or the recipe's fallback) the
  manifest does not record.
Anything that cannot be checked (the base model is gone, the recipe no longer validates) leaves the figure
out and says why under "error": the gates then find the metric missing and fail.
"""

from __future__ import annotations

import re
from pathlib import Path

_EXPERT = re.compile(r"\.experts\.\d+\.")
_SCALE_SUFFIXES = ("_scale", "_zero_point")


def planned_modules(manifest: dict) -> list[str]:
    """The module names the manifest's recipe quantizes on the base model's architecture."""
    from quantkit.model.arch import arch_for
    from quantkit.model.checkpoint import build_skeleton
    from quantkit.plan import make_plan
    from quantkit.recipe import Recipe

    recipe = Recipe.model_validate(manifest["recipe"])
    base = Path(manifest["base_model"]["resolved_dir"])
    model = build_skeleton(base, recipe.model.dtype, recipe.model.trust_remote_code)
    return sorted(make_plan(model, arch_for(model.config), recipe).targets)


def _nonfinite(name: str, tensor) -> bool:
    import torch

    if tensor.dtype == torch.uint8 and name.endswith("_scale"):  # E8M0 exponents: 255 is NaN
        return bool((tensor == 255).any())
    if tensor.dtype.is_floating_point:
        return not bool(torch.isfinite(tensor.float()).all())
    return False


def stored_tensors(artifact: Path) -> tuple[set[str], list[str]]:
    """(modules stored quantized, scale/zero-point tensors that are not finite) of an export folder."""
    from safetensors import safe_open

    quantized, bad = set(), []
    for f in sorted(Path(artifact).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for key in h.keys():
                if key.endswith(".weight_scale"):
                    quantized.add(key[: -len(".weight_scale")])
                if key.endswith(_SCALE_SUFFIXES) and _nonfinite(key, h.get_tensor(key)):
                    bad.append(key)
    return quantized, bad


def export_coverage(artifact: Path, manifest: dict, show: int = 20) -> dict:
    out: dict = {}
    try:
        planned = planned_modules(manifest)
    except Exception as exc:  # noqa: BLE001 - any reason the plan cannot be rebuilt leaves coverage unmeasured
        out["error"] = f"the plan could not be rebuilt from the manifest: {type(exc).__name__}: {str(exc)[:300]}"
        planned = None
    quantized, bad = stored_tensors(artifact)
    if planned is not None:
        missing = [m for m in planned if m not in quantized]
        out.update(planned=len(planned), quantized=len(planned) - len(missing),
                   coverage=(len(planned) - len(missing)) / len(planned) if planned else None, missing=missing[:show])
    out.update(nonfinite_tensors=len(bad), nonfinite=bad[:show])
    layers = manifest.get("layers") or {}
    unrecorded = [n for n, st in layers.items() if _EXPERT.search(n) and not (st or {}).get("expert_calibration")]
    out.update(experts_unrecorded=len(unrecorded), experts_unrecorded_names=unrecorded[:show])
    return out

