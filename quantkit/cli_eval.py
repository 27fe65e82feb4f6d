"""CLI commands for evaluation (`quantkit eval`). Registered onto the main app by quantkit.cli."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add the eval commands to `app`."""
