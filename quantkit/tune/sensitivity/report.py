"""sensitivity.json, sensitivity.md and the plots."""

from __future__ import annotations

from pathlib import Path

from quantkit.errors import human_bytes
from quantkit.io import atomic_write_json, atomic_write_text
from quantkit.tune.sensitivity.units import PROXIES


def write_report(out: Path, result: dict, plot: bool = True) -> list[Path]:
    """sensitivity.json, sensitivity.md and the plots."""
    atomic_write_json(out / "sensitivity.json", result)
    plots = _plots(out, result) if plot else []
    atomic_write_text(out / "sensitivity.md", render_markdown(result, plots))
    return [out / "sensitivity.json", out / "sensitivity.md", *plots]


def render_markdown(r: dict, plots: list[Path]) -> str:
    v, c = r.get("validation") or {}, r["choice"]
    lines = [f"# Sensitivity: {r['recipe']}", "",
             f"Low scheme {r['low_scheme']} ({r['method']}), high {r['high_scheme']}; {len(r['units'])} units "
             f"(modules the engine fuses), {r['facts']['calibration_tokens']} calibration tokens, "
             f"{r['facts']['seconds']} s ({r['facts']['device']}, {r['facts']['compute_dtype']}).", "",
             "## Choice", "",
             f"Budget `{c['budget']}`: {'met' if c['met'] else '**not met**'}; {len(c['kept'])} units kept high.", "",
             "| | uniform low | mixed | uniform high |", "|---|---:|---:|---:|"]
    ends = r["ends"]
    lines.append(f"| checkpoint | {human_bytes(ends['low']['checkpoint_bytes'])} | {human_bytes(c['checkpoint_bytes'])} | "
                 f"{human_bytes(ends['high']['checkpoint_bytes'])} |")
    lines.append(f"| summed layer error | {ends['low']['error']:.4g} | {c['error']:.4g} | {ends['high']['error']:.4g} |")
    if c.get("predicted_kl") is not None:
        lines.append(f"| predicted KL | {ends['low']['predicted_kl']:.4f} | {c['predicted_kl']:.4f} | "
                     f"{ends['high']['predicted_kl']:.4f} |")
    if v.get("measured"):
        m = v["measured"]
        lines.append(f"| measured KL (transformers fp32) | {_f(m.get('low'))} | {_f(m.get('mixed'))} | {_f(m.get('high'))} |")
    if c.get("predicted_tpot_ms") is not None:
        lines.append(f"| TPOT (engine ends, interpolated) | {ends['low']['predicted_tpot_ms']:.2f} ms | "
                     f"{c['predicted_tpot_ms']:.2f} ms | {ends['high']['predicted_tpot_ms']:.2f} ms |")
    lines += ["", f"Recipe: `{r['recipe_path']}`", ""]
    if v:
        lines += ["## Validation against the full-model KL", "",
                  f"{len(v['units'])} units spread over the ranking, each quantized alone in the full model "
                  f"({v['tokens']} held-out tokens). Rank correlation (Spearman) with the proxy: "
                  + ", ".join(f"{p} {_f(x, '.3f')}" for p, x in (v.get("spearman_by_proxy") or {}).items())
                  + f"; used: **{v.get('proxy')}** ({PROXIES.get(v.get('proxy'), '')}). "
                  f"KL factor {_f(v.get('kl_factor'), '.4g')} per unit of proxy error.", ""]
    lines += ["## Ranking (most sensitive first)", "", "| unit | error low | error high | KL alone | bytes added | kept |",
              "|---|---:|---:|---:|---:|:-:|"]
    kept = set(c["kept"])
    for u in sorted(r["units"], key=lambda u: -u["error_low"])[:40]:
        lines.append(f"| {u['name']} | {u['error_low']:.3g} | {u['error_high']:.3g} | {_f(u.get('kl_low'), '.4g')} | "
                     f"{human_bytes(u['bytes_high'] - u['bytes_low'])} | {'yes' if u['name'] in kept else ''} |")
    if len(r["units"]) > 40:
        lines.append(f"| ... {len(r['units']) - 40} more in sensitivity.json | | | | | |")
    lines += [""] + [f"![{p.stem}]({p.name})" for p in plots]
    return "\n".join(lines) + "\n"


def _f(x, fmt: str = ".4f") -> str:
    return "n/a" if x is None else format(x, fmt)


def _plots(out: Path, r: dict) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover (matplotlib is a dependency)
        return []
    paths = []
    units = r["units"]
    kinds = sorted({u["name"].split(".", 1)[1] for u in units})
    fig, ax = plt.subplots(figsize=(9, 4))
    for k in kinds:
        pts = [(u["layer"], u["error_low"]) for u in units if u["name"].split(".", 1)[1] == k]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=k)
    ax.set_yscale("log")
    ax.set_xlabel("decoder layer")
    ax.set_ylabel("layer-output error, unit alone at low scheme")
    ax.set_title(f"{r['recipe']}: sensitivity by layer")
    ax.legend(fontsize=7)
    fig.tight_layout()
    p = out / "sensitivity_by_layer.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)
    v = r.get("validation") or {}
    pts = [(u["error_low"], u["kl_low"]) for u in units if u.get("kl_low") is not None and u["kl_low"] > 0]
    if len(pts) >= 2:
        fig, ax = plt.subplots(figsize=(5, 4))
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=14)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("layer-output error (proxy)")
        ax.set_ylabel("full-model KL, unit alone")
        ax.set_title(f"proxy vs KL: Spearman {_f(v.get('spearman'), '.2f')}")
        fig.tight_layout()
        p = out / "proxy_vs_kl.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)
    return paths
