"""The eval report: report.json (schema quantkit.report/1), report.md and PNG plots.

This module owns the report's facts: its schema, where it lives (REPORT_FILE in EVAL_DIR of an
artifact). Metric names, units and directions live in the catalogue (quantkit/evaluate/catalogue.py).

report.json top level: schema, created, complete (false when a phase failed; quantkit/evaluate/phases.py),
incomplete (which phases, and why), artifact {path, name, quantization, size_bytes, manifest_sha256}, baseline
{path, url}, engine {name, version, dtype, baseline/candidate engine facts}, hardware, workload,
generation, suite, metrics (flat: name -> {baseline, candidate, unit, higher_is_better}, plus "ci95"
{baseline, candidate, ratio} where a 95% interval exists; the contract with `quantkit gate`), recovery
(candidate / baseline per task and mean), cost, where_the_wait_is, checks (per chat check: items and
request errors per side, and the differences quoted in report.md), variants, details (per side, without
per-request records: those stay in raw/), wall_s.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

from quantkit.evaluate.confidence import DESCRIPTION as CI_DESCRIPTION
from quantkit.evaluate.metrics import cost_figures, delta, metrics_table, recovery
from quantkit.evaluate.phases import failed_phases
from quantkit.io import atomic_write_json, atomic_write_text

SCHEMA = "quantkit.report/1"
REPORT_FILE = "report.json"
EVAL_DIR = "eval"  # `quantkit eval ARTIFACT` writes into ARTIFACT/eval; `quantkit gate ARTIFACT` reads there


def default_output(artifact: str | Path) -> Path:
    """The eval folder of an artifact: <artifact>/eval."""
    return Path(artifact) / EVAL_DIR


def default_report_path(artifact: str | Path) -> Path:
    """Where `quantkit eval` writes an artifact's report by default: <artifact>/eval/report.json."""
    return default_output(artifact) / REPORT_FILE


def _strip_records(side: dict | None) -> dict | None:
    if side is None:
        return None
    out = json.loads(json.dumps(side, default=str))
    for s in (out.get("speed") or {}).values():
        s.pop("records", None)
        (s.get("engine_metrics") or {}).pop("timeline", None)
    for c in (out.get("checks") or {}).values():
        if isinstance(c, dict):
            c.pop("records", None)
    return out


def _warmup_sent(side: dict) -> int | None:
    """Warm-up requests the side's engine got before its first speed level (quantkit/evaluate/speed.py)."""
    levels = list((side.get("speed") or {}).values())
    return levels[0].get("warmup_requests") if levels and isinstance(levels[0], dict) else None


def _warmup_line(w: dict) -> str:
    sent = {k: v for k, v in (w.get("warmup_sent") or {}).items() if v is not None}
    if not sent:  # a report from before warmup_sent was recorded
        return f"{w['warmup_requests']} warm-up requests per level excluded."
    how = ", ".join(f"{role} {n}" for role, n in sent.items())
    return (f"Warm-up requests before the first level, excluded: {how} (none where the engine had just served the "
            "chat checks).")


