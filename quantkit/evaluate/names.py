"""The metric names a report carries and a gate may name: one leaf module, imported by the report, the
recipe schema and the gates (it imports nothing of quantkit, so none of them reaches up into another).

METRIC_PATTERNS is an explicit registry of the families `metrics.metrics_table` writes
(tests/test_eval_metrics.py checks that every name it produces fits one). A name that fits a family but is
absent from a report still fails at gate time, saying which names exist.
"""

from __future__ import annotations

import re
from typing import Any

METRIC_PATTERNS = (
    r"quality\.[a-z0-9_]+",                        # quality.perplexity, quality.kl_mean, quality.top1_agreement
    r"tasks\.[a-z0-9_]+",                           # tasks.mean_acc, tasks.success_rate
    r"tasks\.[A-Za-z0-9_.-]+\.[a-z0-9_]+",        # tasks.<task>.acc
    r"speed\.(c[0-9]+|r[0-9]+(\.[0-9]+)?)\.[a-z0-9_]+",  # speed.c4.tpot_ms_p90 (concurrency), speed.r2.* (rate)
    r"speed\.[a-z0-9_]+",                           # speed.decode_tpot_ms_p50, speed.peak_output_tok_s, speed.failed_requests
    r"memory\.[a-z0-9_]+",                          # memory.weight_bytes, memory.engine_bytes, memory.kv_cache_tokens
    r"cost\.[a-z0-9_]+",                            # cost.machine_s_per_k_successful_tasks, cost.usd_per_mtok_output
    r"tools\.[a-z0-9_]+",                           # tools.valid_rate, tools.baseline_agreement
    r"safety\.[a-z0-9_]+",                          # safety.flip_rate, safety.refusal_rate_harmful
    r"generation\.[a-z0-9_]+",                      # generation.degenerate_rate
    r"artifact\.[a-z0-9_]+",                        # artifact.coverage, artifact.nonfinite_tensors
)


def is_metric_name(name: str) -> bool:
    """Does `name` fit a family the report writes? A '*' (a gate over every matching metric) stands for a part."""
    probe = name.replace("*", "x")
    return any(re.fullmatch(p, probe) for p in METRIC_PATTERNS)



# the chat checks' figures (quantkit/evaluate/chat_checks.py): metric -> (unit, higher_is_better). A metric
# "tools.valid_rate" is the rate dict {"value", "successes", "items", "ci95"} at side["checks"]["tools"]["valid_rate"].
CHECK_METRICS = {
    "tools.valid_rate": ("fraction", True),
    "tools.baseline_agreement": ("fraction", True),
    "tools.name_accuracy": ("fraction", True),
    "tools.exact_accuracy": ("fraction", True),
    "safety.refusal_rate_harmful": ("fraction", True),
    "safety.refusal_rate_benign": ("fraction", False),
    "safety.flip_rate": ("fraction", False),
    "generation.degenerate_rate": ("fraction", False),
    "generation.degenerate_excess": ("fraction", False),
}


def dig(d: dict | None, *path, default=None) -> Any:
    """The value at `path` in nested dicts (a side's figures: dig(side, "checks", "tools", "valid_rate")), else
    `default`."""
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return default
        d = d[p]
    return d
