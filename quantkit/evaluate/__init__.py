"""`quantkit eval`: baseline and candidate in the same engine, on the same work.

Entry point: `run_eval(artifact, baseline=None, suite=None, output=None, ...) -> Path` (the report
folder; default `<artifact>/eval`). Modules: suite (which EvalSpec runs),
quality (perplexity, top-1 agreement, top-k KL), tasks (lm-eval via local-completions), speed
(seeded streaming workload), memory, metrics (the flat report table and cost), diagnose ("where the
wait is"), plots, report (report.json / report.md; owns the schema, paths and metric names), run
(orchestration). Engines live in quantkit.engine.
"""

from __future__ import annotations

from pathlib import Path


def run_eval(artifact: Path | None, baseline: Path | None = None, suite: str | Path | None = None,
             output: Path | None = None, **kwargs) -> Path:
    """See quantkit.evaluate.run.run_eval (imported lazily: it pulls in transformers)."""
    from quantkit.evaluate.run import run_eval as _run

    return _run(artifact, baseline, suite, output, **kwargs)


__all__ = ["run_eval"]
