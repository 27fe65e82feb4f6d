"""`quantkit eval`: baseline and candidate in the same engine, on the same work.

Entry point: `run_eval(artifact, baseline=None, suite=None, output=None, ...) -> Path` (the report folder;
default `<artifact>/eval`). Modules: catalogue (every metric, defined once), probes/ (what is measured on a
side), run (orchestration), suite, metrics (the flat table and cost), confidence (intervals), phases (what
makes a report incomplete), report (report.json / report.md), diagnose, plots, baseline_cache; the measurement
math in quality, reference, hf_perplexity, speed, memory, tasks, check_rules. Engines: quantkit.engine.
This package imports none of them at import time (submodules never import the package: no cycle).
docs/evaluation.md says how they fit.
"""

from __future__ import annotations

from pathlib import Path


def run_eval(artifact: Path | None, baseline: Path | None = None, suite: str | Path | None = None,
             output: Path | None = None, **kwargs) -> Path:
    """See quantkit.evaluate.run.run_eval (imported lazily: it pulls in transformers)."""
    from quantkit.evaluate.run import run_eval as _run

    return _run(artifact, baseline, suite, output, **kwargs)


__all__ = ["run_eval"]
