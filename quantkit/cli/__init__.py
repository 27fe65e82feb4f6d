"""`quantkit` command line: one module per command group, each a thin adapter over quantkit.api (or the
function a Python user would call), each adding its commands with `register(app)`. Nothing is discovered.

    common.py    the error boundary (one line and a documented exit code per failure), shared options
    convert.py   convert, inspect, capability, recipes list|validate|corpora, models fetch
    evaluate.py  eval
    registry.py  gate, publish, promote, rollback, registry list|show|pull
    tune.py      tune
    track.py     ui (MLflow's UI on the tracking store)
"""

from __future__ import annotations

from typing import Annotated

import typer

from quantkit.cli import convert, evaluate, registry, track, tune
from quantkit.cli.common import BoundaryGroup

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, cls=BoundaryGroup,
                  help="Quantize an LLM from a YAML recipe into a vLLM-ready checkpoint, and prove it is worth serving. "
                       "Exit codes: 0 ok, 1 a check failed, 2 refused (bad input, existing output, lock held), "
                       "3 environment (disk, I/O, engine, registry backend), 4 internal error, 130 interrupted.")


@app.callback()
def _root(ctx: typer.Context,
          debug: Annotated[bool, typer.Option("--debug", help="Show the traceback of a failure instead of one line.")] = False,
          track: Annotated[bool, typer.Option("--track/--no-track", help="Log each command as an MLflow run in the "
                                              "tracking store (QUANTKIT_NO_TRACK=1 also turns it off).")] = True) -> None:
    ctx.obj = {"debug": debug, "track": None if track else False}


for _group in (convert, evaluate, registry, tune, track):
    _group.register(app)


def main() -> None:  # pragma: no cover
    app()
