"""CLI commands for gates and the registry (`quantkit gate|publish|promote|rollback|registry`)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add the gate and registry commands to `app`."""
