"""What every command module shares: the one error boundary, the failure exit, and the typed options used
in several commands.

Exit codes (quantkit/errors.py has the full list): 0 ok; 1 a check failed (a gate, a checksum, an
artifact this machine cannot serve); 2 refused: bad input, an existing output or a held lock, with one
line naming the file or field and the fix; 3 the environment failed (disk full, I/O, engine, registry
backend); 4 internal error, with the traceback in a log file; 130 interrupted.

The boundary is `BoundaryGroup.invoke`, the root command group's: whatever a command raises ends there,
as one line on stderr and its exit code. `quantkit --debug ...` (or QUANTKIT_DEBUG=1) lets the
traceback through instead.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
import sys
import traceback
from pathlib import Path
from typing import Annotated, NoReturn

import click
import typer
from typer.core import TyperGroup

from quantkit.errors import (ENVIRONMENT_ERRNOS, EXIT_CHECK_FAILED, EXIT_ENVIRONMENT, EXIT_INTERNAL, EXIT_INTERRUPTED,
                             EXIT_REFUSED, QuantkitError, describe_os_error)

Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bars; errors only.")]
JsonOut = Annotated[bool, typer.Option("--json", help="Print JSON.")]


def fail(msg: str, code: int = EXIT_REFUSED) -> NoReturn:
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(code)


def _classes() -> list[tuple[tuple[type[BaseException], ...], int]]:
    """Expected failures by class -> exit code. The first match wins; imported here, lazily, so the
    table is the one place that knows every module's error class."""
    from quantkit.data import DataError
    from quantkit.engine import EngineError
    from quantkit.engine.client import ServerError
    from quantkit.evaluate.tasks import TaskError
    from quantkit.gates import GateError
    from quantkit.model import ModelError
    from quantkit.plan import ConvertError
    from quantkit.quantize.finetune import QATError
    from quantkit.recipe import RecipeError
    from quantkit.registry.base import RegistryError

    table: list[tuple[tuple[type[BaseException], ...], int]] = [
        ((EngineError, ServerError), EXIT_ENVIRONMENT),
        ((RecipeError, ModelError, DataError, ConvertError, QATError, GateError, TaskError, RegistryError,
          FileExistsError, FileNotFoundError, NotADirectoryError, IsADirectoryError), EXIT_REFUSED),
    ]
    try:
        from mlflow.exceptions import MlflowException

        table.append(((MlflowException,), EXIT_ENVIRONMENT))
    except ImportError:  # pragma: no cover - mlflow is a dependency
        pass
    return table


def classify(exc: BaseException) -> tuple[int, str] | None:
    """(exit code, one line) for an expected failure; None for a bug."""
    if isinstance(exc, QuantkitError):
        return exc.exit_code, str(exc)
    if isinstance(exc, OSError) and exc.errno in ENVIRONMENT_ERRNOS:
        return EXIT_ENVIRONMENT, describe_os_error(exc)
    for classes, code in _classes():
        if isinstance(exc, classes):
            return code, str(exc)
    return None


def crash_log(exc: BaseException) -> Path | None:
    """Write the traceback of an unexpected exception to QUANTKIT_HOME/logs/; its path, or None."""
    from quantkit.io import quantkit_home

    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = quantkit_home() / "logs" / f"crash-{stamp}-{os.getpid()}.log"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write("quantkit " + " ".join(sys.argv[1:]) + "\n\n")
            traceback.print_exception(exc, file=f)
        return path
    except OSError:
        return None


def debug_enabled(ctx: click.Context | None) -> bool:
    if os.environ.get("QUANTKIT_DEBUG", "") not in ("", "0"):
        return True
    root = ctx.find_root() if ctx is not None else None
    return bool(root is not None and (root.obj or {}).get("debug"))


