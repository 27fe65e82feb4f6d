"""`quantkit tune`: a thin adapter over quantkit.tune.tune.

Examples:
    quantkit tune studies/smollm2-tune.yaml                 # run or continue the study, write tune.md
    quantkit tune studies/smollm2-tune.yaml --list          # the cells it expands to, and their state
    quantkit tune studies/smollm2-tune.yaml --cell method=w4a16-gptq --rerun     # one cell again
    quantkit tune studies/smollm2-tune.yaml --publish       # ... and publish the recommended artifact
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from quantkit.cli.common import JsonOut


def tune_cmd(
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
    data = tune(study, output, cells=cell, rerun=rerun, retry_failed=retry_failed, publish=publish,
                progress=lambda m: typer.echo(m, err=True))
    if json_out:
        typer.echo(json.dumps({k: data[k] for k in ("recommended", "pareto", "plots") if k in data}, indent=2))
    if not data["recommended"].get("id"):
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    """Add `quantkit tune` to `app`."""
    app.command("tune")(tune_cmd)