def build_report(context: dict, baseline: dict | None, candidate: dict, variants: list[dict]) -> dict:
    from quantkit.evaluate.diagnose import where_the_wait_is

    suite = context["suite"]
    price = suite.get("price_per_hour")
    metrics = metrics_table(baseline, candidate, price)
    recovered = {name: recovery(m) for name, m in metrics.items() if name.startswith("tasks.")}
    recovered = {name: r for name, r in recovered.items() if r is not None}
    eng_c = candidate.get("engine") or {}
    work = suite["workload"]
    items = context.get("workload_items") or []
    kv_gib = suite.get("kv_cache_gib")
    incomplete = [why for role, side in (("baseline", baseline), ("candidate", candidate))
                  for why in failed_phases(side, role, suite)]
    incomplete += [why for v in variants for why in failed_phases(v, v.get("role", "variant"), suite, speed_only=True)]
    return {
        "schema": SCHEMA,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "complete": not incomplete,
        "incomplete": incomplete,
        "artifact": context["artifact"],
        "baseline": context["baseline"],
        "engine": {"name": eng_c.get("name"), "version": eng_c.get("version"),
                   "dtype": (eng_c.get("info") or {}).get("dtype"),
                   "dtype_reason": (eng_c.get("info") or {}).get("dtype_reason"),
                   "engine_args": suite.get("engine_args"), "max_model_len": suite.get("max_model_len"),
                   "kv_cache_gib": kv_gib,
                   "baseline": (baseline or {}).get("engine"), "candidate": eng_c},
        "hardware": context["hardware"],
        "workload": {**work, "prompt_tokens_total": sum(i["prompt_tokens"] for i in items),
                     "output_tokens_total": sum(i["output_tokens"] for i in items), "items": items,
                     "warmup_sent": {role: _warmup_sent(side) for role, side in (("baseline", baseline),
                                                                                 ("candidate", candidate)) if side}},
        "generation": {"speed": {"temperature": work["temperature"], "ignore_eos": True,
                                 "output_tokens": work["output_tokens"], "stream": True},
                       "perplexity": {"window_tokens": suite["perplexity_window"], "top_k": suite["logprobs_top_k"],
                                      "max_tokens_per_file": suite["perplexity_max_tokens"],
                                      "files": suite["perplexity_files"]},
                       "tasks": {"names": suite["tasks"], "limit": suite["task_limit"],
                                 "decoding": "as each task YAML says (greedy for generation tasks)"}},
        "suite": suite,
        "metrics": metrics,
        "recovery": recovered,
        "cost": {"price_per_hour": price, "baseline": cost_figures(baseline, price),
                 "candidate": cost_figures(candidate, price)},
        "where_the_wait_is": {role: where_the_wait_is(side, role, kv_gib)
                              for role, side in (("baseline", baseline), ("candidate", candidate)) if side},
        "checks": _checks_summary(baseline, candidate),
        "kv_cache": {role: (side or {}).get("kv_cache") for role, side in (("baseline", baseline), ("candidate", candidate))
                     if (side or {}).get("kv_cache")},
        "variants": [_strip_records(v) for v in variants],
        "carried_over": context.get("carried_over"),
        "details": {"baseline": _strip_records(baseline), "candidate": _strip_records(candidate)},
        "wall_s": context.get("wall_s"),
    }


def _checks_summary(baseline: dict | None, candidate: dict) -> dict:
    """Per check: what ran (items, errors, how the tools reached the model) and the quoted differences."""
    from quantkit.evaluate.probes.chat import quoted_differences

    out: dict = {}
    for name in ("tools", "safety", "generation"):
        sides = {role: ((side or {}).get("checks") or {}).get(name) for role, side in
                 (("baseline", baseline), ("candidate", candidate))}
        if not any(sides.values()):
            continue
        out[name] = {role: ({"error": c["error"]} if "error" in c else
                            {k: c.get(k) for k in ("items", "errors", "max_tokens", "tools_in") if k in c})
                     for role, c in sides.items() if c}
    if out:
        quotes = quoted_differences((baseline or {}).get("checks"), candidate.get("checks"))
        for name in out:
            out[name]["quoted"] = quotes.get(name, [])
    return out


def write_report(output: Path, context: dict, baseline: dict | None, candidate: dict, variants: list[dict]) -> dict:
    from quantkit.evaluate.plots import plot_latency, plot_quality, plot_throughput

    report = build_report(context, baseline, candidate, variants)
    plots = output / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    sides = {"baseline": baseline, "candidate": candidate}
    made = [p for p in (plot_latency(sides, plots / "latency.png"), plot_throughput(sides, plots / "throughput.png"),
                        plot_quality(report["metrics"], plots / "quality.png")) if p is not None]
    report["plots"] = [str(p.relative_to(output)) for p in made]
    atomic_write_json(output / REPORT_FILE, report)
    atomic_write_text(output / "report.md", render_markdown(report))
    return report


# ----------------------------------------------------------------------------------------- markdown
def _v(x: float | None, unit: str) -> str:
    if x is None:
        return "—"
    if unit == "bytes":
        return f"{x / 2**20:,.1f} MiB"
    if unit in ("fraction",):
        return f"{x:.3f}"
    if unit == "nats":
        return f"{x:.4f}"
    if unit in ("tokens", "requests", "count"):
        return f"{x:,.0f}"
    return f"{x:,.2f}" if abs(x) < 100 else f"{x:,.0f}"


