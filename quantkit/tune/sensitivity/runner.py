"""`quantkit sensitivity` end to end: measure, validate, choose, write the mixed recipe and the report.

The measurement (measured.json, with the units' quantized weights in weights/) and the validation
(validation.json) are kept with the inputs they came from: a second call with another budget reuses both.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

from quantkit.errors import human_bytes
from quantkit.io import atomic_write_json, atomic_write_text
from quantkit.recipe import Recipe
from quantkit.schemes import Scheme
from quantkit.tune.sensitivity.budget import Budget, LatencyModel, choose, latency_model, predicted
from quantkit.tune.sensitivity.layer_error import measure
from quantkit.tune.sensitivity.recipes import check_recipe, mixed_recipe
from quantkit.tune.sensitivity.report import write_report
from quantkit.tune.sensitivity.units import Unit, use_proxy
from quantkit.tune.sensitivity.validation import FullModelKL, end_weights, kl_factor, validate_proxy

MEASURE_VERSION = 1  # bump when the measurement's definition changes: cached measurements are then redone


@dataclass(frozen=True)
class SensitivityOptions:
    """How `run` measures, validates and chooses: the CLI's flags."""

    high: str = "W8A8"  # the kept units' scheme, or "none": the model's dtype
    validate: int = 16  # units whose full-model KL checks the proxy (0: no validation, no kl budget)
    latency_from: list[str | Path] | None = None  # eval reports with the engine's TPOT at both ends (tpot budgets)
    latency_metric: str = "speed.c1.tpot_ms_p50"  # the report metric a tpot budget reads
    kl_tokens: int = 1024  # held-out tokens the full-model KL is measured on
    device: str = "auto"
    progress: Callable[[str], None] | None = None


def run(recipe: Recipe, budget: str | list[str], output: Path, options: SensitivityOptions | None = None,
        **fields) -> dict:
    """Measure, validate, choose and write: output/{sensitivity.json, sensitivity.md, plots, <name>.yaml}.
    `fields`: SensitivityOptions fields by name (high=..., validate=...), over `options`."""
    o = replace(options or SensitivityOptions(), **fields)
    r = _Run(recipe, o, output, check_recipe(recipe, o.high), o.progress or (lambda m: None))
    output.mkdir(parents=True, exist_ok=True)
    r.load_or_measure()
    validation = r.load_or_validate() if o.validate else None
    factor = (validation or {}).get("kl_factor")
    budgets, lat, choice, ends = r.choose(budget, factor)
    if validation and choice["kept"]:
        validation["measured"]["mixed"] = r.full_model().kl(*end_weights(r.weights_dir, r.units, r.high,
                                                                          set(choice["kept"])))
    recipe_path = r.write_recipe(budgets, choice)
    result = {"recipe": recipe.name, "recipe_path": str(recipe_path), "method": recipe.stages[0].method,
              "low_scheme": recipe.stages[0].scheme, "high_scheme": o.high, "facts": r.facts, "validation": validation,
              "latency": asdict(lat) if lat is not None else None, "choice": choice, "ends": ends,
              "units": [asdict(u) for u in r.units]}
    write_report(output, result)
    return result


