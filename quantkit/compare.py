"""`quantkit compare REPORT...`: two or more evals of one baseline on one page, to choose what to serve.

The page (compare.md) has one row per candidate (size, quality against the baseline, latency, throughput, cost per
thousand successful tasks, the gate's verdict) and three plots: quality against cost, latency percentiles, per-task
recovery. Reports of different baselines are refused: their ratios would not be comparable.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from quantkit.errors import QuantkitError
from quantkit.evaluate.plots import _plt  # the one Agg-backed pyplot (tune/report.py uses it too)
from quantkit.io import atomic_write_text

_PCTS = ("p50", "p90", "p99")


class CompareError(QuantkitError):
    pass


@dataclass
class Entry:
    name: str
    path: Path
    report: dict
    verdict: str

    def metric(self, name: str, side: str = "candidate"):
        return ((self.report.get("metrics") or {}).get(name) or {}).get(side)

    def ratio(self, name: str) -> float | None:
        b, c = self.metric(name, "baseline"), self.metric(name)
        return c / b if isinstance(b, (int, float)) and isinstance(c, (int, float)) and b else None


def load(paths: list[Path]) -> list[Entry]:
    """The reports (a report.json, or an artifact / eval folder), checked to share one baseline."""
    from quantkit.gates import gate_path, resolve_report_path

    if len(paths) < 2:
        raise CompareError("compare: give two or more reports (report.json, or the artifact / eval folders)")
    entries = []
    for p in paths:
        rp = resolve_report_path(p)
        rep = json.loads(rp.read_text())
        gp = gate_path(rp)
        verdict = json.loads(gp.read_text()).get("summary", "?") if gp.is_file() else "not gated"
        entries.append(Entry((rep.get("artifact") or {}).get("name") or rp.parent.parent.name, rp, rep, verdict))
    bases = {(e.report.get("baseline") or {}).get("path") for e in entries}
    if len(bases) != 1:
        raise CompareError(f"compare: the reports have different baselines ({sorted(map(str, bases))}); compare evals "
                           "of one baseline, whose ratios mean the same thing")
    return entries


def _fmt(v, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}g}" if isinstance(v, float) else str(v)


def table(entries: list[Entry]) -> list[str]:
    head = ("| candidate | verdict | weights MB | ppl ratio | top-1 | task recovery | TPOT p50 ratio | peak tok/s ratio "
            "| s per 1k successful tasks (base → cand) |")
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for e in entries:
        wb = e.metric("memory.weight_bytes")
        cost = (e.metric("cost.machine_s_per_k_successful_tasks", "baseline"),
                e.metric("cost.machine_s_per_k_successful_tasks"))
        lines.append(f"| {e.name} | {e.verdict} | {_fmt(wb / 1e6 if wb else None, 4)} | "
                     f"{_fmt(e.ratio('quality.perplexity'))} | {_fmt(e.metric('quality.top1_agreement'))} | "
                     f"{_fmt((e.report.get('recovery') or {}).get('tasks.mean_acc'))} | "
                     f"{_fmt(e.ratio('speed.decode_tpot_ms_p50'))} | {_fmt(e.ratio('speed.peak_output_tok_s'))} | "
                     f"{_fmt(cost[0], 4)} → {_fmt(cost[1], 4)} |")
    return lines


def plot_quality_cost(entries: list[Entry], path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    base_cost = entries[0].metric("cost.machine_s_per_k_successful_tasks", "baseline")
    if base_cost is not None:
        ax.scatter([base_cost], [1.0], marker="s", color="#7f7f7f", label="baseline")
    for e in entries:
        x, y = e.metric("cost.machine_s_per_k_successful_tasks"), (e.report.get("recovery") or {}).get("tasks.mean_acc")
        if x is not None and y is not None:
            ax.scatter([x], [y], s=60, label=f"{e.name} ({e.verdict})")
            ax.annotate(e.name, (x, y), textcoords="offset points", xytext=(5, 5), fontsize=8)
    ax.set_xlabel("machine seconds per 1k successful tasks (lower is cheaper)")
    ax.set_ylabel("task recovery vs baseline (higher is better)")
    ax.set_title("Quality against cost")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _lowest_level(e: Entry) -> str | None:
    levels = sorted({int(k.split(".")[1][1:]) for k in (e.report.get("metrics") or {})
                     if k.startswith("speed.c") and k.split(".")[1][1:].isdigit()})
    return f"c{levels[0]}" if levels else None


def plot_latency(entries: list[Entry], path: Path) -> Path:
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    rows = [("baseline", entries[0], "baseline")] + [(e.name, e, "candidate") for e in entries]
    width = 0.8 / len(rows)
    for ax, what in zip(axes, ("ttft_ms", "tpot_ms")):
        for i, (label, e, side) in enumerate(rows):
            lv = _lowest_level(e)
            ys = [e.metric(f"speed.{lv}.{what}_{p}", side) or 0.0 for p in _PCTS] if lv else [0.0] * 3
            ax.bar([j + i * width for j in range(3)], ys, width, label=label,
                   color="#7f7f7f" if side == "baseline" else None)
        ax.set_xticks([j + width * (len(rows) - 1) / 2 for j in range(3)], list(_PCTS))
        ax.set_title(f"{what.split('_')[0].upper()} (ms, lowest concurrency; lower is better)")
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_recovery(entries: list[Entry], path: Path) -> Path:
    plt = _plt()
    names = sorted({k for e in entries for k in (e.report.get("recovery") or {}) if k.count(".") >= 2})
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(names) + 2), 4))
    width = 0.8 / len(entries)
    for i, e in enumerate(entries):
        rec = e.report.get("recovery") or {}
        ax.bar([j + i * width for j in range(len(names))], [rec.get(n) or 0.0 for n in names], width, label=e.name)
    ax.axhline(1.0, color="#7f7f7f", linestyle="--", linewidth=1)
    ax.set_xticks([j + width * (len(entries) - 1) / 2 for j in range(len(names))],
                  [n.removeprefix("tasks.") for n in names], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("candidate / baseline")
    ax.set_title("Per-task recovery (1 = as good as the baseline)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write(entries: list[Entry], out: Path) -> Path:
    """compare.md and its plots in `out`; returns the markdown's path."""
    plots = out / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    figs = [plot_quality_cost(entries, plots / "quality_cost.png"), plot_latency(entries, plots / "latency.png"),
            plot_recovery(entries, plots / "recovery.png")]
    base = entries[0].report.get("baseline") or {}
    lines = [f"# {len(entries)} candidates against one baseline", "",
             f"Baseline: {base.get('description') or base.get('path')}", "", *table(entries), "",
             "Ratios are candidate / baseline from each eval; the verdict is the candidate's gate.json.", ""]
    lines += [f"![{f.stem}](plots/{f.name})" for f in figs]
    lines += ["", "Reports:", *[f"- {e.name}: `{e.path}`" for e in entries]]
    md = out / "compare.md"
    atomic_write_text(md, "\n".join(lines) + "\n")
    return md