def _ci(m: dict, role: str, unit: str) -> str:
    """' [low, high]' of a metric's 95% interval on one side (or of the ratio), '' where it has none."""
    iv = (m.get("ci95") or {}).get(role)
    if not iv:
        return ""
    fmt = (lambda x: f"{x:.3f}") if role == "ratio" else (lambda x: _v(x, unit))
    return f" [{fmt(iv[0])}, {fmt(iv[1])}]"


NO_RELATIVE = ("quality.engine_vs_reference", "quality.engine_gap")  # already relative: a % of a % says nothing


def _row(name: str, m: dict, label: str | None = None) -> str:
    d, rel = delta(m["baseline"], m["candidate"])
    rel = None if name in NO_RELATIVE else rel
    ds = "—" if d is None else (f"{d / 2**20:+,.1f} MiB" if m["unit"] == "bytes" else f"{d:+,.4g}")
    rs = "" if rel is None else f" ({rel:+.1%})"
    ratio = _ci(m, "ratio", m["unit"])
    rs += f"; ratio{ratio}" if ratio else ""
    arrow = "↑" if m["higher_is_better"] else "↓"
    return (f"| {label or name} {arrow} | {_v(m['baseline'], m['unit'])}{_ci(m, 'baseline', m['unit'])} | "
            f"{_v(m['candidate'], m['unit'])}{_ci(m, 'candidate', m['unit'])} | {ds}{rs} |")


def _table(metrics: dict, names: list[str], labels: dict | None = None) -> list[str]:
    rows = [_row(n, metrics[n], (labels or {}).get(n)) for n in names if n in metrics]
    if not rows:
        return ["(not measured)", ""]
    return ["| metric | baseline | candidate | Δ (candidate − baseline) |", "|---|---:|---:|---:|", *rows, ""]


def _reused(reused: dict | None) -> str:
    if not reused:
        return " (measured in this eval)"
    return (f" (**reused** from the cached measurement of {reused['from']}, same weights, suite, engine, dtype "
            f"and machine; its speed figures are from then; `--fresh-baseline` measures anew)")


def _reference_lines(r: dict) -> list[str]:
    """What the reference column is, and a flag when the candidate loses more in the engine than outside it."""
    from quantkit.evaluate.reference import ENGINE_GAP_FLAG

    refs = {role: ((r["details"].get(role) or {}).get("reference")) for role in ("baseline", "candidate")}
    if not any(refs.values()):
        return []
    L = []
    for role, ref in refs.items():
        if isinstance(ref, dict) and ("skipped" in ref or "error" in ref):
            L.append(f"Reference perplexity of the {role}: not computed ({ref.get('skipped') or ref.get('error')}).")
    done = next((x for x in (refs["candidate"], refs["baseline"]) if isinstance(x, dict) and "perplexity" in x), None)
    if done:
        L.append(f"Reference: the same {done.get('tokens') or 0:,} scored tokens, computed engine-free "
                 f"({done.get('engine')}, {done.get('dtype')}). engine_vs_reference = engine / reference − 1 per model; engine_gap = how much "
                 "more the candidate degrades in the engine than in the reference "
                 "((engine_c / engine_b) / (reference_c / reference_b) − 1; quantkit/evaluate/reference.py).")
    gap = (r["metrics"].get("quality.engine_gap") or {}).get("candidate")
    if isinstance(gap, (int, float)) and gap > ENGINE_GAP_FLAG:
        L.append(f"**Flag: the candidate loses {gap:.1%} more perplexity in the engine than the same weights lose in "
                 f"the reference (above {ENGINE_GAP_FLAG:.0%}).** Part of its measured loss comes from how the engine "
                 "reads the export or computes it, not from the quantization alone; gate it with "
                 "`quality.engine_gap`.")
    return L + [""] if L else []


