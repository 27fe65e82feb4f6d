"""What every command module shares: the failure exit, and the typed options used in several commands.

Exit codes: 0 ok; 1 a check failed (a gate, a checksum, an artifact this machine cannot serve);
2 a refusal or a usage error, with one line naming the file or field and the fix; 130 interrupted.
"""

from __future__ import annotations

from typing import Annotated, NoReturn

import typer

Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bars; errors only.")]
JsonOut = Annotated[bool, typer.Option("--json", help="Print JSON.")]


def fail(msg: str, code: int = 2) -> NoReturn:
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(code)
