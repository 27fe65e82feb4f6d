"""tune.json, tune.md and the Pareto plots of a study (written after every run, from the cells' records)."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

from quantkit.io import atomic_write_json, atomic_write_text
from quantkit.tune.choose import COST, LATENCY, QUALITY, pareto, recommend
from quantkit.tune.run import load_records
from quantkit.tune.study import Study

SCHEMA = "quantkit.tune/v1"


def build(study: Study, output: Path) -> dict:
    records = load_records(study, output)
    fronts = {"cost": pareto(records, COST), "latency": pareto(records, LATENCY)}
    rec = recommend(records, study.spec.cost_tolerance)
    hw = next((r["config"]["hardware"] for r in records if r.get("config")), None)
    engine = next((r["config"]["engine"] for r in records if r.get("config")), None)
    return {"schema": SCHEMA, "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "study": study.spec.model_dump(mode="json"), "study_path": str(study.path), "base": str(study.base_path),
            "hardware": hw, "engine": engine,
            "wall_s": sum((r.get("timings") or {}).get("total_s") or 0.0 for r in records),
            "cells": records, "pareto": fronts, "recommended": rec}


def write(study: Study, output: Path) -> dict:
    data = build(study, output)
    plots = output / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    made = [p for p in (plot_front(data, COST, "USD per 1,000 successful tasks", plots / "pareto_cost.png"),
                        plot_front(data, LATENCY, f"end-to-end p99 at concurrency {study.spec.load.peak} (ms)",
                                   plots / "pareto_latency.png")) if p is not None]
    data["plots"] = [str(p.relative_to(output)) for p in made]
    atomic_write_json(output / "tune.json", data)
    atomic_write_text(output / "tune.md", render(data))
    return data


def plot_front(data: dict, x: str, xlabel: str, path: Path) -> Path | None:
    pts = [(r["figures"][x], r["figures"][QUALITY], r) for r in data["cells"]
           if r.get("status") == "done" and (r.get("figures") or {}).get(x) is not None
           and r["figures"].get(QUALITY) is not None]
    if not pts:
        return None
    from quantkit.evaluate.plots import _plt

    plt = _plt()
    front = set(data["pareto"]["cost" if x == COST else "latency"])
    best = data["recommended"].get("id")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for px, py, r in pts:
        ok = (r.get("gates") or {}).get("passed")
        ax.scatter([px], [py], s=60, marker="o", facecolors="#1f77b4" if ok else "none",
                   edgecolors="#1f77b4" if ok else "#d62728", zorder=3)
        ax.annotate(r["id"], (px, py), textcoords="offset points", xytext=(5, 4), fontsize=7)
    fr = sorted((px, py) for px, py, r in pts if r["id"] in front)
    if len(fr) > 1:
        ax.step([p[0] for p in fr], [p[1] for p in fr], where="post", color="#7f7f7f", linestyle="--", zorder=2,
                label="Pareto front")
    for px, py, r in pts:
        if r["id"] == best:
            ax.scatter([px], [py], s=260, marker="*", color="#2ca02c", zorder=4, label=f"recommended: {best}")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("perplexity / baseline (lower is better)")
    ax.set_title(f"{data['study']['name']}: filled = passes every gate, hollow red = fails one")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _f(x, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


def render(d: dict) -> str:
    """tune.md: the study, the recommendation, the cells' table, what did not pass, and how each was measured."""
    return "\n".join(_head(d) + _recommendation(d) + _table(d) + _not_passing(d)
                     + ["## How each cell was measured", ""] + [x for r in d["cells"] for x in _how_measured(r)])


def _head(d: dict) -> list[str]:
    s = d["study"]
    return [f"# Tune: {s['name']}", "", s.get("description") or "",
            f"Base recipe `{d['base']}`, mode `{s['mode']}`, ${s['price_per_hour']}/hour, load: normal "
            f"concurrency {s['load']['normal']}, peak {s['load']['peak']}"
            + (f", open-loop {s['load']['rates']} req/s" if s["load"]["rates"] else "") + ".",
            f"Costs within {s['cost_tolerance']:.0%} of the cheapest passing cell are a tie, won by the better "
            "perplexity ratio.",
            f"Engine {d.get('engine') or '—'}; hardware {_hw(d.get('hardware'))}. Cell time, all cells: "
            f"{d['wall_s'] / 60:.1f} min.", ""]


def _recommendation(d: dict) -> list[str]:
    rec = d["recommended"]
    if not rec.get("id"):
        return ["## Recommendation", "", f"No cell is recommended: {rec['reason']}.", ""]
    cell = next(r for r in d["cells"] if r["id"] == rec["id"])
    return ["## Recommendation", "", f"**{rec['id']}**: {rec['reason']}.", "", f"Artifact `{cell.get('artifact')}`"
            + (f", engine settings `{cell['engine_args']}`" if cell.get("engine_args") else "") + ".",
            f"Publish it: `quantkit tune {d['study_path']} --publish` (gate, then publish, as `quantkit publish` does).", ""]


