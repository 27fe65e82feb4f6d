"""The tasks probe: lm-eval tasks through the served model (quantkit/evaluate/tasks.py)."""

from __future__ import annotations

from quantkit.evaluate.catalogue import dig
from quantkit.evaluate.probes.base import Probe, ProbeResult, RunContext, Served, Side, section_failure
from quantkit.evaluate.tasks import TaskError, run_tasks


def task_counts(tasks: dict | None) -> tuple[int, int]:
    """(successes, items) pooled over every lm-eval task."""
    rows = (tasks or {}).get("tasks") or {}
    return sum(r["successes"] for r in rows.values()), sum(r["items"] for r in rows.values())


def task_success_rate(tasks: dict | None) -> float | None:
    ok, items = task_counts(tasks)
    return ok / items if items else None


class TasksProbe(Probe):
    name = "tasks"

    def wanted(self, ctx: RunContext, side: Side) -> bool:
        return bool(ctx.spec.tasks)

    def run(self, ctx: RunContext, side: Side, served: Served | None) -> ProbeResult:
        spec = ctx.spec
        ctx.say(side, f"lm-eval tasks {spec.tasks} (limit {spec.task_limit})")
        try:
            return ProbeResult(run_tasks(served.ep, spec.tasks, spec.task_limit, spec.task_concurrency,
                                         spec.max_model_len, ctx.output / "tasks" / side.role))
        except TaskError as exc:
            ctx.say(side, f"tasks failed: {exc}")
            return ProbeResult({"error": str(exc)})

    def failures(self, side: dict, suite: dict) -> list[tuple[str, str]]:
        why = section_failure(side.get("tasks")) if suite.get("tasks") else None
        return [("tasks", why)] if why else []

    def values(self, side: dict) -> dict:
        rows = dig(side, "tasks", "tasks") or {}
        out = {}
        for task, r in rows.items():
            out[f"tasks.{task}.{r['metric']}"] = r["value"]
            for extra, val in (r.get("extra") or {}).items():
                out[f"tasks.{task}.{extra}"] = val
        out["tasks.mean_acc"] = sum(r["value"] for r in rows.values()) / len(rows) if rows else None
        out["tasks.success_rate"] = task_success_rate(side.get("tasks"))
        return out
