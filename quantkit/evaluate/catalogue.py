"""The metric catalogue: every metric a report carries, defined once (name pattern, unit, direction, family,
interval kind, and the probe that fills it). A leaf: it imports nothing of quantkit, so the recipe schema,
the gates, the report and the probes all read it without reaching into each other.

A probe yields (name, value) pairs and nothing else; unit and direction come from here, so a name missing
from the catalogue fails the report (`metric`) instead of reaching it unlabelled. Adding a metric: one
entry here plus the line in its probe's `values` that fills it (docs/evaluation.md).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

HIGHER, LOWER = True, False
BOOTSTRAP, WILSON = "bootstrap", "wilson"  # interval kinds (quantkit/evaluate/confidence.py)


@dataclass(frozen=True)
class Metric:
    pattern: str  # the name, or a full-match regex for a family of names (one per task, per speed level)
    unit: str
    higher_is_better: bool
    probe: str  # which probe fills it (quantkit/evaluate/probes); "cost" is derived from speed and successes
    interval: str | None = None  # BOOTSTRAP over scored windows, WILSON on successes / items, or none

    @property
    def family(self) -> str:
        """The name's first part: quality, tasks, speed, memory, cost, tools, safety, generation, artifact."""
        return self.pattern.split("\\.", 1)[0].split(".", 1)[0]

    @property
    def fixed(self) -> bool:
        return re.escape(self.pattern) == self.pattern.replace(".", "\\.")


_LEVEL = r"(c[0-9]+|r[0-9]+(\.[0-9]+)?)"  # c4: closed loop at concurrency 4; r2: Poisson at 2 requests/s
_TASK = r"tasks\.[A-Za-z0-9_.-]+\.[a-z0-9_]+"  # tasks.<task>.<its metric>

CATALOGUE: tuple[Metric, ...] = (
    Metric("quality.perplexity", "ppl", LOWER, "quality", BOOTSTRAP),
    Metric("quality.kl_mean", "nats", LOWER, "quality", BOOTSTRAP),
    Metric("quality.kl_p99", "nats", LOWER, "quality"),
    Metric("quality.top1_agreement", "fraction", HIGHER, "quality", BOOTSTRAP),
    Metric("quality.reference_perplexity", "ppl", LOWER, "reference", BOOTSTRAP),
    Metric("quality.engine_vs_reference", "fraction", LOWER, "reference"),
    Metric("quality.engine_gap", "fraction", LOWER, "reference"),  # needs both sides: metrics.metrics_table
    Metric(_TASK, "fraction", HIGHER, "tasks", WILSON),
    Metric("tasks.mean_acc", "fraction", HIGHER, "tasks", WILSON),
    Metric("tasks.success_rate", "fraction", HIGHER, "tasks", WILSON),
    Metric(rf"speed\.{_LEVEL}\.(ttft|tpot|itl|e2e)_ms_p(50|90|99)", "ms", LOWER, "speed"),
    Metric(rf"speed\.{_LEVEL}\.output_tok_s", "tok/s", HIGHER, "speed"),
    Metric(rf"speed\.{_LEVEL}\.requests_s", "req/s", HIGHER, "speed"),
    Metric(rf"speed\.{_LEVEL}\.failed", "requests", LOWER, "speed"),
    Metric(rf"speed\.{_LEVEL}\.queue_ms_mean", "ms", LOWER, "speed"),
    Metric(rf"speed\.{_LEVEL}\.kv_cache_usage_max", "fraction", LOWER, "speed"),
    Metric(rf"speed\.{_LEVEL}\.preemptions", "count", LOWER, "speed"),
    Metric("tools.valid_rate", "fraction", HIGHER, "checks", WILSON),
    Metric("tools.baseline_agreement", "fraction", HIGHER, "checks", WILSON),
    Metric("tools.name_accuracy", "fraction", HIGHER, "checks", WILSON),
    Metric("tools.exact_accuracy", "fraction", HIGHER, "checks", WILSON),
    Metric("safety.refusal_rate_harmful", "fraction", HIGHER, "checks", WILSON),
    Metric("safety.refusal_rate_benign", "fraction", LOWER, "checks", WILSON),
    Metric("safety.flip_rate", "fraction", LOWER, "checks", WILSON),
    Metric("generation.degenerate_rate", "fraction", LOWER, "checks", WILSON),
    Metric("generation.degenerate_excess", "fraction", LOWER, "checks", WILSON),
    # what the default speed, memory and cost gates read, whatever levels the suite measured
    Metric("speed.decode_tpot_ms_p50", "ms", LOWER, "speed"),
    Metric("speed.peak_output_tok_s", "tok/s", HIGHER, "speed"),
    Metric("speed.failed_requests", "requests", LOWER, "speed"),
    Metric("memory.engine_bytes", "bytes", LOWER, "memory"),
    Metric("cost.machine_s_per_k_successful_tasks", "s/1k", LOWER, "cost"),
    Metric("artifact.coverage", "fraction", HIGHER, "artifact"),
    Metric("artifact.nonfinite_tensors", "count", LOWER, "artifact"),
    Metric("artifact.experts_unrecorded", "count", LOWER, "artifact"),
    Metric("memory.checkpoint_bytes", "bytes", LOWER, "memory"),
    Metric("memory.weight_bytes", "bytes", LOWER, "memory"),
    Metric("memory.kv_cache_tokens", "tokens", HIGHER, "memory"),
    Metric("memory.peak_rss_bytes", "bytes", LOWER, "memory"),
    Metric("memory.peak_pss_bytes", "bytes", LOWER, "memory"),
    Metric("memory.peak_hwm_bytes", "bytes", LOWER, "memory"),
    Metric("memory.peak_gpu_bytes", "bytes", LOWER, "memory"),
    Metric("memory.gpu_util_mean", "percent", LOWER, "memory"),
    Metric("cost.usd_per_mtok_output", "USD/Mtok", LOWER, "cost"),
    Metric("cost.usd_per_k_successful_tasks", "USD/1k", LOWER, "cost"),
)

