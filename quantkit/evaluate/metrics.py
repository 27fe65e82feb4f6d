"""The flat metrics table of a report: name -> {baseline, candidate, unit, higher_is_better[, ci95]}.

The contract with `quantkit gate`: dotted names from the catalogue (quantkit/evaluate/catalogue.py), floats
or null. Each probe yields its metrics; this module adds the cost (at the load level with the highest output
throughput) and merges both sides. The cost formulas: docs/evaluation.md ("Cost").
"""

from __future__ import annotations

from quantkit.evaluate.catalogue import dig, labelled
from quantkit.evaluate.probes.tasks import task_counts
from quantkit.evaluate.reference import engine_gap


def fmt_value(x) -> str:
    """A metric value for a table: 4 significant digits (scientific from a million), '-' for none."""
    if x is None:
        return "-"
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return f"{x:.4g}" if abs(x) < 1e6 else f"{x:.4e}"
    return str(x)


def recovery(metric: dict) -> float | None:
    """How much of the baseline's quality the candidate keeps, whatever the metric's direction: 1.0 = as
    good as the baseline, below 1 worse, above 1 better (candidate / baseline when higher is better,
    baseline / candidate when lower is better). None where it is undefined (a missing value, or a zero
    in the denominator). The one meaning of "recovery" in reports, gates and model cards."""
    b, c = metric.get("baseline"), metric.get("candidate")
    if not isinstance(b, (int, float)) or not isinstance(c, (int, float)):
        return None
    if metric.get("higher_is_better", True):
        return c / b if b else None
    return b / c if c else None


def success_rate(side: dict | None) -> tuple[float | None, int, int]:
    """(rate, successes, items) pooled over the lm-eval items and the tool-call requests (exact calls)."""
    ok, n = task_counts((side or {}).get("tasks"))
    tools = dig(side, "checks", "tools", "exact_accuracy")
    if isinstance(tools, dict) and tools.get("items"):
        ok, n = ok + int(tools["successes"]), n + int(tools["items"])
    return (ok / n if n else None), ok, n


def peak_level(speed: dict | None) -> str | None:
    levels = [(v.get("output_tok_s") or 0.0, k) for k, v in (speed or {}).items()]
    return max(levels)[1] if levels and max(levels)[0] > 0 else None


def cost_figures(side: dict | None, price_per_hour: float | None) -> dict:
    """The side's cost at its highest-throughput level (see the module docstring); USD only with a price."""
    if side is None:
        return {}
    lvl = peak_level(side.get("speed"))
    if lvl is None:
        return {}
    s = side["speed"][lvl]
    rate, ok, n = success_rate(side)
    machine_s = 1000 / s["requests_s"] / rate if s.get("requests_s") and rate else None
    out = {"level": lvl, "success_rate": rate, "successes": ok, "items": n, "machine_s_per_k_successful_tasks": machine_s}
    if price_per_hour is not None:
        per_s = price_per_hour / 3600.0
        out["usd_per_mtok_output"] = per_s / s["output_tok_s"] * 1e6 if s.get("output_tok_s") else None
        out["usd_per_k_successful_tasks"] = per_s * machine_s if machine_s is not None else None
    return out


def cost_values(side: dict, price_per_hour: float | None) -> dict[str, float | None]:
    """The cost metrics: machine-seconds per thousand successful tasks (the default cost gate), and USD with a price."""
    cost = cost_figures(side, price_per_hour)
    out = {"cost.machine_s_per_k_successful_tasks": cost.get("machine_s_per_k_successful_tasks")}
    if cost and price_per_hour is not None:
        out["cost.usd_per_mtok_output"] = cost.get("usd_per_mtok_output")
        out["cost.usd_per_k_successful_tasks"] = cost.get("usd_per_k_successful_tasks")
    return out


def side_values(side: dict | None, price_per_hour: float | None) -> dict[str, tuple[float | None, str, bool]]:
    """One model's figures as {metric: (value, unit, higher_is_better)}: each probe's metrics and the cost,
    labelled from the catalogue."""
    from quantkit.evaluate.probes import PROBES

    if side is None:
        return {}
    out: dict[str, float | None] = {}
    for probe in PROBES:
        out.update(probe.values(side))
    out.update(cost_values(side, price_per_hour))
    return labelled(out)


def metrics_table(baseline: dict | None, candidate: dict, price_per_hour: float | None) -> dict[str, dict]:
    """Merge both sides into the flat contract table (a metric either side lacks is null there). A metric
    with a 95% confidence interval on either side also has "ci95": {"baseline", "candidate", "ratio"},
    each [low, high] or null (quantkit/evaluate/confidence.py says how they are computed)."""
    from quantkit.evaluate.confidence import intervals

    b = side_values(baseline, price_per_hour)
    c = side_values(candidate, price_per_hour)
    gap = engine_gap(baseline, candidate)
    if gap is not None:  # needs both sides: the candidate's extra degradation in the engine; 0 for the baseline
        b.update(labelled({"quality.engine_gap": 0.0}))
        c.update(labelled({"quality.engine_gap": gap}))
    ci = intervals(baseline, candidate)
    out = {}
    for name in list(b) + [n for n in c if n not in b]:
        bv, unit, hib = b.get(name, (None, None, None))
        cv, cunit, chib = c.get(name, (None, None, None))
        out[name] = {"baseline": _num(bv), "candidate": _num(cv), "unit": unit or cunit,
                     "higher_is_better": bool(hib if hib is not None else chib)}
        if name in ci:  # an interval only beside a value
            keep = {"baseline": bv is not None, "candidate": cv is not None, "ratio": bv is not None and cv is not None}
            ci95 = {role: ci[name][role] if keep[role] else None for role in keep}
            if any(v is not None for v in ci95.values()):
                out[name]["ci95"] = ci95
    return out


def _num(v) -> float | None:
    return None if v is None else float(v)


def delta(b: float | None, c: float | None) -> tuple[float | None, float | None]:
    """(candidate - baseline, relative change) with None where undefined."""
    if b is None or c is None:
        return None, None
    return c - b, ((c - b) / b if b else None)