def _table(d: dict) -> list[str]:
    L = ["## Cells", "",
         "| cell | status | gates | ppl ratio | KL | top-1 | task rec. | success | tool agr. | safety flips "
         "| TTFT p99 | TPOT p99 | e2e p99 | $/1k successful | weights | KV tokens |",
         "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in d["cells"]:
        f = r.get("figures") or {}
        gates = (r.get("gates") or {})
        g = "pass" if gates.get("passed") else ("fail" if gates else "—")
        status = r.get("status") or "not run"
        star = " ★" if r["id"] == d["recommended"].get("id") else ""
        L.append(f"| {r['id']}{star} | {status} | {g} | {_f(f.get(QUALITY), '.3f')} | {_f(f.get('kl_mean'), '.4f')} "
                 f"| {_f(f.get('top1_agreement'), '.3f')} | {_f(f.get('task_recovery'), '.3f')} "
                 f"| {_f(f.get('success_rate'), '.3f')} | {_f(f.get('tools_agreement'), '.3f')} "
                 f"| {_f(f.get('safety_flip_rate'), '.3f')} | {_f(f.get('ttft_p99_ms_peak'), '.0f')} ms "
                 f"| {_f(f.get('tpot_p99_ms_peak'), '.1f')} ms | {_f(f.get(LATENCY), '.0f')} ms "
                 f"| {_f(f.get(COST), '.4g')} | {_mib(f.get('weight_bytes'))} | {_f(f.get('kv_cache_tokens'), ',.0f')} |")
    L += ["", "Latencies at the peak concurrency; cost at each cell's highest-throughput level. "
              "\"success\" pools lm-eval items right and tool calls exactly right.", ""]
    for name, key in (("quality vs cost", "cost"), ("quality vs p99 latency", "latency")):
        L.append(f"Pareto front, {name}: {', '.join(d['pareto'][key]) or '—'}.")
    return L + [""] + [f"![{p}]({p})" for p in d.get("plots", [])] + [""]


def _not_passing(d: dict) -> list[str]:
    L = []
    not_done = [r for r in d["cells"] if r.get("status") in ("skipped", "failed", "invalid")]
    if not_done:
        L += ["## Skipped and failed cells", ""] + [f"- **{r['id']}** ({r['status']}): {r.get('reason')}"
                                                     for r in not_done] + [""]
    failing = [r for r in d["cells"] if r.get("status") == "done" and not (r.get("gates") or {}).get("passed")]
    if failing:
        from quantkit.tune.choose import first_failure

        L += ["## Gate failures", ""] + [f"- **{r['id']}**: {first_failure(r)}" for r in failing] + [""]
    return L


def _how_measured(r: dict) -> list[str]:
    c = r.get("config")
    L = [f"### {r['id']}", ""]
    if r.get("quantization"):
        L.append("- quantization: " + "; ".join(", ".join(f"{k} {v}" for k, v in st.items())
                                                for st in r["quantization"]))
    if c:
        L += [f"- model `{c['model']}`, artifact `{c['artifact']}` ({c.get('format')}, {_mib(c.get('size_bytes'))})",
              f"- engine {c['engine']}, dtype {c.get('dtype')}, engine args {c.get('engine_args') or '{}'}, "
              f"max_model_len {c.get('max_model_len')}, KV cache {c.get('kv_cache_gib')} GiB",
              f"- workload: prompts {c.get('prompt_tokens')} tokens, outputs {c.get('output_tokens')} tokens, "
              f"{c.get('requests_per_level')} requests per level at concurrency {c.get('concurrency')}"
              + (f", open-loop {c['request_rates']} req/s" if c.get("request_rates") else "")
              + f"; generation {c.get('generation')}",
              f"- report `{r.get('report')}`"]
    t = r.get("timings") or {}
    if t:
        L.append("- time: " + ", ".join(f"{k.removesuffix('_s')} {v:.0f} s" for k, v in t.items()))
    if r.get("command"):
        L.append(f"- re-run this cell alone: `{r['command']}`")
    return L + [""]


def _mib(x) -> str:
    return "—" if x is None else f"{x / 2**20:,.1f} MiB"


def _hw(hw: dict | None) -> str:
    if not hw:
        return "—"
    flags = hw.get("cpu_flags")
    return f"{hw.get('cpu') or hw.get('cpu_kind')}" + (f" ({' '.join(flags)})" if flags else "") \
        + (f", {hw.get('cpu_count')} cores" if hw.get("cpu_count") else "") + (f", GPU {hw['gpu']}" if hw.get("gpu") else "")


__all__ = ["build", "write", "render", "plot_front", "SCHEMA"]