@dataclass
class _Run:
    """One run's state: its inputs, the measured units and facts, and the float model once it is loaded."""

    recipe: Recipe
    options: SensitivityOptions
    output: Path
    high: Scheme | None
    say: Callable[[str], None]
    units: list[Unit] | None = None
    facts: dict | None = None
    _fm: FullModelKL | None = None

    @property
    def weights_dir(self) -> Path:
        return self.output / "weights"

    @property
    def key(self) -> dict:
        """What the measurement depends on."""
        return {"recipe": self.recipe.hash(), "high": self.options.high, "version": MEASURE_VERSION,
                "weights": bool(self.options.validate)}

    def load_or_measure(self) -> None:
        cached = _cached(self.output / "measured.json", self.key)
        if cached is not None:
            self.units, self.facts = [Unit(**u) for u in cached["units"]], cached["facts"]
            self.say(f"sensitivity: reusing the measurement in {self.output / 'measured.json'}")
        else:
            o = self.options
            self.units, self.facts = measure(self.recipe, self.high, self.weights_dir if o.validate else None,
                                             o.device, self.say)
            atomic_write_json(self.output / "measured.json",
                              {"key": self.key, "units": [asdict(u) for u in self.units], "facts": self.facts})
        use_proxy(self.units, "layer", self.facts["final_energy"])

    def full_model(self) -> FullModelKL:
        """Loaded once, and only when a KL is to be measured."""
        if self._fm is None:
            from quantkit.evaluate.suite import resolve_file

            self._fm = FullModelKL(Path(self.facts["model_dir"]),
                                   [resolve_file(f) for f in self.recipe.eval.perplexity_files],
                                   self.options.kl_tokens, trust_remote_code=self.recipe.model.trust_remote_code)
        return self._fm

    def load_or_validate(self) -> dict:
        """The validation (cached beside the measurement); the units take its per-unit KLs and its proxy."""
        o = self.options
        vkey = {**self.key, "validate": o.validate, "kl_tokens": o.kl_tokens,
                "files": list(self.recipe.eval.perplexity_files)}
        validation = _cached(self.output / "validation.json", vkey)
        if validation is not None:
            validation.pop("key")
            self.say(f"sensitivity: reusing the validation in {self.output / 'validation.json'}")
        else:
            validation = validate_proxy(self.full_model(), self.high, self.units, self.facts, self.weights_dir,
                                        o.validate, self.say)
            atomic_write_json(self.output / "validation.json", {"key": vkey, **validation})
        for u in self.units:
            u.kl_low = validation["kl_low"].get(u.name)
        use_proxy(self.units, validation["proxy"], self.facts["final_energy"])
        validation["kl_factor"] = kl_factor(validation["measured"]["low"], self.units)
        return validation

    def choose(self, budget: str | list[str], factor: float | None):
        """(budgets, latency model, choice, predicted figures of both uniform ends)."""
        o, units, other = self.options, self.units, self.facts["other_bytes"]
        uniform_low = sum(u.bytes_low for u in units) + other
        budgets = [Budget.parse(t, uniform_low) for t in ([budget] if isinstance(budget, str) else budget)]
        lat: LatencyModel | None = None
        if o.latency_from:
            lat = latency_model([Path(p) for p in o.latency_from], self.high, o.latency_metric, units)
        choice = choose(units, budgets, other, factor, lat)
        ends = {end: predicted(sum(getattr(u, f"bytes_{end}") for u in units),
                               sum(getattr(u, f"error_{end}") for u in units), other, factor, lat)
                for end in ("low", "high")}
        return budgets, lat, choice, ends

    def write_recipe(self, budgets: list[Budget], choice: dict) -> Path:
        tag = "-".join(re.sub(r"[^A-Za-z0-9._-]+", "", b.text.replace("=", "-")) for b in budgets)
        name = f"{self.recipe.name}-mixed-{tag}"
        text, _ = mixed_recipe(self.recipe, self.high, self.units, choice["kept"], name, self._header(choice))
        path = self.output / f"{name}.yaml"
        atomic_write_text(path, text)
        return path

    def _header(self, choice: dict) -> str:
        kl, tpot = choice.get("predicted_kl"), choice.get("predicted_tpot_ms")
        return (f"# Written by `quantkit sensitivity` from {self.recipe.name} (budget {choice['budget']}, high scheme "
                f"{self.options.high}):\n# {len(choice['kept'])} of {len(self.units)} units kept high; checkpoint "
                f"~{human_bytes(choice['checkpoint_bytes'])}"
                + (f", predicted KL {kl:.4f}" if kl is not None else "")
                + (f", TPOT ~{tpot:.2f} ms (engine ends, interpolated)" if tpot is not None else "")
                + ". See sensitivity.md beside it.\n")


def _cached(path: Path, key: dict) -> dict | None:
    data = json.loads(path.read_text()) if path.is_file() else None
    return data if data and data.get("key") == key else None
