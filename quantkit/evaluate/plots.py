"""PNG plots of a report (matplotlib, Agg backend: no display needed).

- latency.png: TTFT / TPOT / ITL / E2E p50, p90, p99 against concurrency, baseline dashed, candidate solid.
- throughput.png: output tokens/s and requests/s against concurrency.
- quality.png: task scores side by side, plus perplexity and top-1 agreement.
Only closed-loop levels (c<N>) are plotted against concurrency.
"""

from __future__ import annotations

from pathlib import Path

_COLORS = {"baseline": "#7f7f7f", "candidate": "#1f77b4"}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _levels(side: dict | None) -> list[tuple[int, dict]]:
    speed = (side or {}).get("speed") or {}
    return sorted((int(k[1:]), v) for k, v in speed.items() if k.startswith("c"))


def plot_latency(sides: dict[str, dict | None], path: Path) -> Path | None:
    if not any(_levels(s) for s in sides.values()):
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.8))
    for ax, m, title in zip(axes, ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"), ("TTFT", "TPOT", "ITL", "E2E latency")):
        for role, side in sides.items():
            lv = _levels(side)
            if not lv:
                continue
            xs = [c for c, _ in lv]
            for p, mk in ((50, "o"), (90, "s"), (99, "^")):
                ys = [s.get(f"{m}_p{p}") for _, s in lv]
                ax.plot(xs, [float("nan") if y is None else y for y in ys], marker=mk, color=_COLORS.get(role),
                        linestyle="--" if role == "baseline" else "-", label=f"{role} p{p}")
        ax.set_title(title)
        ax.set_xticks(sorted({c for side in sides.values() for c, _ in _levels(side)}))
        ax.set_xlabel("concurrency")
        ax.set_ylabel("ms")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_throughput(sides: dict[str, dict | None], path: Path) -> Path | None:
    if not any(_levels(s) for s in sides.values()):
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, m, unit in zip(axes, ("output_tok_s", "requests_s"), ("output tokens/s", "requests/s")):
        for role, side in sides.items():
            lv = _levels(side)
            if lv:
                ax.plot([c for c, _ in lv], [s.get(m) or 0.0 for _, s in lv], marker="o", color=_COLORS.get(role),
                        linestyle="--" if role == "baseline" else "-", label=role)
        ax.set_xticks(sorted({c for side in sides.values() for c, _ in _levels(side)}))
        ax.set_xlabel("concurrency")
        ax.set_ylabel(unit)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_quality(metrics: dict[str, dict], path: Path) -> Path | None:
    tasks = [k for k in metrics if k.startswith("tasks.") and k.count(".") == 2 and not k.endswith("acc_norm")]
    extra = [k for k in ("quality.top1_agreement",) if k in metrics]
    names = tasks + extra
    has_ppl = "quality.perplexity" in metrics
    if not names and not has_ppl:
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), gridspec_kw={"width_ratios": [max(1, len(names)), 1]})
    ax = axes[0]
    width = 0.38
    for i, role in enumerate(("baseline", "candidate")):
        vals = [metrics[n][role] if metrics[n][role] is not None else 0.0 for n in names]
        ax.bar([j + (i - 0.5) * width for j in range(len(names))], vals, width, label=role, color=_COLORS[role])
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels([n.split(".", 1)[1] for n in names], rotation=20, fontsize=8)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("score")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    ax2 = axes[1]
    if has_ppl:
        m = metrics["quality.perplexity"]
        ax2.bar([0, 1], [m["baseline"] or 0.0, m["candidate"] or 0.0], color=[_COLORS["baseline"], _COLORS["candidate"]])
        ax2.set_xticks([0, 1])
        ax2.set_xticklabels(["baseline", "candidate"])
        ax2.set_title("perplexity (lower is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
