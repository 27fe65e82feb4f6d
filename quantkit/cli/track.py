"""`quantkit ui`: MLflow's UI on the tracking store quantkit logs to (quantkit/tracking.py), bound to 127.0.0.1.
`quantkit compare REPORT...`: several evals of one baseline on one page (quantkit/compare.py), logged as a run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Annotated

import typer

from quantkit.cli.common import fail, tracked


def ui(port: Annotated[int, typer.Option("--port", help="Port on 127.0.0.1.")] = 5000,
       print_only: Annotated[bool, typer.Option("--print", help="Print the command instead of running it.")] = False) -> None:
    """Start MLflow's UI on the store quantkit tracks runs in (and publishes to); Ctrl-C stops it."""
    from quantkit.tracking import store_uri

    uri = store_uri()
    if uri.startswith(("http://", "https://")):
        fail(f"QUANTKIT_TRACKING_URI is a server ({uri}): open it in a browser; `quantkit ui` serves a local store")
    cmd = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", uri, "--registry-store-uri", uri,
           "--host", "127.0.0.1", "--port", str(port)]
    if print_only:
        typer.echo(" ".join(cmd))
        return
    typer.echo(f"MLflow UI on http://127.0.0.1:{port} (store {uri}); Ctrl-C stops it", err=True)
    raise typer.Exit(subprocess.call(cmd, env={**os.environ}))


def compare(ctx: typer.Context,
            reports: Annotated[list[Path], typer.Argument(help="Two or more report.json files (or artifact / eval "
                                                                "folders) of one baseline.")],
            output: Annotated[Path, typer.Option("--output", "-o", help="Folder for compare.md and its plots.")]
            = Path("runs/compare")) -> None:
    """One page comparing candidates: quality against cost, latency percentiles, per-task recovery, verdicts."""
    from quantkit import compare as cmp

    entries = cmp.load(reports)
    base = (entries[0].report.get("baseline") or {}).get("path") or "unknown"
    with tracked(ctx, "compare", base, "compare " + " vs ".join(e.name for e in entries)) as run:
        md = cmp.write(entries, output.expanduser().resolve())
        if run is not None:
            for f in [md, *sorted((md.parent / "plots").glob("*.png"))]:
                run.artifact(f, None if f == md else "plots")
            run.tags({f"quantkit.candidate.{i}": e.name for i, e in enumerate(entries)})
    typer.echo(str(md))


def register(app: typer.Typer) -> None:
    app.command("ui")(ui)
    app.command("compare")(compare)