def _checks_markdown(r: dict) -> list[str]:
    """The tool-call and safety sections: rates with intervals, then the differences quoted."""
    m, checks = r["metrics"], r.get("checks") or {}
    L: list[str] = []

    def ran(name: str) -> str:
        parts = []
        for role, c in checks[name].items():
            if role == "quoted":
                continue
            if "error" in c:
                parts.append(f"{role}: failed ({c['error']})")
            else:
                extra = f", tools in the {c['tools_in']}" if c.get("tools_in") else ""
                parts.append(f"{role}: {c.get('items')} items, {c.get('errors')} request errors{extra}")
        return "; ".join(parts)

    if "tools" in checks:
        L += ["## Tool calls", "", f"Chat requests with tool schemas (evals/data/qk_tools.jsonl), greedy, "
              f"{ran('tools')}. Gateable: valid rate (a call parsed where one was expected, none where none was) "
              "and agreement with the baseline's call (same tool, same arguments); the small demo model's "
              "absolute accuracy is reported, not gated.", ""]
        L += _table(m, ["tools.valid_rate", "tools.baseline_agreement", "tools.name_accuracy", "tools.exact_accuracy"])
        q = checks["tools"].get("quoted") or []
        if q:
            L += ["Where the candidate's call differs from the baseline's (first of them):", ""]
            L += [f"- `{x['id']}` {x['request']!r}: baseline {x['baseline']!r} → candidate {x['candidate']!r}" for x in q]
            L.append("")
    if "safety" in checks:
        L += ["## Safety", "", f"Prompts a deployed assistant should decline (harmful, written abstractly) and "
              f"benign look-alikes (evals/data/qk_safety.jsonl), greedy, {ran('safety')}. Refusal is decided by "
              "documented phrase rules (quantkit/evaluate/check_rules.py). A flip is a prompt where candidate and "
              "baseline disagree on refuse vs answer.", ""]
        L += _table(m, ["safety.flip_rate", "safety.refusal_rate_harmful", "safety.refusal_rate_benign"])
        q = checks["safety"].get("quoted") or []
        if q:
            L += ["Flips (worst first: a harmful prompt the baseline refused and the candidate answers):", ""]
            for x in q:
                verdict = lambda refused: "refuses" if refused else "answers"  # noqa: E731
                L += [f"- `{x['id']}` ({x['kind']}) {x['prompt']!r}", f"  - baseline {verdict(x['baseline_refused'])}: "
                      f"{x['baseline']!r}", f"  - candidate {verdict(x['candidate_refused'])}: {x['candidate']!r}"]
            L.append("")
    return L


def _generation_markdown(r: dict) -> list[str]:
    """The generation sanity check: degenerate greedy replies per side, and the candidate's new ones quoted."""
    g = (r.get("checks") or {}).get("generation")
    if not g:
        return []
    ran = "; ".join(f"{role}: " + (f"failed ({c['error']})" if "error" in c else f"{c.get('items')} prompts, "
                                   f"{c.get('errors')} request errors") for role, c in g.items() if role != "quoted")
    L = ["## Generation sanity", "", f"Everyday chat prompts (evals/data/qk_generation.jsonl), greedy, {ran}. A reply "
         "is degenerate when it is empty, loops (its second half repeats a short phrase) or is not text "
         "(quantkit/evaluate/check_rules.py). The gate asks for no more degenerate replies than the baseline's.", ""]
    L += _table(r["metrics"], ["generation.degenerate_rate", "generation.degenerate_excess"])
    if g.get("quoted"):
        L += ["Degenerate in the candidate, fine in the baseline:", ""]
        L += [f"- `{x['id']}` {x['prompt']!r} ({x['why']}): {x['candidate']!r}" for x in g["quoted"]]
        L.append("")
    return L


def _kv_cache_lines(r: dict) -> list[str]:
    """What the KV cache of each side was: the export's FP8 scheme served or not, and why."""
    L = []
    for role, kv in (r.get("kv_cache") or {}).items():
        scheme = kv.get("scheme") or {}
        how = {True: "served with the FP8 (e4m3) cache (kv_cache_dtype fp8)",
               False: "**not** served with the FP8 cache here, so the figures of this report do not include it",
               None: "as the suite's engine_args set it"}[kv.get("fp8_cache_served")]
        L.append(f"KV cache of the {role}: the export declares an FP8 KV-cache scheme (strategy "
                 f"{scheme.get('strategy')}, static scales); {how}: {kv.get('reason')}. kv_cache_tokens is the "
                 "engine's own figure for the same KV-cache memory on both sides.")
    return L + [""] if L else []


def _cost_lines(r: dict) -> list[str]:
    """Cost per thousand successful tasks in machine-seconds (always), and in USD where the suite has a price."""
    c = r["cost"]
    price = c.get("price_per_hour")
    at = (f"at each model's highest-throughput level (baseline {(c.get('baseline') or {}).get('level')}, candidate "
          f"{(c.get('candidate') or {}).get('level')})")
    L = ["## Cost", "", (f"At ${price}/hour, {at}." if price is not None else
                         f"In machine-seconds, {at}; give the suite a `price_per_hour` for USD."), ""]
    names = ["cost.machine_s_per_k_successful_tasks"]
    if price is not None:
        names += ["cost.usd_per_mtok_output", "cost.usd_per_k_successful_tasks"]
    return L + _table(r["metrics"], names)


