"""`quantkit ui`: MLflow's UI on the tracking store quantkit logs to (quantkit/tracking.py), bound to 127.0.0.1."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Annotated

import typer

from quantkit.cli.common import fail


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


def register(app: typer.Typer) -> None:
    app.command("ui")(ui)
