"""The model card (README.md) a published version carries: what it is, how good, how to serve it.

Rendered only from the manifest, the eval report and the gate result, so every number on the card can be
traced to a file that travels with it. "Recovery" is normalised so that 1.0 means "as good as the
baseline" and below 1.0 means worse, whichever direction the metric prefers: candidate / baseline when
higher is better (accuracy, agreement, tokens/s), baseline / candidate when lower is better (perplexity,
latency, bytes). Metrics without both values show "-" rather than a guess.

The YAML front matter follows the Hugging Face model-card convention (tags, library) so the same card
works as a Hub README; `base_model` is only written when the base looks like a hub id (org/name).
"""

from __future__ import annotations

import json
import re

import yaml

from quantkit.evaluate.metrics import fmt_value, recovery

SERVE_CMD = "python -m vllm.entrypoints.openai.api_server --model {dir} --host 127.0.0.1 --port 8000"
_FAMILY_ORDER = ("quality", "tasks", "memory", "speed", "cost")


def _sort_key(name: str) -> tuple:
    fam = name.split(".", 1)[0]
    return (_FAMILY_ORDER.index(fam) if fam in _FAMILY_ORDER else len(_FAMILY_ORDER), name)


def eval_table(report: dict | None) -> str:
    if not report or not report.get("metrics"):
        return "_No evaluation report was attached._\n"
    lines = ["| metric | unit | baseline | candidate | recovery |", "|---|---|---:|---:|---:|"]
    for name in sorted(report["metrics"], key=_sort_key):
        m = report["metrics"][name] or {}
        lines.append(f"| {name} | {m.get('unit', '')} | {fmt_value(m.get('baseline'))} | {fmt_value(m.get('candidate'))} "
                     f"| {fmt_value(recovery(m))} |")
    return "\n".join(lines) + "\n\nRecovery: 1.0 = as good as the baseline, below 1.0 = worse (direction-aware).\n"


def gate_table(gate: dict | None) -> str:
    if not gate:
        return "_No gate result was attached._\n"
    lines = [f"**{gate.get('summary', '?')}** (gates from {gate.get('source', '?')})", "",
             "| gate | compared | result | reason |", "|---|---:|---|---|"]
    for g in gate.get("gates", []):
        lines.append(f"| {g['name']} | {fmt_value(g.get('value'))} | {'pass' if g.get('passed') else 'FAIL'} "
                     f"| {g.get('reason', '')} |")
    return "\n".join(lines) + "\n"


def _named(path: str, description: str | None) -> str:
    """`path`, plus what it holds where that is recorded (e.g. a demo model dequantized from a GGUF)."""
    return f"`{path}`" + (f", {description}" if description else "")


def _baseline_line(report: dict | None, base: dict) -> str:
    """Which model the evaluation compared against: the report's baseline, with its description (recorded
    by `quantkit eval`, else the manifest's base-model description when the baseline is that folder)."""
    b = (report or {}).get("baseline") or {}
    where = b.get("path") or b.get("url")
    if not where:
        return ""
    desc = b.get("description")
    if not desc and b.get("path") and b.get("path") == base.get("resolved_dir"):
        desc = base.get("description")
    return f"Baseline: {_named(where, desc)}.\n\n"


def _front_matter(man: dict) -> str:
    stages = (man.get("quantization") or {}).get("stages") or []
    tags = ["quantkit", "compressed-tensors", "vllm"] + sorted({(s.get("scheme") or "").lower() for s in stages} - {""})
    meta: dict = {"library_name": "vllm", "tags": tags, "quantized_by": "quantkit"}
    base = (man.get("base_model") or {}).get("path", "")
    if re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", base) and not base.startswith((".", "/")):
        meta["base_model"] = base
    return "---\n" + yaml.safe_dump(meta, sort_keys=False) + "---\n"


def render_card(manifest: dict, report: dict | None = None, gate: dict | None = None,
                name: str | None = None, version: str | None = None, registry: str | None = None) -> str:
    man = manifest
    title = name or man.get("name", "quantized model")
    q = man.get("quantization") or {}
    stages = q.get("stages") or []
    cal = man.get("calibration")
    conv = man.get("conversion") or {}
    base = man.get("base_model") or {}
    scheme_txt = " then ".join(f"{s.get('method')}" + (f" / {s['scheme']}" if s.get("scheme") else "")
                               for s in stages) or "-"
    rows = [
        ("base model", _named(base.get("path", "-"), base.get("description"))),
        ("base model fingerprint", f"`{base.get('fingerprint', '-')}`"),
        ("method / scheme", scheme_txt),
        ("format", q.get("format", "-")),
        ("modules quantized", fmt_value(q.get("modules_quantized"))),
        ("modules kept in full precision", ", ".join(q.get("modules_kept") or []) or "-"),
        ("calibration", "none (data-free)" if not cal else
         f"{cal.get('num_samples')} x {cal.get('seq_len')} tokens, fingerprint `{cal.get('fingerprint')}`"),
        ("checkpoint size", f"{man.get('size_bytes', 0) / 1e6:.1f} MB"),
        ("conversion", f"{conv.get('wall_time_s', '-')} s, peak RSS {conv.get('peak_rss_bytes', 0) / 1e9:.2f} GB"),
        ("recipe sha256", f"`{man.get('recipe_sha256', '-')}`"),
        ("created", man.get("created", "-")),
        ("versions", ", ".join(f"{k} {v}" for k, v in sorted((man.get("versions") or {}).items())
                               if k != "platform")),
    ]
    header = f"# {title}" + (f" (version {version})" if version else "")
    details = "\n".join(["| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows])
    recipe_yaml = yaml.safe_dump(man.get("recipe") or {}, sort_keys=False)
    return "\n".join([
        _front_matter(man), header, "",
        f"{man.get('recipe', {}).get('description') or 'A quantized checkpoint'}, produced by quantkit from "
        f"{_named(base.get('path', '?'), base.get('description'))}. A compressed-tensors checkpoint that vLLM "
        "loads directly.", "",
        "## Quantization", "", details, "",
        "## Evaluation", "", _baseline_line(report, base) + eval_table(report),
        "## Gates", "", gate_table(gate),
        "## Serve it with vLLM", "",
        "```bash",
        f"quantkit registry pull {title} {version or 'production'} ./model"
        + (f" --registry {registry}" if registry else "") + "   # verifies every sha256",
        SERVE_CMD.format(dir="./model"),
        "```", "",
        "The folder is also a plain Hugging Face checkpoint; `manifest.json` lists every file's sha256 "
        "(check with `quantkit inspect ./model`).", "",
        "## Recipe", "", "```yaml", recipe_yaml.rstrip(), "```", "",
        "<details><summary>manifest summary (JSON)</summary>", "", "```json",
        json.dumps({k: man.get(k) for k in ("name", "schema", "recipe_sha256", "quantization", "calibration")},
                   indent=2),
        "```", "</details>", "",
    ])
