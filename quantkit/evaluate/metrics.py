"""The flat metrics table of a report: name -> {baseline, candidate, unit, higher_is_better}.

This is the contract with `quantkit gate`: dotted names, floats or null, and for the metrics that have
one an optional "ci95" {baseline, candidate, ratio} of 95% intervals ([low, high] or null; see
quantkit/evaluate/confidence.py). Divergence metrics give the baseline against itself (KL 0, agreement 1),
and so does quality.engine_gap (0 for the baseline; quantkit/evaluate/reference.py defines it).
Cost is taken at the load level with the highest output throughput of that model:
- machine_s_per_k_successful_tasks = 1000 / requests_s / success_rate: machine-seconds per thousand
  successful tasks, with no price needed (on one machine, the ratio of two models' figures is the ratio of
  their costs whatever the price; the default cost gate compares it);
and, with a price per hour:
- usd_per_mtok_output = price_per_hour / 3600 / output_tok_s * 1e6
- usd_per_k_successful_tasks = 1000 * price_per_hour / 3600 / requests_s / success_rate,
  i.e. the cost of serving one request at that level divided by the share of useful answers:
  price x wall time / successful tasks, per thousand. A successful task is an lm-eval item answered
  right or a tool call exactly right (tools.exact_accuracy), pooled over all of them (success_rate);
  safety prompts are not tasks and do not count.
"""

from __future__ import annotations

from quantkit.evaluate.catalogue import dig, fixed_names, labelled
from quantkit.evaluate.reference import engine_gap, engine_vs_reference

LAT = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")
PCTS = (50, 90, 99)


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


def _task_counts(tasks: dict | None) -> tuple[int, int]:
    """(successes, items) pooled over every lm-eval task."""
    rows = (tasks or {}).get("tasks") or {}
    return sum(r["successes"] for r in rows.values()), sum(r["items"] for r in rows.values())


def task_success_rate(tasks: dict | None) -> float | None:
    ok, items = _task_counts(tasks)
    return ok / items if items else None


def success_rate(side: dict | None) -> tuple[float | None, int, int]:
    """(rate, successes, items) pooled over the lm-eval items and the tool-call requests (exact calls)."""
    ok, n = _task_counts((side or {}).get("tasks"))
    tools = dig(side, "checks", "tools", "exact_accuracy")
    if isinstance(tools, dict) and tools.get("items"):
        ok, n = ok + int(tools["successes"]), n + int(tools["items"])
    return (ok / n if n else None), ok, n


def concurrency_levels(speed: dict | None) -> list[str]:
    """The closed-loop levels ("c1", "c4", ...) of a side's speed figures, lowest concurrency first."""
    return sorted((k for k in (speed or {}) if k[:1] == "c" and k[1:].isdigit()), key=lambda k: int(k[1:]))


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


def _serving_values(side: dict) -> dict[str, float | None]:
    """The figures the default speed, memory and cost gates read, whatever levels the suite measured: decode
    TPOT p50 at the lowest concurrency, output throughput at the highest, failed requests over all levels,
    the memory the engine process held (peak GPU memory on a GPU, else the process tree's peak PSS: measured,
    not computed from the checkpoint), and machine-seconds per thousand successful tasks."""
    speed = side.get("speed") or {}
    levels = concurrency_levels(speed)
    out: dict[str, float | None] = {
        "speed.decode_tpot_ms_p50": speed[levels[0]].get("tpot_ms_p50") if levels else None,
        "speed.peak_output_tok_s": speed[levels[-1]].get("output_tok_s") if levels else None,
        "speed.failed_requests": float(sum(s.get("failed", 0) for s in speed.values())) if speed else None}
    mem = side.get("memory") or {}
    out["memory.engine_bytes"] = mem.get("peak_gpu_bytes") if mem.get("peak_gpu_bytes") is not None else mem.get("peak_pss_bytes")
    out["cost.machine_s_per_k_successful_tasks"] = cost_figures(side, None).get("machine_s_per_k_successful_tasks")
    art = side.get("artifact") or {}
    for name in ("coverage", "nonfinite_tensors", "experts_unrecorded"):
        if name in art:
            out[f"artifact.{name}"] = art[name]
    return out


def side_values(side: dict | None, price_per_hour: float | None) -> dict[str, tuple[float | None, str, bool]]:
    """One model's figures as {metric: (value, unit, higher_is_better)}; units and directions from the catalogue."""
    if side is None:
        return {}
    out: dict[str, float | None] = {}
    q = side.get("quality") or {}
    out["quality.perplexity"] = q.get("perplexity")
    out["quality.kl_mean"] = dig(q, "divergence", "kl_mean")
    out["quality.kl_p99"] = dig(q, "divergence", "kl_p99")
    out["quality.top1_agreement"] = dig(q, "divergence", "top1_agreement")
    ref = side.get("reference")
    if isinstance(ref, dict):  # the engine-free reference (quantkit/evaluate/reference.py)
        out["quality.reference_perplexity"] = ref.get("perplexity")
        out["quality.engine_vs_reference"] = engine_vs_reference(q.get("perplexity"), ref.get("perplexity"))
    rows = dig(side, "tasks", "tasks") or {}
    for task, r in rows.items():
        out[f"tasks.{task}.{r['metric']}"] = r["value"]
        for extra, val in (r.get("extra") or {}).items():
            out[f"tasks.{task}.{extra}"] = val
    out["tasks.mean_acc"] = sum(r["value"] for r in rows.values()) / len(rows) if rows else None
    out["tasks.success_rate"] = task_success_rate(side.get("tasks"))
    for lvl, s in (side.get("speed") or {}).items():
        for m in LAT:
            for p in PCTS:
                out[f"speed.{lvl}.{m}_p{p}"] = s.get(f"{m}_p{p}")
        out[f"speed.{lvl}.output_tok_s"] = s.get("output_tok_s")
        out[f"speed.{lvl}.requests_s"] = s.get("requests_s")
        out[f"speed.{lvl}.failed"] = float(s.get("failed", 0))
        em = s.get("engine_metrics") or {}
        out[f"speed.{lvl}.queue_ms_mean"] = em.get("request_queue_time_mean_ms")
        out[f"speed.{lvl}.kv_cache_usage_max"] = em.get("kv_cache_usage_perc_max")
        out[f"speed.{lvl}.preemptions"] = em.get("num_preemptions")
    for name in fixed_names(probe="checks"):
        r = dig(side, "checks", *name.split("."))
        if isinstance(r, dict) and "value" in r:
            out[name] = r["value"]
    out.update(_serving_values(side))
    mem = side.get("memory") or {}
    for name in ("checkpoint_bytes", "weight_bytes", "kv_cache_tokens", "peak_rss_bytes", "peak_pss_bytes"):
        out[f"memory.{name}"] = mem.get(name)
    if mem.get("peak_gpu_bytes") is not None:
        out["memory.peak_gpu_bytes"] = mem.get("peak_gpu_bytes")
        out["memory.gpu_util_mean"] = mem.get("gpu_util_mean")
    cost = cost_figures(side, price_per_hour)
    if cost and price_per_hour is not None:
        out["cost.usd_per_mtok_output"] = cost.get("usd_per_mtok_output")
        out["cost.usd_per_k_successful_tasks"] = cost.get("usd_per_k_successful_tasks")
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