def _incomplete_lines(r: dict) -> list[str]:
    """A banner for a report some phase of which failed: its figures are not evidence, and gates refuse it."""
    if not r.get("incomplete"):
        return []
    return ["", "**INCOMPLETE: these phases failed, so the gates refuse this report (fix the cause and re-run the "
                "eval):**", *[f"- {why}" for why in r["incomplete"]], ""]


def render_markdown(r: dict) -> str:
    L = _header_lines(r) + _quality_lines(r) + _tasks_lines(r) + _checks_markdown(r) + _generation_markdown(r)
    L += _memory_lines(r) + _speed_lines(r) + _cost_lines(r) + _wait_lines(r) + _variant_lines(r)
    if r.get("plots"):
        L += ["## Plots", ""] + [f"![{Path(p).stem}]({p})" for p in r["plots"]] + [""]
    L += ["## Repeatability", "", "Rerun with the same artifact, suite and engine version; the seeded workload, prompts "
          "(token ids), output lengths and task files are identical by construction. All settings are in report.json "
          "(`suite`, `workload`, `generation`, `engine`, `hardware`); engine logs are in logs/, per-request timings in raw/.", ""]
    return "\n".join(L)


def _header_lines(r: dict) -> list[str]:
    """Title, what was compared on what, and the incomplete banner."""
    a, hw, eng = r["artifact"], r["hardware"], r["engine"]
    stages = ", ".join(s["method"] + (f"/{s['scheme']}" if s.get("scheme") else "") for s in ((a.get("quantization") or {}).get("stages") or []))
    L = [f"# quantkit eval: {a.get('name')}", "",
         f"- candidate: `{a.get('path')}` ({stages or 'scheme n/a'}, format {(a.get('quantization') or {}).get('format', 'n/a')})",
         f"- baseline: `{(r['baseline'] or {}).get('path') or (r['baseline'] or {}).get('url')}`"
         + (f", {r['baseline']['description']}" if (r["baseline"] or {}).get("description") else "")  # what it is
         + _reused((r["baseline"] or {}).get("reused")),
         f"- engine: {eng.get('name')} {eng.get('version') or ''}, dtype {eng.get('dtype')} ({eng.get('dtype_reason') or ''}), "
         f"max_model_len {eng.get('max_model_len')}, KV cache {eng.get('kv_cache_gib')} GiB, extra args {eng.get('engine_args') or {}}",
         f"- hardware: {hw.get('cpu')}, {hw.get('cpu_count')} cores, CPU flags {' '.join(hw.get('cpu_flags') or []) or 'n/a'}, "
         f"{hw.get('memory_bytes', 0) / 2**30:.0f} GiB RAM, GPU {hw.get('gpu') or 'none'}",
         f"- suite `{r['suite']['suite']}`; eval wall time {r.get('wall_s') or 0:.0f} s; report schema {r['schema']}"]
    L += _incomplete_lines(r)
    if r.get("carried_over"):
        L.append(f"- a serving variant: speed and memory measured under these engine settings; "
                 f"{r['carried_over']['what']} carried over from `{r['carried_over']['from']}`")
    return L + ["", "↑ higher is better, ↓ lower is better. Δ% is relative to the baseline.", ""]


def _quality_lines(r: dict) -> list[str]:
    m = r["metrics"]
    L = ["## Quality", ""]
    L += _table(m, ["quality.perplexity", "quality.reference_perplexity", "quality.engine_vs_reference",
                    "quality.engine_gap", "quality.top1_agreement", "quality.kl_mean", "quality.kl_p99"],
                {"quality.perplexity": "quality.perplexity (engine)"})
    L.append("KL is KL(baseline ‖ candidate) per token on the baseline's top-k log-probabilities plus one "
             "\"rest\" bucket (a lower bound of the full KL; see quantkit/evaluate/quality.py).")
    L.append("")
    L += _reference_lines(r)
    if any(m[n].get("ci95") for n in m):
        L += [f"[low, high] beside a value is its 95% confidence interval, and \"ratio [low, high]\" that of "
              f"candidate / baseline: {CI_DESCRIPTION}. A value without one had too few windows or items, or the "
              "measurement predates intervals (quantkit/evaluate/confidence.py).", ""]
    return L


