"""`quantkit eval`: a thin adapter over quantkit.evaluate.run_eval (quantkit.api.evaluate).

Examples:
    quantkit eval runs/smollm2-w8a8-rtn                       # default suite, baseline from the manifest
    quantkit eval runs/smollm2-w8a8-rtn --suite smoke -o /tmp/smoke
    quantkit eval runs/x --suite evals/suites/serving.yaml --overwrite
    quantkit eval runs/x --candidate-url http://127.0.0.1:30000 --served-model my-model   # another engine
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from quantkit.cli.common import fail, tracked


def eval_cmd(
    ctx: typer.Context,
    artifact: Annotated[Optional[Path], typer.Argument(help="Artifact folder (with manifest.json).")] = None,
    baseline: Annotated[Optional[Path], typer.Option("--baseline", help="Baseline model folder (default: the artifact's base model).")] = None,
    suite: Annotated[Optional[str], typer.Option("--suite", help="A shipped suite by name (default, full, smoke, serving) or a YAML file; default: the recipe's eval section.")] = None,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Report folder (default: <artifact>/eval).")] = None,
    candidate_url: Annotated[Optional[str], typer.Option("--candidate-url", help="Measure an already-running OpenAI-compatible server as the candidate (engine type `openai`).")] = None,
    baseline_url: Annotated[Optional[str], typer.Option("--baseline-url", help="Measure an already-running server as the baseline.")] = None,
    served_model: Annotated[Optional[str], typer.Option("--served-model", help="Model name on the external server (default: its first).")] = None,
    no_baseline: Annotated[bool, typer.Option("--no-baseline", help="Measure the candidate only (no deltas, no divergence).")] = False,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing report folder.")] = False,
    fresh_baseline: Annotated[bool, typer.Option("--fresh-baseline", help="Measure the baseline anew instead of reusing a cached measurement of the same model, suite, engine and machine.")] = False,
) -> None:
    """Load baseline and candidate into vLLM (one at a time) and measure quality, memory and speed on the same work."""
    from quantkit import tracking
    from quantkit.api import evaluate
    from quantkit.evaluate.run import IncompleteEval

    if artifact is None and candidate_url is None:
        fail("give an ARTIFACT folder or --candidate-url")
    model, name = _subject(artifact, baseline, candidate_url)
    with tracked(ctx, "eval", model, f"eval {name}", {"quantkit.suite_arg": suite or "recipe"}) as run:
        try:
            out = evaluate(artifact, baseline, suite, output, candidate_url=candidate_url, baseline_url=baseline_url,
                           served_model=served_model, skip_baseline=no_baseline, overwrite=overwrite,
                           fresh_baseline=fresh_baseline, progress=lambda msg: typer.echo(msg, err=True))
        except IncompleteEval:
            if run is not None:  # the FAILED run still shows what was measured, and what was not
                _log_report(run, _report_path(artifact, output))
            raise
        except KeyboardInterrupt:
            typer.echo("interrupted: engines stopped; figures of models already finished are in the output's raw/ folder", err=True)
            raise
        if run is not None:
            tracking.log_eval(run, out / "report.json")
    typer.echo(str(out / "report.json"))


def _subject(artifact: Path | None, baseline: Path | None, candidate_url: str | None) -> tuple[str, str]:
    """(base model, candidate name) for the tracking run's experiment and name, read before anything loads."""
    import json

    man = artifact / "manifest.json" if artifact is not None else None
    if man is not None and man.is_file():
        data = json.loads(man.read_text())
        return str((data.get("base_model") or {}).get("path") or "unknown"), str(data.get("name") or artifact.name)
    return str(baseline or "external"), str(artifact.name if artifact is not None else candidate_url)


def _report_path(artifact: Path | None, output: Path | None) -> Path:
    from quantkit.evaluate.report import default_report_path

    return output / "report.json" if output is not None else default_report_path(artifact)


def _log_report(run, path: Path) -> None:
    from quantkit import tracking

    if path.is_file():
        tracking.log_eval(run, path)


def register(app: typer.Typer) -> None:
    """Add `quantkit eval` to `app`."""
    app.command("eval")(eval_cmd)
