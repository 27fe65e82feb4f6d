"""`quantkit tune`: a thin adapter over quantkit.tune.tune.

Examples:
    quantkit tune studies/smollm2-tune.yaml                 # run or continue the study, write tune.md
    quantkit tune studies/smollm2-tune.yaml --list          # the cells it expands to, and their state
    quantkit tune studies/smollm2-tune.yaml --cell method=w4a16-gptq --rerun     # one cell again
    quantkit tune studies/smollm2-tune.yaml --publish       # ... and publish the recommended artifact
    quantkit sensitivity recipes/smollm2-w4a16-gptq.yaml --budget size=1.0x     # mixed precision, same size
    quantkit sensitivity recipes/smollm2-w4a16-gptq.yaml --budget kl=0.05 --high none
    quantkit sensitivity recipes/smollm2-w4a16-gptq.yaml --budget tpot=20ms \
        --latency-from runs/smollm2-w4a16-gptq/eval/report.json --latency-from runs/smollm2-w8a8-rtn/eval/report.json
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from quantkit.cli.common import JsonOut, tracked


def tune_cmd(
    ctx: typer.Context,
    study: Annotated[Path, typer.Argument(help="The study YAML (base recipe, axes, price, load).")],
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Study folder (default: runs/tune/<study name>).")] = None,
    cell: Annotated[Optional[list[str]], typer.Option("--cell", help="Run only this cell (repeatable); its artifact cell runs too if unfinished.")] = None,
    rerun: Annotated[bool, typer.Option("--rerun", help="With --cell: run it again even if finished.")] = False,
    retry_failed: Annotated[bool, typer.Option("--retry-failed", help="Run failed cells again (finished ones never re-run).")] = False,
    publish: Annotated[bool, typer.Option("--publish", help="Gate and publish the recommended cell's artifact.")] = False,
    list_only: Annotated[bool, typer.Option("--list", help="Show the cells and their state; run nothing.")] = False,
    json_out: JsonOut = False,
) -> None:
    """Measure a matrix of recipes and engine settings, one change at a time, and recommend the cheapest
    artifact that passes the base recipe's gates. Exit 0 with a recommendation, 1 without one."""
    from quantkit.tune import load_study, tune
    from quantkit.tune.run import load_records, study_dir

    if rerun and not cell:
        raise typer.BadParameter("--rerun re-runs the cells named with --cell; name them (finished cells are kept)")
    if list_only:
        st = load_study(study)
        out = study_dir(st, output)
        rows = load_records(st, out)
        if json_out:
            typer.echo(json.dumps(rows, indent=2, default=str))
            return
        for r in rows:
            typer.echo(f"{r['id']:<40} {r.get('kind', ''):<8} {r.get('status') or 'not run'}"
                       + (f"  {r['reason']}" if r.get("reason") else ""))
        return
    st = load_study(study)
    with tracked(ctx, "tune", str(st.base.model.path), f"tune {st.spec.name}") as run:
        data = tune(study, output, cells=cell, rerun=rerun, retry_failed=retry_failed, publish=publish,
                    progress=lambda m: typer.echo(m, err=True))
        if run is not None:
            from quantkit import tracking

            tracking.log_study(run, load_records(st, study_dir(st, output)), data)
    if json_out:
        typer.echo(json.dumps({k: data[k] for k in ("recommended", "pareto", "plots") if k in data}, indent=2))
    if not data["recommended"].get("id"):
        raise typer.Exit(1)


def sensitivity_cmd(
    ctx: typer.Context,
    recipe: Annotated[str, typer.Argument(help="The uniform low-bit recipe (one rtn or gptq stage), file or shipped name.")],
    budget: Annotated[list[str], typer.Option("--budget", help="kl=<predicted KL>, size=<80MB | 1.05x the uniform checkpoint> or tpot=<ms>; repeat to combine (all must hold).")],
    high: Annotated[str, typer.Option("--high", help="Scheme for the modules kept high: W8A8, or none (the model dtype).")] = "W8A8",
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Folder (default: runs/sensitivity/<recipe name>).")] = None,
    validate: Annotated[int, typer.Option("--validate", min=0, help="Units whose full-model KL checks the proxy (0: none; a kl budget needs some).")] = 16,
    latency_from: Annotated[Optional[list[Path]], typer.Option("--latency-from", help="quantkit eval report(s) with the engine's TPOT at both ends (see docs).")] = None,
    latency_metric: Annotated[str, typer.Option("--latency-metric", help="The report metric a tpot budget reads.")] = "speed.c1.tpot_ms_p50",
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="Override a recipe field: a.b=value (repeatable).")] = None,
    device: Annotated[str, typer.Option("--device", help="auto, cpu, cuda or cuda:N.")] = "auto",
    json_out: JsonOut = False,
) -> None:
    """Rank every fused module group by its effect on its layer's output at the recipe's low-bit scheme, check the
    ranking against the full-model KL, and write a mixed-precision recipe that keeps the most sensitive groups
    at the high scheme until the budget is met. Exit 0 when the budget is met, 1 when it cannot be."""
    from quantkit import api
    from quantkit.tune.sensitivity import SensitivityOptions

    opts = SensitivityOptions(high=high, validate=validate, latency_from=latency_from, latency_metric=latency_metric,
                              device=device, progress=lambda m: typer.echo(m, err=True))
    from quantkit.recipe import load_recipe

    r = load_recipe(recipe, set_ or [])
    with tracked(ctx, "sensitivity", str(r.model.path), f"sensitivity {r.name}", {"quantkit.budget": " ".join(budget)}) as run:
        data = api.sensitivity(recipe, budget, output, overrides=set_ or [], options=opts)
        if run is not None:
            run.metrics({f"choice.{k}": v for k, v in data["choice"].items() if not isinstance(v, bool)})
            run.tags({"quantkit.budget_met": data["choice"].get("met"), "mlflow.note.content":
                      f"budget {' '.join(budget)}: {'met' if data['choice'].get('met') else 'NOT met'}"})
            run.artifact(Path(data["recipe_path"]))
    c = data["choice"]
    if json_out:
        typer.echo(json.dumps({"choice": c, "validation": data["validation"], "recipe_path": data["recipe_path"]},
                              indent=2))
    else:
        typer.echo(data["recipe_path"])
    if not c["met"]:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    """Add `quantkit tune` and `quantkit sensitivity` to `app`."""
    app.command("tune")(tune_cmd)
    app.command("sensitivity")(sensitivity_cmd)
