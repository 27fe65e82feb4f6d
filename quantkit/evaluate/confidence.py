"""95% confidence intervals for the report's metrics: how sure a figure is, not only what it is.

Window metrics (the catalogue's BOOTSTRAP kind) get a seeded percentile bootstrap over the scored windows,
paired between the sides for the ratio; rates (WILSON) get the Wilson score interval on successes / items.
`intervals(baseline_side, candidate_side)` gives {metric: {"baseline", "candidate", "ratio"}};
metrics.metrics_table stores it as each metric's "ci95". The method in full: docs/evaluation.md ("Intervals").
"""

from __future__ import annotations

import math

import numpy as np

from quantkit.evaluate.catalogue import BOOTSTRAP, WILSON, fixed_names
from quantkit.evaluate.check_rules import wilson

LEVEL = 0.95
RESAMPLES = 1000
SEED = 0
MIN_WINDOWS = 8
DESCRIPTION = (f"perplexity, KL and top-1 agreement by a percentile bootstrap over the scored windows ({RESAMPLES} "
               f"resamples, seed {SEED}, at least {MIN_WINDOWS} windows; the ratio interval of candidate / baseline "
               "resamples the same windows on both sides); task, tool-call and safety rates by the Wilson score "
               "interval on successes / items (tasks.mean_acc at its effective sample size)")

# how to resample each BOOTSTRAP metric of the catalogue: (where the per-window lists are in a side's record,
# numerator list, transform of the ratio)
_WINDOW_METRICS = {
    "quality.perplexity": (("quality",), "logprob_sum", lambda r: np.exp(-r)),
    "quality.reference_perplexity": (("reference",), "logprob_sum", lambda r: np.exp(-r)),
    "quality.kl_mean": (("quality", "divergence"), "kl_sum", lambda r: r),
    "quality.top1_agreement": (("quality", "divergence"), "top1_agree", lambda r: r),
}


def _columns(side: dict | None, metric: str) -> tuple[np.ndarray, np.ndarray] | None:
    """(per-window numerator, per-window positions) of `metric`, or None if absent or unusable."""
    path, num_key, _ = _WINDOW_METRICS[metric]
    w = side or {}
    for p in path:
        w = w.get(p) if isinstance(w, dict) else None
    w = w.get("windows") if isinstance(w, dict) else None
    if not isinstance(w, dict):
        return None
    num, den = w.get(num_key), w.get("positions")
    if not isinstance(num, list) or not isinstance(den, list) or len(num) != len(den) or len(den) < MIN_WINDOWS:
        return None
    try:
        a, b = np.asarray(num, dtype=np.float64), np.asarray(den, dtype=np.float64)
    except (TypeError, ValueError):
        return None
    if not (np.all(np.isfinite(a)) and np.all(b > 0)):
        return None
    return a, b