def _tasks_lines(r: dict) -> list[str]:
    m = r["metrics"]
    task_names = sorted(n for n in m if n.startswith("tasks."))
    if not task_names:
        return []
    L = ["### Tasks (lm-eval)", "", "| task metric | baseline | candidate | Δ | recovery |", "|---|---:|---:|---:|---:|"]
    for n in task_names:
        d, _ = delta(m[n]["baseline"], m[n]["candidate"])
        rec = r["recovery"].get(n)
        L.append(f"| {n[6:]} | {_v(m[n]['baseline'], 'fraction')}{_ci(m[n], 'baseline', 'fraction')} | "
                 f"{_v(m[n]['candidate'], 'fraction')}{_ci(m[n], 'candidate', 'fraction')} | "
                 f"{'—' if d is None else f'{d:+.3f}'} | {'—' if rec is None else f'{rec:.1%}'} |")
    return L + [""]


def _memory_lines(r: dict) -> list[str]:
    L = ["## Memory", ""]
    L += _table(r["metrics"], ["memory.engine_bytes", "memory.checkpoint_bytes", "memory.weight_bytes",
                               "memory.kv_cache_tokens", "memory.peak_rss_bytes", "memory.peak_pss_bytes",
                               "memory.peak_hwm_bytes",
                               "memory.peak_gpu_bytes", "memory.gpu_util_mean"])
    L += _kv_cache_lines(r)
    src = ((r["details"].get("candidate") or {}).get("memory") or {}).get("weight_bytes_source")
    if src:
        L += [f"Weight memory source: {src}. Peak RSS sums the engine's processes (shared pages counted in each); "
              "PSS splits shared pages.", ""]
    return L


SPEED_ROWS = ("ttft_ms_p50", "ttft_ms_p90", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p90", "tpot_ms_p99", "itl_ms_p50",
              "itl_ms_p99", "e2e_ms_p50", "e2e_ms_p99", "output_tok_s", "requests_s", "failed", "queue_ms_mean",
              "kv_cache_usage_max", "preemptions")


def _speed_lines(r: dict) -> list[str]:
    m, w = r["metrics"], r["workload"]
    levels = sorted({n.split(".")[1] for n in m if n.startswith("speed.") and n.count(".") == 2},
                    key=lambda s: (s[0] != "c", float(s[1:])))
    L = ["## Speed", "",
         f"Workload: {w['num_requests']} requests per level, prompt {w['prompt_tokens'][0]}–{w['prompt_tokens'][1]} tokens, "
         f"output {w['output_tokens'][0]}–{w['output_tokens'][1]} tokens (forced, ignore_eos), temperature {w['temperature']}, "
         f"seed {w['seed']}, prefix cache emptied per level. {_warmup_line(w)}", ""]
    for lvl in levels:
        kind = f"concurrency {lvl[1:]}" if lvl[0] == "c" else f"{lvl[1:]} requests/s (Poisson)"
        L += [f"### {lvl}: {kind}", ""]
        names = [f"speed.{lvl}.{x}" for x in SPEED_ROWS]
        L += _table(m, names, {n: n.split(".", 2)[2] for n in names})
    return L


def _wait_lines(r: dict) -> list[str]:
    L = ["## Where the wait is", ""]
    for role, lines in r["where_the_wait_is"].items():
        L += [f"**{role}**", "", *[f"- {x}" for x in lines], ""]
    return L


def _variant_lines(r: dict) -> list[str]:
    if not r["variants"]:
        return []
    L = ["## Serving variants (candidate, one setting changed)", "",
         "| variant | engine args | level | TTFT p50 ms | TPOT p50 ms | output tok/s | failed |", "|---|---|---|---:|---:|---:|---:|"]
    for v in r["variants"]:
        for lvl, s in (v.get("speed") or {}).items():
            L.append(f"| {v['variant']['name']} | `{v['variant']['engine_args']}` | {lvl} | {_v(s.get('ttft_ms_p50'), 'ms')} | "
                     f"{_v(s.get('tpot_ms_p50'), 'ms')} | {_v(s.get('output_tok_s'), 'tok/s')} | {s.get('failed')} |")
    return L + [""]
