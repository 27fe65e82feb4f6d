"""`quantkit tune`: measure a matrix of recipes and engine settings, one change at a time, and choose the
cheapest artifact that passes the gates (the field guide's steps 4-8).

    study.py    the study file, its axes and the cells they expand to
    run.py      running the cells (convert once, eval against the cached baseline, gate), resumable
    choose.py   the figures, Pareto fronts and the recommendation (pure functions of the records)
    report.py   tune.json, tune.md and the Pareto plots
    sensitivity/  `quantkit sensitivity`: per-module sensitivity -> a mixed-precision recipe
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from quantkit.tune.study import Study, StudyError, load_study


def tune(study: str | Path, output: str | Path | None = None, *, cells: list[str] | None = None,
         rerun: bool = False, retry_failed: bool = False, publish: bool = False,
         progress: Callable[[str], None] = print) -> dict:
    """Run (or continue) a study and write its tables; returns tune.json's content. With `publish`, the
    recommended cell's artifact is gated and published (with its eval report) through the registry."""
    from quantkit.tune import report as R
    from quantkit.tune.run import run_study

    st = load_study(study)
    out = run_study(st, Path(output) if output else None, cells=cells, rerun=rerun, retry_failed=retry_failed,
                    progress=progress)
    data = R.write(st, out)
    progress(f"tune: {out / 'tune.md'}")
    rec = data["recommended"]
    progress(f"recommended: {rec['id']} ({rec['reason']})" if rec["id"] else f"no recommendation: {rec['reason']}")
    if publish:
        data["published"] = publish_recommended(data)
        progress(f"published {data['published']['name']} version {data['published']['version']}")
    return data


def publish_recommended(data: dict) -> dict:
    """Gate the recommended cell's report again (gate.json beside it) and publish its artifact with it."""
    from quantkit.gates import GateError, run_gates
    from quantkit.registry import publish

    rec = data["recommended"]
    if not rec.get("id"):
        raise GateError(f"nothing to publish: {rec['reason']}")
    cell = next(r for r in data["cells"] if r["id"] == rec["id"])
    gr = run_gates(cell["report"])
    if not gr.passed:
        raise GateError(f"cell {cell['id']} no longer passes its gates ({cell['report']}); re-run the study")
    info = publish(cell["artifact"], report=cell["report"])
    return {"cell": cell["id"], "name": info.name, "version": info.version, "engine_args": cell.get("engine_args")}


__all__ = ["tune", "publish_recommended", "load_study", "Study", "StudyError"]