def _click_flow_classes() -> tuple[type[BaseException], ...]:
    """Exit / abort / usage-error classes click reports itself: click's, and those of the copy of click that
    typer >= 0.26 vendors as typer._click (its parser raises those, e.g. NoSuchOption for an unknown flag)."""
    classes: list[type[BaseException]] = [typer.Exit, typer.Abort, click.exceptions.Exit,
                                          click.exceptions.ClickException, click.exceptions.Abort]
    try:
        from typer._click import exceptions as vendored
    except ImportError:  # pragma: no cover - a typer that uses click itself
        return tuple(classes)
    return tuple(classes + [getattr(vendored, n) for n in ("Exit", "ClickException", "Abort") if hasattr(vendored, n)])


_CLICK_FLOW = _click_flow_classes()


class BoundaryGroup(TyperGroup):
    """The root command group: every command's exception ends here as one line and an exit code."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except _CLICK_FLOW:
            raise  # typer.Exit, usage errors: click reports them
        except KeyboardInterrupt:
            typer.echo("interrupted: rerun the same command to resume", err=True)
            raise typer.Exit(EXIT_INTERRUPTED) from None
        except Exception as exc:  # noqa: BLE001 - this is the boundary
            if debug_enabled(ctx):
                raise
            known = classify(exc)
            if known is not None:
                code, msg = known
                typer.echo(f"error: {msg}", err=True)
                raise typer.Exit(code) from None
            where = getattr(exc, "quantkit_crash_log", None) or crash_log(exc)  # a tracked run may have written it
            hint = f"; the traceback is in {where}" if where else ""
            typer.echo(f"error: internal error ({type(exc).__name__}: {exc}){hint}. Rerun with --debug to see it "
                       "here, and please report it.", err=True)
            raise typer.Exit(EXIT_INTERNAL) from None


def tracking_on(ctx: click.Context | None) -> bool:
    """`quantkit --no-track ...` or QUANTKIT_NO_TRACK=1 turns run tracking off (quantkit/tracking.py)."""
    from quantkit import tracking

    root = ctx.find_root() if ctx is not None else None
    flag = (root.obj or {}).get("track") if root is not None else None
    return tracking.enabled(None if flag is None else bool(flag))


@contextlib.contextmanager
def _sigterm_interrupts():
    """SIGTERM (a scheduler's or `kill`'s stop) raises KeyboardInterrupt while a tracked command runs, so its run
    ends KILLED and the command exits 130 like Ctrl-C, instead of dying with its run left RUNNING."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    old = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


@contextlib.contextmanager
def tracked(ctx: click.Context | None, kind: str, model: str, name: str, tags: dict | None = None, on: bool = True):
    """An MLflow run around a command, opened before any work (None when tracking is off, or `on` is False: a
    rank other than 0). It ends FINISHED (a gate that fails is a finished gate run), FAILED with the error line
    and crash-log path, or KILLED."""
    if not on or not tracking_on(ctx):
        yield None
        return
    from quantkit import tracking

    why_not = tracking.unavailable()
    if why_not:
        typer.echo(f"note: {why_not}", err=True)
        yield None
        return
    run = tracking.open_run(kind, model, name, tags)
    try:
        with _sigterm_interrupts():
            yield run
    except KeyboardInterrupt as exc:
        run.end("KILLED", f"interrupted ({exc})" if str(exc) else "interrupted (Ctrl-C)")
        raise
    except _CLICK_FLOW as exc:
        code = getattr(exc, "exit_code", 0) or 0
        run.end("FINISHED" if code in (0, EXIT_CHECK_FAILED) else "FAILED", None if code == 0 else f"exit {code}")
        raise
    except Exception as exc:  # noqa: BLE001 - recorded, then re-raised to the boundary
        known = classify(exc)
        where = None if known else crash_log(exc)
        if where is not None:
            exc.quantkit_crash_log = where  # the boundary names this file instead of writing a second one
        line = known[1] if known else f"internal error ({type(exc).__name__}: {exc})"
        run.end("FAILED", line.splitlines()[0][:1000] if line else type(exc).__name__, str(where) if where else None)
        raise
    else:
        run.end("FINISHED")


__all__ = ["BoundaryGroup", "EXIT_CHECK_FAILED", "JsonOut", "Quiet", "classify", "fail", "tracked", "tracking_on"]