def resample_indices(n: int, resamples: int = RESAMPLES, seed: int = SEED):
    """Yield blocks of resampled window indices (rows of n indices in 0..n-1); a function of (n, resamples,
    seed) only, so every metric and both sides over the same n windows see the same resamples."""
    rng = np.random.default_rng(seed)
    step = max(1, 4_000_000 // max(n, 1))  # bound the memory of one block
    for start in range(0, resamples, step):
        yield rng.integers(0, n, size=(min(step, resamples - start), n))


def resampled(metric: str, num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """The metric recomputed on each resample of the windows."""
    transform = _WINDOW_METRICS[metric][2]
    return np.concatenate([transform(num[idx].sum(axis=1) / den[idx].sum(axis=1))
                           for idx in resample_indices(len(den))])


def percentile_interval(stats: np.ndarray) -> list[float] | None:
    if stats.size == 0 or not np.all(np.isfinite(stats)):
        return None
    lo, hi = np.quantile(stats, [(1 - LEVEL) / 2, 1 - (1 - LEVEL) / 2])
    return [float(lo), float(hi)]


def window_intervals(baseline: dict | None, candidate: dict | None) -> dict[str, dict]:
    """Bootstrap intervals of the window metrics for each side, and the paired ratio interval."""
    out: dict[str, dict] = {}
    for metric in fixed_names(interval=BOOTSTRAP):
        cols = {"baseline": _columns(baseline, metric), "candidate": _columns(candidate, metric)}
        stats = {role: resampled(metric, *c) for role, c in cols.items() if c is not None}
        ci = {role: percentile_interval(s) for role, s in stats.items()}
        ratio = None
        b, c = cols["baseline"], cols["candidate"]
        if b is not None and c is not None and np.array_equal(b[1], c[1]):  # the same windows on both sides
            den = stats["baseline"]
            if np.all(den != 0):
                ratio = percentile_interval(stats["candidate"] / den)
        out[metric] = {"baseline": ci.get("baseline"), "candidate": ci.get("candidate"), "ratio": ratio}
    return out


def task_intervals(side: dict | None) -> dict[str, list[float]]:
    """Wilson intervals of one side's task metrics that are proportions of successes."""
    rows = ((side or {}).get("tasks") or {}).get("tasks") or {}
    out: dict[str, list[float]] = {}
    for task, r in rows.items():
        n, s, v = r.get("items"), r.get("successes"), r.get("value")
        if _is_proportion(v, s, n):
            out[f"tasks.{task}.{r['metric']}"] = list(wilson(s, n))
    n = sum(r.get("items") or 0 for r in rows.values())
    s = sum(r.get("successes") or 0 for r in rows.values())
    if n > 0 and 0 <= s <= n:
        out["tasks.success_rate"] = list(wilson(s, n))  # pooled successes / items (probes/tasks.task_success_rate)
    if rows and all(f"tasks.{t}.{r['metric']}" in out for t, r in rows.items()):
        out["tasks.mean_acc"] = list(mean_of_rates_interval([(r["successes"], r["items"]) for r in rows.values()]))
    return out


def mean_of_rates_interval(rates: list[tuple[int, int]]) -> tuple[float, float]:
    """Wilson interval of the unweighted mean of several tasks' proportions (tasks.mean_acc), at the
    effective sample size n_eff = m(1-m) / Var(m), Var(m) = Σ p_i(1-p_i)/n_i / T², capped at Σ n_i
    (and Σ n_i when every task is all right or all wrong). With one task, or equal n_i and p_i, this is
    wilson(successes, items) up to rounding; tasks with unequal rates give a narrower interval than the
    pooled one, as a stratified sample should."""
    t = len(rates)
    ps = [s / n for s, n in rates]
    m = sum(ps) / t
    n_total = sum(n for _, n in rates)
    var = sum(p * (1 - p) / n for p, (_, n) in zip(ps, rates)) / (t * t)
    n_eff = min(n_total, m * (1 - m) / var) if var > 0 else n_total
    return wilson(min(max(m * n_eff, 0.0), n_eff), n_eff)


def _is_proportion(value, successes, items) -> bool:
    """The task's value is successes / items (a binary per-item metric), so a Wilson interval describes it."""
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (value, successes, items)):
        return False
    return items > 0 and 0 <= successes <= items and math.isclose(value, successes / items, abs_tol=1e-9)


def check_intervals(side: dict | None) -> dict[str, list[float]]:
    """The Wilson intervals the chat checks computed with their rates (quantkit/evaluate/probes/chat.py)."""
    from quantkit.evaluate.catalogue import dig

    out: dict[str, list[float]] = {}
    for name in fixed_names(probe="checks", interval=WILSON):
        r = dig(side, "checks", *name.split("."))
        if isinstance(r, dict) and r.get("items") and isinstance(r.get("ci95"), list):
            out[name] = list(r["ci95"])
    return out


def intervals(baseline: dict | None, candidate: dict | None) -> dict[str, dict]:
    """{metric: {"baseline": [lo, hi] | None, "candidate": ..., "ratio": ...}} for the metrics with any interval."""
    out = window_intervals(baseline, candidate)
    tb, tc = task_intervals(baseline), task_intervals(candidate)
    tb, tc = {**tb, **check_intervals(baseline)}, {**tc, **check_intervals(candidate)}
    for name in list(tb) + [n for n in tc if n not in tb]:
        out[name] = {"baseline": tb.get(name), "candidate": tc.get(name), "ratio": None}
    return {name: ci for name, ci in out.items() if any(v is not None for v in ci.values())}