# The name space a gate may be written against (a recipe's gate is checked at parse time): every family's
# names, measured or not yet; a name that fits but is absent from a report fails at gate time, saying
# which names exist.
METRIC_PATTERNS = (
    r"quality\.[a-z0-9_]+",
    r"tasks\.[a-z0-9_]+",
    _TASK,
    rf"speed\.{_LEVEL}\.[a-z0-9_]+",
    r"speed\.[a-z0-9_]+",
    r"memory\.[a-z0-9_]+",
    r"cost\.[a-z0-9_]+",
    r"tools\.[a-z0-9_]+",
    r"safety\.[a-z0-9_]+",
    r"generation\.[a-z0-9_]+",
    r"artifact\.[a-z0-9_]+",
)


def is_metric_name(name: str) -> bool:
    """Does `name` fit a family the report writes? A '*' (a gate over every matching metric) stands for a part."""
    probe = name.replace("*", "x")
    return any(re.fullmatch(p, probe) for p in METRIC_PATTERNS)


_BY_NAME = {m.pattern: m for m in CATALOGUE if m.fixed}


@lru_cache(maxsize=4096)
def metric(name: str) -> Metric:
    """The catalogue entry of a metric name; KeyError for a name no entry defines."""
    if name in _BY_NAME:
        return _BY_NAME[name]
    for m in CATALOGUE:
        if not m.fixed and re.fullmatch(m.pattern, name):
            return m
    raise KeyError(f"{name!r} is not in the metric catalogue (quantkit/evaluate/catalogue.py)")


def family(name: str) -> str:
    """The family of a metric name or gate pattern ("artifact" of artifact.coverage)."""
    return name.split(".", 1)[0]


def fixed_names(probe: str | None = None, interval: str | None = None) -> list[str]:
    """The catalogue's single-name metrics, in catalogue order, optionally of one probe or interval kind."""
    return [m.pattern for m in CATALOGUE if m.fixed and probe in (None, m.probe) and interval in (None, m.interval)]


def labelled(values: dict[str, Any]) -> dict[str, tuple[Any, str, bool]]:
    """{name: value} -> {name: (value, unit, higher_is_better)} from the catalogue."""
    return {name: (v, metric(name).unit, metric(name).higher_is_better) for name, v in values.items()}


def dig(d: dict | None, *path, default=None) -> Any:
    """The value at `path` in nested dicts (a side's figures: dig(side, "checks", "tools", "valid_rate")), else
    `default`."""
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return default
        d = d[p]
    return d
