"""Choosing among a study's cells: the figures each is judged by (cost, quality, latency, memory), the Pareto
fronts and the recommendation, the cheapest passing cell with near-equal costs a tie won by quality. Pure
functions of the cells' records, so they are tested on recorded results (docs/tune.md)."""

from __future__ import annotations

import math

QUALITY = "ppl_ratio"
COST = "usd_per_k_successful_tasks"
LATENCY = "e2e_p99_ms_peak"


def _m(report: dict, name: str, role: str = "candidate"):
    v = ((report.get("metrics") or {}).get(name) or {}).get(role)
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None


def _ratio(report: dict, name: str):
    b, c = _m(report, name, "baseline"), _m(report, name)
    return c / b if b and c is not None else None


def cell_figures(report: dict, peak: int) -> dict:
    """The figures a cell is compared by, from its eval report (None where not measured)."""
    lvl = f"speed.c{peak}"
    cost = (report.get("cost") or {}).get("candidate") or {}
    return {
        QUALITY: _ratio(report, "quality.perplexity"),
        "kl_mean": _m(report, "quality.kl_mean"),
        "top1_agreement": _m(report, "quality.top1_agreement"),
        "task_recovery": _ratio(report, "tasks.mean_acc"),
        "success_rate": cost.get("success_rate"),
        "tools_agreement": _m(report, "tools.baseline_agreement"),
        "safety_flip_rate": _m(report, "safety.flip_rate"),
        "engine_gap": _m(report, "quality.engine_gap"),
        "ttft_p99_ms_peak": _m(report, f"{lvl}.ttft_ms_p99"),
        "tpot_p99_ms_peak": _m(report, f"{lvl}.tpot_ms_p99"),
        LATENCY: _m(report, f"{lvl}.e2e_ms_p99"),
        "output_tok_s_peak": _m(report, f"{lvl}.output_tok_s"),
        COST: _m(report, "cost.usd_per_k_successful_tasks"),
        "usd_per_mtok_output": _m(report, "cost.usd_per_mtok_output"),
        "cost_level": cost.get("level"),
        "weight_bytes": _m(report, "memory.weight_bytes"),
        "checkpoint_bytes": _m(report, "memory.checkpoint_bytes"),
        "kv_cache_tokens": _m(report, "memory.kv_cache_tokens"),
    }


def _done(records: list[dict]) -> list[dict]:
    return [r for r in records if r.get("status") == "done" and r.get("figures")]


def pareto(records: list[dict], x: str, y: str = QUALITY) -> list[str]:
    """Ids of the finished cells no other cell beats on both x and y (both lower-is-better), sorted by x.
    A cell missing either figure is not on the front."""
    pts = [(r["figures"][x], r["figures"][y], r["id"]) for r in _done(records)
           if r["figures"].get(x) is not None and r["figures"].get(y) is not None]
    front = []
    for px, py, pid in pts:
        dominated = any(qx <= px and qy <= py and (qx < px or qy < py) for qx, qy, _ in pts)
        if not dominated:
            front.append((px, py, pid))
    return [pid for _, _, pid in sorted(front)]


def first_failure(rec: dict) -> str:
    for g in (rec.get("gates") or {}).get("results") or []:
        if not g.get("passed"):
            return f"{g.get('gate')}: {g.get('reason')}"
    return "no gate failed"


def recommend(records: list[dict], tolerance: float = 0.0) -> dict:
    """{"id": the recommended cell or None, "reason": why, "ranked": [passing ids by cost], "tied": [ids within
    the tolerance of the cheapest]}."""
    done = _done(records)
    passing = [r for r in done if (r.get("gates") or {}).get("passed")]
    priced = [r for r in passing if r["figures"].get(COST) is not None]
    if priced:
        ranked = sorted(priced, key=lambda r: (r["figures"][COST], r["figures"].get(QUALITY) or math.inf, r["id"]))
        floor = ranked[0]["figures"][COST]
        tied = [r for r in ranked if r["figures"][COST] <= floor * (1 + tolerance)]
        best = min(tied, key=lambda r: (r["figures"].get(QUALITY) or math.inf, r["figures"][COST], r["id"]))
        cost = f"${best['figures'][COST]:.4g} per 1,000 successful tasks"
        if len(tied) == 1:
            runner = (f"; next {ranked[1]['id']} at ${ranked[1]['figures'][COST]:.4g}" if len(ranked) > 1 else "")
            why = f"the cheapest of {len(priced)} cell(s) passing every gate: {cost}{runner}"
        else:
            why = (f"{len(tied)} of {len(priced)} cells passing every gate cost within {tolerance:.0%} of the cheapest "
                   f"(${floor:.4g}: {', '.join(r['id'] for r in tied)}), a tie within the speed measurements' spread; "
                   f"of those it has the best perplexity ratio ({best['figures'].get(QUALITY):.4g}), at {cost}")
        return {"id": best["id"], "ranked": [r["id"] for r in ranked], "tied": [r["id"] for r in tied],
                "reason": why}
    if not records:
        return {"id": None, "ranked": [], "reason": "the study has no cells"}
    if not done:
        states = ", ".join(f"{r['id']}: {r.get('status') or 'not run'}" + (f" ({r['reason']})" if r.get("reason") else "")
                           for r in records)
        return {"id": None, "ranked": [], "reason": f"no cell finished its eval ({states})"}
    if passing:  # passing but without a cost: the price or the success rate is missing
        return {"id": None, "ranked": [], "reason": "cells pass their gates but none has a cost per successful task "
                                                    "(no price_per_hour, or no task or tool-call successes measured)"}
    fails = "; ".join(f"{r['id']}: {first_failure(r)}" for r in done)
    return {"id": None, "ranked": [], "reason": f"no cell passes every gate of the base recipe ({fails})"}


__all__ = ["cell_figures", "pareto", "recommend", "first_failure", "QUALITY", "COST", "LATENCY"]
