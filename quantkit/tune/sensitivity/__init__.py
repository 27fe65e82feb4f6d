"""`quantkit sensitivity`: which modules to keep at a higher-precision scheme, and the mixed recipe that
does. The design (units, proxies, validation, budgets) is in docs/sensitivity.md.

    units.py        units (what one engine kernel fuses), their sizes, the proxy error
    recipes.py      the recipe it starts from and the mixed recipe it writes
    layer_walk.py   a float visitor of the shared layer walk: one decoder layer in memory at a time
    layer_error.py  the measurement: each unit's error on its layer's output, in one walk
    validation.py   the proxy against the full-model KL, and the KL factor
    budget.py       kl / size / tpot budgets and the choice of units to keep high
    report.py       sensitivity.json, sensitivity.md, plots
    runner.py       run: all of it, with the measurement and validation cached
"""

from quantkit.tune.sensitivity.budget import Budget, LatencyModel, choose, latency_model, predicted
from quantkit.tune.sensitivity.layer_error import measure
from quantkit.tune.sensitivity.recipes import HIGH_NONE, check_recipe, mixed_recipe
from quantkit.tune.sensitivity.report import render_markdown, write_report
from quantkit.tune.sensitivity.runner import MEASURE_VERSION, SensitivityOptions, run
from quantkit.tune.sensitivity.units import PROXIES, Unit, plan_units, use_proxy, weight_bytes
from quantkit.tune.sensitivity.validation import FullModelKL, kl_factor, load_unit_weights, spearman, spread

__all__ = ["Unit", "Budget", "LatencyModel", "FullModelKL", "weight_bytes", "plan_units", "check_recipe", "measure",
           "spread", "spearman", "kl_factor", "choose", "latency_model", "mixed_recipe", "write_report",
           "load_unit_weights", "run", "HIGH_NONE", "SensitivityOptions", "PROXIES", "use_proxy", "predicted",
           "render_markdown", "MEASURE_VERSION"]
