"""Failures quantkit expects, and what each one means for the user and for CI's exit code.

Every command ends in one of these exit codes (quantkit/cli/common.py turns exceptions into them):

    0    done
    1    a check failed: a gate, a checksum, an artifact this machine cannot serve
    2    refused: bad input (recipe, model files, calibration data, report), an output that exists,
         or a lock another quantkit process holds; the message names the file or field and the fix
    3    the environment failed: disk full, an I/O or permission error, the engine would not start,
         the registry backend failed; the message says what to check, and rerunning resumes
    4    internal error (a bug): one line, and the traceback in a log file whose path is printed
    130  interrupted (Ctrl-C or SIGTERM); a conversion resumes when the same command is run again

Module-level errors (RecipeError, ModelError, DataError, ConvertError, EngineError, RegistryError, ...)
keep their own classes where they are raised; the CLI's one table maps each to its code. The classes
here are the ones several modules raise.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

EXIT_OK, EXIT_CHECK_FAILED, EXIT_REFUSED, EXIT_ENVIRONMENT, EXIT_INTERNAL, EXIT_INTERRUPTED = 0, 1, 2, 3, 4, 130


class QuantkitError(Exception):
    """An expected failure, phrased for the user: what, where, and the fix."""

    exit_code = EXIT_REFUSED


class LockHeld(QuantkitError):
    """Another live quantkit process holds the lock on a work folder, report folder or model name."""


class EnvironmentFault(QuantkitError):
    """The machine failed us: disk full, I/O error, permission denied."""

    exit_code = EXIT_ENVIRONMENT


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _free_bytes(path: Path) -> int | None:
    for p in (path, *path.parents):
        if p.exists():
            return shutil.disk_usage(p).free
    return None


def describe_os_error(exc: OSError, needed_bytes: int | None = None, resumes: bool = False) -> str:
    """One line for an OSError: which file, what happened, and what to do."""
    where = exc.filename or "a file"
    after = " Rerunning the same command resumes where it stopped." if resumes else ""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        free = _free_bytes(Path(str(where)).parent) if exc.filename else None
        need = f"; this run needs about {human_bytes(needed_bytes)} in all" if needed_bytes else ""
        have = f" ({human_bytes(free)} free there{need})" if free is not None else need
        return f"{where}: no space left on device{have}. Free space, or write to a larger disk (--output).{after}"
    if exc.errno == errno.EIO:
        return (f"{where}: I/O error while reading or writing it; the disk or the file is damaged. Check the disk "
                f"(dmesg), re-download or re-create the file.{after}")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return f"{where}: permission denied; make it readable/writable for this user or choose another location."
    if exc.errno == errno.EROFS:
        return f"{where}: the file system is read-only; choose a writable location."
    return f"{where}: {exc.strerror or exc}"


def environment_fault(exc: OSError, needed_bytes: int | None = None, resumes: bool = False) -> EnvironmentFault:
    return EnvironmentFault(describe_os_error(exc, needed_bytes, resumes))


ENVIRONMENT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.EACCES, errno.EPERM})
