"""`quantkit` command line: one module per command group, each a thin adapter over quantkit.api (or the
function a Python user would call), each adding its commands with `register(app)`. Nothing is discovered.

    convert.py   convert, inspect, capability, recipes list|validate|corpora, models fetch
    evaluate.py  eval
    registry.py  gate, publish, promote, rollback, registry list|show|pull
"""

from __future__ import annotations

import typer

from quantkit.cli import convert, evaluate, registry

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Quantize an LLM from a YAML recipe into a vLLM-ready checkpoint, and prove it is worth serving.")
for _group in (convert, evaluate, registry):
    _group.register(app)


def main() -> None:  # pragma: no cover
    app()
