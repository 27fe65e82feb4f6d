"""Exclusive locks between quantkit processes: one conversion per output, one eval per report folder, one
publish per registered model name.

A lock is a small file beside what it protects, held with `flock(LOCK_EX | LOCK_NB)`. The kernel drops a
flock when its holder dies, however it dies (kill -9 included), so a lock can never outlive its process;
the file's JSON (pid, host, start time, command) says who holds it, for the refusal message. A lock file
that still names a process when we take the lock is a dead holder's: the takeover is logged. The file is
removed on release; `acquire` re-checks after locking that the file it locked is still the one at the
path, so a release racing with a new acquire cannot leave two holders.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import Iterator

from quantkit.errors import LockHeld

log = logging.getLogger("quantkit")


def _read(fd: int) -> dict:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        raw = os.read(fd, 65536)
        return json.loads(raw) if raw.strip() else {}
    except (OSError, ValueError):
        return {}


def _holder_text(info: dict) -> str:
    if not info:
        return "another quantkit process"
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.get("started", 0)))
    return f"PID {info.get('pid')} on {info.get('host')} (since {started}: {info.get('command', '?')})"


@contextlib.contextmanager
def exclusive(lock_path: Path, what: str) -> Iterator[dict]:
    """Hold the lock at `lock_path` for the block; refuse with LockHeld (naming the holder) if a live
    process holds it. `what` names the protected thing in messages ("the conversion into runs/x")."""
    lock_path = Path(lock_path)
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(fd)
            os.close(fd)
            raise LockHeld(f"{what} is in progress in {_holder_text(holder)}; wait for it to finish or stop it "
                           f"(lock: {lock_path})") from None
        try:  # the path may have been released (unlinked) and re-created between open and flock
            same = os.stat(lock_path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        stale = _read(fd)
        if stale.get("pid") and stale.get("pid") != os.getpid():
            log.warning("took over the lock on %s from %s, which is no longer running", what, _holder_text(stale))
        info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
                "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])[:500], "stale_taken_over": stale or None}
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, json.dumps(info).encode())
        os.fsync(fd)
        yield info
    finally:
        with contextlib.suppress(OSError):
            os.unlink(lock_path)
        os.close(fd)  # releases the flock


def lock_beside(path: Path) -> Path:
    """The lock file for a folder or file: `.<name>.lock` next to it."""
    path = Path(path)
    return path.parent / f".{path.name}.lock"
