"""The recipe sensitivity starts from (one quantizer stage, calibration, a higher scheme to keep units at) and
the mixed-precision recipe it writes."""

from __future__ import annotations

import json

from quantkit.algorithms.registry import method_of
from quantkit.plan import exact_targets
from quantkit.recipe import Recipe, RecipeError, parse_recipe
from quantkit.schemes import Scheme, get_scheme
from quantkit.tune.sensitivity.units import Unit

HIGH_NONE = "none"  # keep the unit in the model's dtype


def check_recipe(recipe: Recipe, high: str) -> Scheme | None:
    """The recipe sensitivity can work from (one quantizer stage, no transform or QAT) and the high scheme."""
    bad = [f"stages[{i}] ({st.method})" for i, st in enumerate(recipe.stages) if method_of(st).role != "quantizer"]
    quant = [i for i, st in enumerate(recipe.stages) if method_of(st).role == "quantizer"]
    if bad or len(quant) != 1:
        raise RecipeError(f"recipe {recipe.name!r}: sensitivity starts from a recipe with exactly one quantizer stage "
                          f"(rtn or gptq) and no transform or qat stage; found {', '.join(bad) or f'{len(quant)} quantizer stages'}. "
                          "Use the uniform low-bit recipe (for example recipes/smollm2-w4a16-gptq.yaml)")
    if recipe.calibration is None:
        raise RecipeError(f"recipe {recipe.name!r}: sensitivity measures each module's effect on its layer's output "
                          "over calibration data; add a `calibration:` section")
    if high == HIGH_NONE:
        return None
    scheme = get_scheme(high)
    low = get_scheme(recipe.stages[quant[0]].scheme)
    if scheme.weights.num_bits <= low.weights.num_bits and scheme.weights.type == low.weights.type:
        raise RecipeError(f"--high {high}: the kept modules' scheme must have more weight bits than the recipe's "
                          f"{low.name} ({low.weights.num_bits}); use W8A8, or none to keep them in the model's dtype")
    return scheme


def high_stage(stage, high: Scheme):
    """`stage` at the high scheme: per-channel (no group size, no group act-order)."""
    upd = {"scheme": high.name, "group_size": None}
    if getattr(stage, "actorder", None) == "group":
        upd["actorder"] = "static"
    return stage.model_copy(update=upd)


def _fields(stage) -> dict:
    """A stage's fields, every one explicit (unset overrides left out)."""
    return {k: v for k, v in stage.model_dump(mode="json").items() if v is not None}


def mixed_recipe(recipe: Recipe, high: Scheme | None, units: list[Unit], kept: list[str], name: str,
                 header: str = "") -> tuple[str, Recipe]:
    """The mixed-precision recipe as YAML text (and parsed, to prove it is valid): the kept units at the high
    scheme as anchored targets, the recipe's stage for everything else."""
    import yaml

    keep = {u.name for u in units if u.name in set(kept)}
    modules = sorted(m for u in units if u.name in keep for m in u.modules)
    data = recipe.model_dump(mode="json", exclude_defaults=True)
    data["stages"] = [_fields(st) for st in recipe.stages]
    data["name"] = name
    st = next(st for st in recipe.stages if not st.is_transform)
    low_desc = st.scheme + (f" group {st.group_size}" if st.group_size else "")
    data["description"] = (f"mixed precision by measured sensitivity, from {recipe.name}: {len(keep)} of {len(units)} "
                           f"fused module groups at {high.name if high else 'the model dtype'}, the rest {low_desc} "
                           f"({st.method})")
    data.setdefault("export", {}).pop("output_dir", None)
    if data.get("publish", {}).get("name"):
        data["publish"]["name"] = f"{data['publish']['name']}-mixed"
    qi = next(i for i, st in enumerate(recipe.stages) if not st.is_transform)
    low = data["stages"][qi]
    if modules:
        if high is None:
            low["ignore"] = list(low["ignore"]) + exact_targets(modules)
        else:
            hi = _fields(high_stage(recipe.stages[qi], high))  # its own lists: no YAML anchors
            hi["targets"] = exact_targets(modules)
            data["stages"].insert(qi, hi)
    parsed = parse_recipe(json.loads(json.dumps(data)), f"mixed recipe {name}")
    text = yaml.safe_dump(data, sort_keys=False, width=120)
    return (header + text), parsed
